"""`ceiling ledger migrate`: bring a ledger of an earlier format to the current one, once.

An instance enforces only on a ledger stamped with its own format (core/stores/wire.py
LEDGER_FORMAT_VERSION; core/stores/scripted_core.py), so what earlier formats wrote is read here
and nowhere else. From format 1, or a ledger no version stamped (which format 1 read as its own):
- Definitions: one that used a week, a rate or per-user limits carried its ledger id with
  DEFINITION_SUFFIX_V1 after it, for the scripts before those limits to refuse it; it gets the
  plain ledger id, the only one the scripts now read (lua/migrate_definitions.lua).
- Keys of the layout before records were by id (the key's fields under its current secret's
  hash, keys.api_key_id and keys.api_key_previous pointing there) become their record
  (lua/key_put.lua): the roles of a key from before roles (ROLES_BEFORE_ROLES) if the entry has
  none, the run ceiling from 'run' where an entry kept it under that name, the previous secret
  with what is left of its grace. Their secrets do not carry the key id, so the entries under
  their hashes stay, as the entry that names the key ('index_only'), and the pointers go.
- The catalogue: every organisation in it and in the tag map (a reservation is found from its
  id alone by the map), every budget and key in it (budgets and keys made before it existed).
  Reservations under ids minted before ids named their tag are counted, not changed: their
  callers hold those ids.
Then the stamp, last: a migration cut short leaves the ledger refused, and a second run
finishes it. Every step is safe to run twice, and a second run of a whole migration changes
nothing.

What it requires: no instance of this version enforces before the stamp is written (none can:
each refuses the ledger until then); instances of format 1 may keep serving while it runs,
since each step leaves what they read (a plain ledger id, a record by id, an entry that names
it), and refuse the ledger at their next health check after the stamp. It finds what the
catalogue does not list by SCAN, of every master on a Redis Cluster; each write is to one key
or one tag's slot, through the store's own transport, so it runs on one Redis, a Cluster and
Upstash alike.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from core.budgets import BudgetId
from core.errors import InvalidRequest, LedgerUnavailable, ensure
from core.ledger import Role, tag_digest, tag_digest_of
from core.stores import keys, wire
from core.stores.scripted_core import ScriptedCore, Transport
from core.stores.scripts import script

# The formats migrated from: '' for a ledger no version stamped.
FORMATS_MIGRATED = ("", "1")
# What format 1 put after the ledger id of a definition with a week, a rate or per-user limits.
DEFINITION_SUFFIX_V1 = "+2"
# A key entry stored before keys had roles could do both, and keeps both.
ROLES_BEFORE_ROLES = ",".join(sorted((Role.GATEWAY, Role.SIDECAR)))
# The fields of a key's entry under its secret's hash in the layout before records were by id;
# an entry put before fields had Python names kept its run ceiling under 'run'.
ENTRY_FIELDS = ("key_id", "index_only", "budget_id", "run_ceiling_micros", "run", "roles",
                "created_ms", "rotated_at_ms", "last_used_ms")
# Definitions per script call: each call is one tag's slot, and a bounded one.
DEFINITIONS_PER_CALL_MAX = 100
# Keys a SCAN page asks for, and pages a walk takes at most (a SCAN cursor ends long before).
SCAN_PAGE_KEYS = 1_000
SCAN_PAGES_MAX = 1_000_000


@dataclass(frozen=True)
class Migration:
    """What a migration found and did (with `dry_run`, would do)."""

    ledger_id: str | None
    format_found: str | None  # None: not stamped
    format: int
    definitions_rewritten: int = 0
    keys_moved: int = 0
    organisations_catalogued: int = 0
    budgets_catalogued: int = 0
    keys_catalogued: int = 0
    # Reservations under an id minted before ids named their tag: kept as they are (a caller
    # holds the id), found by an operator only with their budget, until they expire (within
    # core/limits.py UNKNOWN_OUTCOME_RETENTION_MS).
    reservations_without_tag: int = 0
    stamped: bool = False
    dry_run: bool = False
    note: str = ""

    def json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


class _Migrator:
    def __init__(self, transport: Transport, ledger_id: str, write: bool) -> None:
        self._t = transport
        self._ledger_id = ledger_id
        self._write = write

    async def _scan(self, pattern: str) -> list[str]:
        """Every key that matches `pattern`, on every master of a Redis Cluster."""
        if self._t.backend == "redis-cluster":
            from core.stores.redis_cluster import RedisClusterTransport

            ensure(isinstance(self._t, RedisClusterTransport), "a cluster's own transport")
            assert isinstance(self._t, RedisClusterTransport)
            return await self._t.scan(pattern, SCAN_PAGE_KEYS)
        found: set[str] = set()
        cursor = "0"
        for _ in range(SCAN_PAGES_MAX):
            cursor, names = await self._t.execute(
                "SCAN", str(cursor), "MATCH", pattern, "COUNT", str(SCAN_PAGE_KEYS))
            found.update(str(n) for n in names)
            if str(cursor) == "0":
                break
        return sorted(found)

    # -- the catalogue -------------------------------------------------------------------------

    async def catalogue(self) -> tuple[int, int, dict[str, set[str]]]:
        """Organisations and budgets into the catalogue: (organisations, budgets) added, and
        every budget id found, by tag."""
        orgs = await self._pairs(keys.ORGS_KEY)
        mapped = await self._pairs(keys.TAG_MAP_KEY)
        budgets: dict[str, set[str]] = {}
        for member in await self._t.execute("ZRANGE", keys.BUDGETS_KEY, "0", "-1"):
            bid = BudgetId(str(member))
            budgets.setdefault(bid.tag, set()).add(bid.path)
        listed = {b for ids in budgets.values() for b in ids}
        budgets_added = 0
        for name in await self._scan("sc:{*}:" + keys.DEFINITION + "*"):
            tag, _, budget_id = name.removeprefix("sc:{").partition("}:" + keys.DEFINITION)
            if not budget_id or budget_id in listed:
                continue
            budgets.setdefault(tag, set()).add(budget_id)
            budgets_added += 1
            if self._write:
                await self._t.execute("ZADD", keys.BUDGETS_KEY, "0", budget_id)
        orgs_added = 0
        for tag in sorted(set(budgets) | set(orgs) | set(mapped.values())):
            if tag not in orgs and await self._t.execute(
                    "HGET", keys.meta(tag), "ledger") == self._ledger_id:
                orgs_added += 1
                if self._write:
                    await self._t.execute("HSET", keys.ORGS_KEY, tag, self._ledger_id)
            if mapped.get(tag_digest(tag)) is None and self._write:
                await self._t.execute("HSETNX", keys.TAG_MAP_KEY, tag_digest(tag), tag)
        return orgs_added, budgets_added, budgets

    async def _pairs(self, key: str) -> dict[str, str]:
        flat = await self._t.execute("HGETALL", key)
        if isinstance(flat, dict):
            return {str(k): str(v) for k, v in flat.items()}
        return {str(flat[i]): str(flat[i + 1]) for i in range(0, len(flat), 2)}

    # -- definitions ---------------------------------------------------------------------------

    async def definitions(self, budgets: dict[str, set[str]]) -> int:
        rewritten = 0
        for tag, ids in sorted(budgets.items()):
            names = [keys.definition(tag, b) for b in sorted(ids)]
            for at in range(0, len(names), DEFINITIONS_PER_CALL_MAX):
                rewritten += int(await self._t.run(
                    script("migrate_definitions"), names[at:at + DEFINITIONS_PER_CALL_MAX],
                    [self._ledger_id, DEFINITION_SUFFIX_V1, "1" if self._write else "0"]))
        return rewritten

    async def untagged_reservations(self) -> int:
        return sum(1 for name in await self._scan("sc:{*}:" + keys.RECORD + "*")
                   if tag_digest_of(name.rpartition(":" + keys.RECORD)[2]) is None)

    # -- keys ----------------------------------------------------------------------------------

    async def keys(self) -> tuple[int, int]:
        """Keys of the layout before records were by id into records: (moved, catalogued)."""
        pointed = {name.removeprefix(keys.api_key_id("")) for name in
                   await self._scan(keys.api_key_id("*"))}
        for member in await self._t.execute("ZRANGE", keys.KEYS_KEY, "0", "-1"):
            pointed.add(str(member).rpartition(" ")[2])
        moved = catalogued = 0
        seen = set()
        for key_id in sorted(pointed):
            current = _text(await self._t.execute("GET", keys.api_key_id(key_id)))
            if current is not None:
                previous = _text(await self._t.execute("GET", keys.api_key_previous(key_id)))
                done = await self._move(key_id, current, previous)
                moved, catalogued = moved + done[0], catalogued + done[1]
                seen.add(key_id)
        # Entries no pointer leads to (a layout before the pointers): each is a key of its own.
        for name in await self._scan(keys.api_key("*")):
            if "{" in name:
                continue  # a record by id
            entry = await self._t.execute("HMGET", name, "key_id", "index_only")
            if entry[0] is not None and entry[1] is None and str(entry[0]) not in seen:
                done = await self._move(str(entry[0]), name.removeprefix(keys.api_key("")), None)
                moved, catalogued = moved + done[0], catalogued + done[1]
        return moved, catalogued

    async def _move(self, key_id: str, current: str, previous: str | None) -> tuple[int, int]:
        """One key into its record, in the order format 1 moved one on its rotation: the record
        first (from then on it decides), then the entries marked to only name it, the pointers
        last. (moved, catalogued) as 0 or 1 each."""
        entry = dict(zip(ENTRY_FIELDS, await self._t.execute(
            "HMGET", keys.api_key(current), *ENTRY_FIELDS), strict=True))
        if entry["key_id"] != key_id or entry["index_only"] is not None:
            # Moved already (a run cut short before the pointers went), or a pointer to no
            # entry of its key: nothing of it is taken but through a record.
            if self._write:
                await self._drop_pointers(key_id)
            return 0, 0
        member = f"{entry['budget_id']} {key_id}"
        if not self._write:
            return 1, int(await self._t.execute("ZSCORE", keys.KEYS_KEY, member) is None)
        # -1 (no expiry) is an entry a rotation of that layout did not finish: no grace left.
        previous_valid_ms = 0 if previous is None else max(0, int(await self._t.execute(
            "PTTL", keys.api_key(previous))))
        run = entry["run_ceiling_micros"] if entry["run_ceiling_micros"] is not None \
            else entry["run"]
        made = (await self._t.run(
            script("key_put"), (keys.api_key_record(key_id),),
            [key_id, current, str(entry["budget_id"]), str(run or ""),
             str(entry["roles"]) if entry["roles"] is not None else ROLES_BEFORE_ROLES,
             previous if previous is not None and previous_valid_ms else "",
             str(previous_valid_ms), str(entry["created_ms"] or ""),
             str(entry["rotated_at_ms"] or ""), str(entry["last_used_ms"] or "")]))[0]
        catalogued = 0
        if made in ("made", "exists"):
            catalogued = int(await self._t.execute("ZADD", keys.KEYS_KEY, "NX", "0", member))
        # A record that holds another secret ('conflict': a format-1 instance moved and rotated
        # the key meanwhile) or a revoked one decides as it stands: the entries only name it.
        await self._t.execute("HSET", keys.api_key(current), "index_only", "1")
        if previous is not None and previous_valid_ms:
            await self._t.execute("HSET", keys.api_key(previous), "index_only", "1")
        await self._drop_pointers(key_id)
        return 1, catalogued

    async def _drop_pointers(self, key_id: str) -> None:
        # One DEL each: on a Redis Cluster the two are in different slots.
        await self._t.execute("DEL", keys.api_key_id(key_id))
        await self._t.execute("DEL", keys.api_key_previous(key_id))


async def migrate(store: object, *, dry_run: bool = False) -> Migration:
    """Migrate the ledger a store keeps to wire.LEDGER_FORMAT_VERSION (see the module); with
    `dry_run`, count what would change and write nothing. InvalidRequest for a ledger this
    version cannot migrate (a later format, or a store that keeps no shared ledger)."""
    if not isinstance(store, ScriptedCore) or not store.shared:
        raise InvalidRequest("there is no shared ledger to migrate (REDIS_URL or Upstash): the "
                             "in-memory ledger is made at the current format by each instance")
    t = store.transport
    ledger_id, found = (_text(v) for v in await t.execute(
        "MGET", keys.LEDGER_ID_KEY, keys.LEDGER_FORMAT_KEY))
    current = wire.LEDGER_FORMAT_VERSION
    if ledger_id is None:
        return Migration(None, found, current, dry_run=dry_run,
                         note="no ledger here yet: the first instance makes it, at the "
                              "current format")
    if found != str(current) and (found or "") not in FORMATS_MIGRATED:
        raise InvalidRequest(f"the ledger is of format {found}, which this version neither "
                             f"reads nor migrates (it reads format {current}): serve it with "
                             "the version that wrote it, or a later one")
    migrator = _Migrator(t, ledger_id, write=not dry_run)
    try:
        orgs, budgets_added, budgets = await migrator.catalogue()
        rewritten = await migrator.definitions(budgets)
        moved, keys_added = await migrator.keys()
        untagged = await migrator.untagged_reservations()
        stamped = found != str(current)
        if stamped and not dry_run:
            await t.execute("SET", keys.LEDGER_FORMAT_KEY, str(current))
    except LedgerUnavailable as exc:
        raise LedgerUnavailable(
            f"the migration was cut short ({exc.message}); nothing it wrote is lost, and the "
            "ledger stays refused until `ceiling ledger migrate` runs again to the end",
            reason=exc.reason) from exc
    return Migration(ledger_id, found, current, rewritten, moved, orgs, budgets_added,
                     keys_added, untagged, stamped, dry_run)
