"""The operators' catalogue on a Redis-speaking ledger: lists, deletion, the audit stream, and
the body of an export and its restore (core/operations.py says what they mean to an operator).
Keys are made, rotated and revoked by the store itself (core/ledger.py KeyStore), each in one
script on the key's record.

The body of an export, read and written only here: for each organisation ('tag') its meta hash
('meta'), each budget's definition ('budgets': budget_id, fields), each counter of each period
window ('counters': budget_id, window_key, fields, ttl_ms), each open reservation
('open_reservations': reservation_id, its record as wire.py packs it, reserved_micros, legs) and
each budget's end users ('users': budget_id, users); and every API key's record ('keys', its
secrets' hashes only). A restore checks all of it before it writes anything, then writes each
organisation in one script (lua/restore_tag.lua) and each key in the key's own.

Nothing here runs on a call's path. The catalogue's keys (core/stores/keys.py CATALOGUE) share
the ledger id's slot, so on Redis Cluster every command below that names one of them goes to one
master; what belongs to an organisation is read and written under its own hash tag.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from core.budgets import RUN_SCOPE_KIND, USER_SCOPE_KIND, BudgetId, check_user
from core.errors import BudgetInUse, CeilingError, InvalidRequest, LedgerNotEmpty, ensure
from core.ledger import (
    ROLES_OF_KEYS_BEFORE_ROLES,
    ExpirePolicy,
    KeyInfo,
    ReservationState,
    Restored,
    invalid_export,
    tag_digest,
)
from core.lifecycle import Event, effects
from core.limits import CEILING_MICROS_MAX, COUNTER_RETENTION_MS, DAY_MS, INT_EXACT_MAX
from core.stores import keys, wire
from core.stores.scripted import ScriptedStore
from core.stores.scripts import script

# Keys one dump_tag page scans: enough that a tag of a few hundred budgets takes a few pages,
# small enough that one page holds the server for well under a millisecond.
DUMP_PAGE_KEYS = 1_000
# The longest period window (a month), a bound on how far from now a window still open ends.
WINDOW_MS_MAX = 31 * DAY_MS
# Pages one tag's dump may take before it is refused as runaway (a scan that never ends).
DUMP_PAGES_MAX = 100_000
# Any id a store was given (keys made before ids were minted, or by a test) survives an export.
_STORED_KEY_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_KEY_HASH = re.compile(r"[0-9A-Za-z]{1,128}")  # a SHA-256 in hex, as core.service makes them
# A window key as core/budgets.py makes them: no separator of the key layout.
_WINDOW = re.compile(r"[A-Za-z0-9_+@:/.-]{1,80}")
_RESERVATION_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")

KEY_FIELDS = ("key_id", "budget_id", "run_ceiling_micros", "run", "roles", "created_ms",
              "last_used_ms", "rotated_at_ms")
# A key's record (lua/key_put.lua): KEY_FIELDS but 'run', and the secrets it takes.
KEY_RECORD_FIELDS = (*(f for f in KEY_FIELDS if f != "run"), "key_hash", "previous_key_hash",
                     "grace_ends_at_ms")


@dataclass(frozen=True)
class TagDump:
    """One tag as kept: its hashes (meta, definitions, counters) by key suffix with their time to
    live (None: kept for ever), its open reservations' records, and the end users of each
    budget that counts them (its users set, core/stores/keys.py USERS), by budget id."""

    hashes: dict[str, tuple[int | None, dict[str, str]]]
    open_records: dict[str, wire.StoredRecord]
    users: dict[str, tuple[str, ...]] = field(default_factory=dict)


def _number(value: Any) -> int | None:
    return int(value) if value not in (None, "") else None


def _pairs(flat: Any) -> dict[str, str]:
    if isinstance(flat, dict):
        return {str(k): str(v) for k, v in flat.items()}
    return {str(k): str(v) for k, v in zip(flat[::2], flat[1::2], strict=True)}


class ScriptedCatalogue:
    """See the module docstring. Every method raises only core errors (the transport's)."""

    def __init__(self, store: ScriptedStore) -> None:
        self.store = store
        self._t = store.transport

    def now_estimate(self) -> int:
        """The ledger's time as this instance last learnt it, advanced by its own clock."""
        return self.store.now_estimate()

    # -- lists ---------------------------------------------------------------------------

    async def budget_ids(self, prefix: str, after: str | None, count: int) -> list[str]:
        """Budget ids from the index, in byte order, beginning with `prefix`, after `after`."""
        low = f"({after}" if after is not None else f"[{prefix}"
        high = f"[{prefix}\xff" if prefix else "+"
        found = await self._t.execute("ZRANGEBYLEX", keys.BUDGETS_KEY, low, high, "LIMIT", "0",
                                      str(count))
        return [str(x) for x in found]

    async def keys_of(self, budget_id: str | None, after: str | None, count: int
                      ) -> list[KeyInfo]:
        prefix = f"{budget_id} " if budget_id is not None else ""
        low = f"({after}" if after is not None else (f"[{prefix}" if prefix else "-")
        high = f"[{prefix}\xff" if prefix else "+"
        members = await self._t.execute("ZRANGEBYLEX", keys.KEYS_KEY, low, high, "LIMIT", "0",
                                        str(count))
        out = []
        for member in members:
            info = await self.key_info(str(member).rpartition(" ")[2])
            if info is not None:
                out.append(info)
        return out

    async def key_info(self, key_id: str) -> KeyInfo | None:
        values = await self._t.execute("HMGET", keys.api_key_record(key_id), *KEY_RECORD_FIELDS)
        f = dict(zip(KEY_RECORD_FIELDS, values, strict=True))
        if f["key_hash"] is not None:
            grace_ends_at_ms = _number(f["grace_ends_at_ms"])
            left_ms = None if grace_ends_at_ms is None or not f["previous_key_hash"] \
                else grace_ends_at_ms - self.store.now_estimate()
            return KeyInfo(key_id, str(f["budget_id"]), tuple(sorted(str(f["roles"]).split(","))),
                           _number(f["run_ceiling_micros"]), _number(f["created_ms"]),
                           _number(f["last_used_ms"]), _number(f["rotated_at_ms"]),
                           left_ms if left_ms is not None and left_ms > 0 else None)
        # A key of the layout before records were by id, which no rotation moved into one yet.
        key_hash = await self._t.execute("GET", keys.api_key_id(key_id))
        if key_hash is None:
            return None
        values = await self._t.execute("HMGET", keys.api_key(str(key_hash)), *KEY_FIELDS)
        f = dict(zip(KEY_FIELDS, values, strict=True))
        if f["key_id"] is None:
            return None
        run = f["run_ceiling_micros"] if f["run_ceiling_micros"] is not None else f["run"]
        previous_ms = None
        previous = await self._t.execute("GET", keys.api_key_previous(key_id))
        if previous is not None:
            ttl = int(await self._t.execute("PTTL", keys.api_key(str(previous))))
            previous_ms = ttl if ttl > 0 else None
        roles = tuple(sorted(str(f["roles"]).split(","))) if f["roles"] is not None \
            else ("gateway", "sidecar")  # core.ledger.ROLES_OF_KEYS_BEFORE_ROLES
        return KeyInfo(key_id, str(f["budget_id"]), roles, _number(run),
                       _number(f["created_ms"]), _number(f["last_used_ms"]),
                       _number(f["rotated_at_ms"]), previous_ms)

    # -- lifecycle -----------------------------------------------------------------------

    async def delete_budget(self, tag: str, budget_id: str, force: bool
                            ) -> tuple[int, int, int] | None:
        """(reservations charged, micros they held, end users uncounted), or None if there is
        no such budget; BudgetInUse while open reservations hold money in it or its users and
        `force` is not given. Its counters and its users' stay (lua/delete_budget.lua)."""
        reply = await self._t.run(
            script("delete_budget"),
            (keys.meta(tag), keys.definition(tag, budget_id), keys.open_leases(tag),
             keys.prefix(tag) + keys.USERS + budget_id),
            [budget_id, "1" if force else "0", *filter(None, [self.store.now_arg()])],
        )
        if reply[0] == "not_found":
            return None
        if reply[0] == "in_use":
            raise BudgetInUse(
                f"{reply[1]} open reservations hold {reply[2]} micro-dollars in {budget_id}; "
                "delete it once they settle, or with force=1, which charges them as unknown",
                budget_id=budget_id, open_reservations=int(reply[1]),
                held_micros=int(reply[2]),
            )
        await self._t.execute("ZREM", keys.BUDGETS_KEY, budget_id)
        return int(reply[1]), int(reply[2]), int(reply[3])

    # -- the audit stream ------------------------------------------------------------------

    async def audit_append(self, fields: dict[str, str], retention_ms: int) -> str:
        """Append one entry (its id is the ledger's time in ms, then a sequence number) and drop
        entries older than `retention_ms`."""
        oldest_ms = max(0, self.store.now_estimate() - retention_ms)
        flat = [x for kv in fields.items() for x in kv]
        return str(await self._t.execute("XADD", keys.AUDIT_KEY, "MINID", "~", str(oldest_ms),
                                         "*", *flat))

    async def audit_read(self, before: str | None, count: int
                         ) -> list[tuple[str, dict[str, str]]]:
        """Newest first, before the entry id `before`."""
        high = f"({before}" if before is not None else "+"
        found = await self._t.execute("XREVRANGE", keys.AUDIT_KEY, high, "-", "COUNT",
                                      str(count))
        return [(str(entry_id), _pairs(fields)) for entry_id, fields in found]

    # -- export ------------------------------------------------------------------------------

    async def export_body(self) -> dict[str, Any]:
        """The body of an export (the module docstring says what it holds)."""
        await self._index_unlisted_keys()
        organisations = []
        for tag in await self._tags():
            dump = await self._dump_tag(tag)
            org: dict[str, Any] = {"tag": tag, "meta": {}, "budgets": [], "counters": [],
                                   "open_reservations": [], "users": []}
            for suffix, (ttl_ms, stored) in sorted(dump.hashes.items()):
                # Not the ledger id a tag or definition is stamped with: the document's own is
                # the export's, and a restore stamps its new one (lua/restore_tag.lua).
                fields = {k: v for k, v in stored.items() if k != "ledger"}
                if suffix == keys.META:
                    org["meta"] = fields
                elif suffix.startswith(keys.DEFINITION):
                    org["budgets"].append({"budget_id": suffix[len(keys.DEFINITION):],
                                           "fields": fields})
                else:
                    budget_id, _, window_key = suffix[len(keys.COUNTER):].rpartition("|")
                    org["counters"].append({"budget_id": budget_id, "window_key": window_key,
                                            "fields": fields, "ttl_ms": ttl_ms})
            for rid, record in sorted(dump.open_records.items()):
                org["open_reservations"].append({
                    "reservation_id": rid, "record": wire.SEPARATOR.join(record),
                    "reserved_micros": int(record.reserved_micros),
                    "legs": [f"{b}|{w}" for b, w, _ in legs_of(record)]})
            # Each budget's end users (their counters are among the counters): who counts
            # against users_max, which a restore keeps.
            org["users"] = [{"budget_id": budget_id, "users": list(members)}
                            for budget_id, members in sorted(dump.users.items())]
            if org["budgets"] or org["counters"] or org["open_reservations"] or org["users"]:
                organisations.append(org)
        return {"organisations": organisations, "keys": await self._key_records()}

    async def _tags(self) -> list[str]:
        """Every organisation the ledger knows: the catalogue's, and the tag map's (budgets
        put before the catalogue existed)."""
        orgs = _pairs(await self._t.execute("HGETALL", keys.ORGS_KEY))
        mapped = _pairs(await self._t.execute("HGETALL", keys.TAG_MAP_KEY))
        return sorted(set(orgs) | set(mapped.values()))

    async def _dump_tag(self, tag: str) -> TagDump:
        """Not one snapshot (a tag's keys are read a page at a time, under load): the open
        reservations are read first, then the counters. A call that settles in between is then
        in the committed it settled to and still in the open holds, which a restore charges: an
        over-count, the safe way to be wrong; a hold taken in between is in no record, and a
        restore drops it (its call is on the provider's bill, which --book-from-bill books)."""
        records = {}
        open_ids = await self._t.execute("ZRANGE", keys.open_leases(tag), "0", "-1")
        for rid in sorted({str(x) for x in open_ids}):
            found = await self.store.read_record(tag, rid)
            if found is not None and found.state == ReservationState.OPEN.value:
                records[rid] = found
        hashes: dict[str, tuple[int | None, dict[str, str]]] = {}
        users: dict[str, tuple[str, ...]] = {}
        cursor = "0"
        for _ in range(DUMP_PAGES_MAX):
            page = await self._t.run(script("dump_tag"), (keys.meta(tag),),
                                     [cursor, str(DUMP_PAGE_KEYS)])
            cursor = str(page[0])
            for entry in page[1:]:
                kind, suffix, pttl, values = str(entry[0]), str(entry[1]), int(entry[2]), entry[3:]
                if kind in ("users", "pending_users"):
                    # A pending user's open call is charged as unknown by a restore, which
                    # gives it its place among the budget's users (core/stores/keys.py).
                    budget_id = suffix.removeprefix(
                        keys.USERS if kind == "users" else keys.PENDING_USERS)
                    members = await self._members(keys.prefix(tag) + suffix)
                    users[budget_id] = tuple(sorted({*users.get(budget_id, ()), *members}))
                else:
                    hashes[suffix] = (pttl if pttl > 0 else None, _pairs(list(values)))
            if cursor == "0":
                break
        else:
            ensure(False, f"the dump of {tag} did not end")
        return TagDump(hashes, records, users)

    async def _members(self, key: str) -> tuple[str, ...]:
        """A users set's members in byte order, DUMP_PAGE_KEYS at a time (ZRANGEBYLEX after the
        last one read): a read of the whole set at once would hold the server for as many
        members as the budget's users_max (more, after a forced restore added a ledger's users
        to the ones it had)."""
        members: list[str] = []
        for _ in range(DUMP_PAGES_MAX):
            low = f"({members[-1]}" if members else "-"
            found = [str(m) for m in await self._t.execute(
                "ZRANGEBYLEX", key, low, "+", "LIMIT", "0", str(DUMP_PAGE_KEYS))]
            members += found
            if len(found) < DUMP_PAGE_KEYS:
                break
        else:
            ensure(False, f"the dump of the users set {key} did not end")
        return tuple(members)

    async def _index_unlisted_keys(self) -> int:
        """Put keys made before the catalogue existed into it; how many. On one Redis (and
        Upstash) a SCAN finds them; on a Cluster a SCAN sees one node, so there a key made
        before the catalogue is listed once it is rotated or made again."""
        if self._t.backend == "redis-cluster":
            return 0
        added, cursor = 0, "0"
        for _ in range(DUMP_PAGES_MAX):
            cursor, found = await self._t.execute(
                "SCAN", cursor, "MATCH", keys.api_key_id("*"), "COUNT", str(DUMP_PAGE_KEYS))
            for name in found:
                key_id = str(name).removeprefix(keys.api_key_id(""))
                key_hash = await self._t.execute("GET", str(name))
                budget_id = None if key_hash is None else await self._t.execute(
                    "HGET", keys.api_key(str(key_hash)), "budget_id")
                if budget_id is not None:
                    added += int(await self._t.execute(
                        "ZADD", keys.KEYS_KEY, "NX", "0", f"{budget_id} {key_id}"))
            if str(cursor) == "0":
                break
        return added

    async def _key_records(self) -> list[dict[str, str]]:
        """Every indexed key's record: its secrets' hashes, never a secret."""
        members = await self._t.execute("ZRANGE", keys.KEYS_KEY, "0", "-1")
        out = []
        for member in members:
            key_id = str(member).rpartition(" ")[2]
            found = _pairs(await self._t.execute("HGETALL", keys.api_key_record(key_id)))
            if "key_hash" in found:
                out.append(found)
                continue
            key_hash = await self._t.execute("GET", keys.api_key_id(key_id))
            if key_hash is None:
                continue
            record = _pairs(await self._t.execute("HGETALL", keys.api_key(str(key_hash))))
            if record:
                out.append({**record, "key_hash": str(key_hash)})
        return out

    # -- restore -----------------------------------------------------------------------------

    async def restore_body(self, body: object, force: bool) -> Restored:
        """core/operations.py Catalogue.restore_body: checked whole first, then each
        organisation in one script, then the keys."""
        orgs, key_records = _checked(body)
        tags = [o["tag"] for o in orgs]
        live_tags = await self._tags()
        found = await self._has_data(tags)
        if found and not force:
            raise LedgerNotEmpty(
                "the ledger is not empty (" + ", ".join(found[:10]) + "); restore into an "
                "empty or wiped ledger, or give --force, which keeps the larger committed spend "
                "of every counter (never refills)", found=found[:10])
        try:
            previous: str | None = await self.store.open()
        except CeilingError:  # a reset ledger: its id is what is being replaced
            previous = None
        ledger_id = uuid.uuid4().hex
        # No confirmation given for an earlier restore applies to this one.
        await self._t.execute("DEL", keys.ADOPTED_KEY)
        self.store.use_ledger(ledger_id)
        now_ms = self.store.now_estimate()
        counters = charged_count = charged_micros = 0
        for org in orgs:
            written, charged, micros = await self._restore_tag(
                org["tag"], [b["budget_id"] for b in org.get("budgets", [])],
                _sections(org, now_ms), ledger_id, now_ms, force, "restore")
            counters, charged_count = counters + written, charged_count + charged
            charged_micros += micros
        if force:
            # Organisations the ledger has and the export does not: under the new id too.
            for tag in sorted(set(live_tags) - set(tags)):
                dump = await self._dump_tag(tag)
                ids = [s.removeprefix(keys.DEFINITION) for s in sorted(dump.hashes)
                       if s.startswith(keys.DEFINITION)]
                sections = [str(len(ids)), *(x for i in ids for x in (i, "0")), "0", "0", "0"]
                await self._restore_tag(tag, ids, sections, ledger_id, now_ms, force, "restamp")
        for k in key_records:
            await self._write_key(k)
        return Restored(
            ledger_id, previous, sum(len(o.get("budgets", [])) for o in orgs), counters,
            sum(len(u["users"]) for o in orgs for u in o.get("users", [])), len(key_records),
            charged_count, charged_micros)

    async def _restore_tag(self, tag: str, budget_ids: Sequence[str], sections: Sequence[str],
                           ledger_id: str, now_ms: int, force: bool, mode: str
                           ) -> tuple[int, int, int]:
        """One organisation in one script (lua/restore_tag.lua: `sections` and `mode` are its),
        then its entries in the catalogue, in the ledger id's slot: each writes a value that is
        the same every time, and nothing serves the restored ledger before its stamp, which
        comes after them all."""
        reply = await self._t.run(
            script("restore_tag"), (keys.meta(tag),),
            [ledger_id, str(now_ms), "1" if force else "0",
             str(COUNTER_RETENTION_MS + WINDOW_MS_MAX), mode, *sections])
        await self._t.execute("HSET", keys.TAG_MAP_KEY, tag_digest(tag), tag)
        await self._t.execute("HSET", keys.ORGS_KEY, tag, ledger_id)
        for at in range(0, len(budget_ids), DUMP_PAGE_KEYS):
            pairs = [x for b in budget_ids[at:at + DUMP_PAGE_KEYS] for x in ("0", b)]
            await self._t.execute("ZADD", keys.BUDGETS_KEY, *pairs)
        return int(reply[0]), int(reply[1]), int(reply[2])

    async def _has_data(self, tags: Iterable[str]) -> list[str]:
        """What makes the ledger not empty: catalogue entries and organisations with data."""
        found = []
        if int(await self._t.execute("HLEN", keys.ORGS_KEY)):
            found.append("organisations")
        if int(await self._t.execute("ZCARD", keys.BUDGETS_KEY)):
            found.append("budgets")
        if int(await self._t.execute("ZCARD", keys.KEYS_KEY)):
            found.append("keys")
        for tag in tags:
            if int(await self._t.execute("EXISTS", keys.meta(tag))):
                found.append(tag)
        return found

    async def stamp_restored(self, ledger_id: str) -> None:
        """The restored ledger's id, written last: instances that find theirs gone wait for the
        operator's adoption (`ceiling ledger adopt`) before they enforce against it. With it, the
        format version its records were written in: this version's."""
        await self._t.execute("SET", keys.RESTORED_KEY, ledger_id)
        await self._t.execute("SET", keys.LEDGER_FORMAT_KEY, str(wire.LEDGER_FORMAT_VERSION))
        await self._t.execute("SET", keys.LEDGER_ID_KEY, ledger_id)

    async def _write_key(self, record: dict[str, str]) -> None:
        """An exported key (a record, or an entry of the layout before records were by id) as a
        record (lua/key_put.lua), its previous secret with what is left of its grace. A key the
        ledger holds already, or revoked, stays as it is: the ledger's is the later word. Each
        secret's hash gets an entry that leads to the record, for a secret made before secrets
        carried their key id (one made since has no use for it)."""
        key_id, key_hash, budget_id = record["key_id"], record["key_hash"], record["budget_id"]
        grace_ends_at_ms = _number(record.get("grace_ends_at_ms"))
        previous = record.get("previous_key_hash", "")
        previous_valid_ms = 0 if not previous or grace_ends_at_ms is None \
            else max(0, grace_ends_at_ms - self.store.now_estimate())
        roles = record.get("roles", ",".join(sorted(ROLES_OF_KEYS_BEFORE_ROLES)))
        await self._t.execute("ZADD", keys.KEYS_KEY, "0", f"{budget_id} {key_id}")
        await self.store.put_key_record(
            key_id, key_hash, budget_id, record.get("run_ceiling_micros", record.get("run", "")),
            roles, previous_key_hash=previous if previous_valid_ms else "",
            previous_valid_ms=previous_valid_ms, created_ms=record.get("created_ms", ""),
            rotated_at_ms=record.get("rotated_at_ms", ""),
            last_used_ms=record.get("last_used_ms", ""))
        for secret_hash in filter(None, [key_hash, previous if previous_valid_ms else ""]):
            await self._t.execute("HSET", keys.api_key(secret_hash), "key_id", key_id,
                                  "index_only", "1")

    async def adopt(self) -> tuple[str | None, str | None]:
        """Confirm the restored ledger for adoption: (the ledger id now, the restored one). A
        rollback instances found (core/stores/scripted_core.py) is adopted as the ledger is: the
        ledger id stays, and both are answered as it."""
        rolled_back = await self._t.execute("GET", keys.ROLLED_BACK_KEY)
        if rolled_back is not None:
            await self._t.execute("SET", keys.ROLLBACK_ADOPTED_KEY, str(rolled_back))
            await self._t.execute("DEL", keys.ROLLED_BACK_KEY)
            current = await self._t.execute("GET", keys.LEDGER_ID_KEY)
            return (None, None) if current is None else (str(current), str(current))
        current = await self._t.execute("GET", keys.LEDGER_ID_KEY)
        restored = await self._t.execute("GET", keys.RESTORED_KEY)
        if current is not None and current == restored:
            await self._t.execute("SET", keys.ADOPTED_KEY, str(current))
        return (None if current is None else str(current),
                None if restored is None else str(restored))


def unknown_effects(held_micros: int) -> tuple[int, int]:
    """(reserved delta, committed delta) of charging an open hold as unknown (core/lifecycle.py's
    expiry under 'charge')."""
    fx = effects(Event.EXPIRE, ReservationState.OPEN, ExpirePolicy.CHARGE, held_micros)
    return fx.reserved_delta, fx.committed_delta


def legs_of(record: wire.StoredRecord) -> Sequence[tuple[str, str, bool]]:
    """(budget id, window key, is a run's) of each leg a record holds money in."""
    out = []
    for item in record.legs.split(wire.ITEM_SEPARATOR):
        if item:
            parts = item.split(wire.PART_SEPARATOR)
            out.append((parts[0], parts[1], parts[-1] == "run"))
    return out




def _counter_kind(budget_id: str, window_key: str, run: bool) -> str:
    """Which sweep index lists a counter (lua/restore_tag.lua): a period window's, a run's, or
    none (a budget's total, kept as long as the budget)."""
    if window_key != "total":
        return "window"
    return "run" if run or f"/{RUN_SCOPE_KIND}:" in budget_id else "total"


def _charged(record: wire.StoredRecord, now_ms: int) -> str:
    """An open reservation of an export as expiry under 'charge' leaves it, packed: committed in
    its legs (lua/restore_tag.lua books that), outcome 'unknown', so a late settle or an
    operator's correction still corrects it."""
    fx = effects(Event.EXPIRE, ReservationState.OPEN, ExpirePolicy.CHARGE,
                 int(record.reserved_micros))
    return wire.SEPARATOR.join(record._replace(
        state=fx.to.value, expire_policy=ExpirePolicy.CHARGE.value, outcome=fx.outcome,
        resolved_ms=str(now_ms), released_micros=str(fx.released_micros),
        overshoot_micros=str(fx.overshoot_micros), late="1" if fx.late else "0",
        actual_micros=""))


def _flat(fields: dict[str, str]) -> list[str]:
    return [str(len(fields)), *(x for kv in fields.items() for x in kv)]


def _sections(org: dict[str, Any], now_ms: int) -> list[str]:
    """An organisation of a checked body as lua/restore_tag.lua's sections, in its 'restore'
    mode: definitions, users, open reservations, counters, then the meta hash."""
    out = [str(len(org.get("budgets", [])))]
    for b in org.get("budgets", []):
        out += [b["budget_id"], *_flat(b["fields"])]
    out.append(str(len(org.get("users", []))))
    for u in org.get("users", []):
        out += [u["budget_id"], str(len(u["users"])), *u["users"]]
    out.append(str(len(org.get("open_reservations", []))))
    for r in org.get("open_reservations", []):
        record = wire.StoredRecord.unpacked(r["record"])
        legs = legs_of(record)
        out += [r["reservation_id"], _charged(record, now_ms), record.reserved_micros,
                str(unknown_effects(int(record.reserved_micros))[1]), str(len(legs))]
        for budget_id, window_key, run in legs:
            out += [f"{budget_id}|{window_key}", _counter_kind(budget_id, window_key, run)]
    out.append(str(len(org.get("counters", []))))
    for c in org.get("counters", []):
        ttl_ms = c.get("ttl_ms")
        out += [f"{c['budget_id']}|{c['window_key']}",
                _counter_kind(c["budget_id"], c["window_key"], False),
                "" if ttl_ms is None else str(ttl_ms), *_flat(c["fields"])]
    meta = {k: v for k, v in org.get("meta", {}).items() if k != "ledger"}
    return out + [x for kv in meta.items() for x in kv]


def _strings(value: object, why: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise invalid_export(why)
    return value


def _amount(fields: dict[str, str], name: str) -> int:
    text = fields.get(name, "0")
    if not re.fullmatch(r"-?\d{1,16}", text) or abs(int(text)) > INT_EXACT_MAX:
        raise invalid_export(f"{name} is not an integer below 2**53")
    return int(text)


def _budget(raw: object, why: str) -> BudgetId:
    try:
        return BudgetId.parse(raw)
    except InvalidRequest as exc:
        raise invalid_export(why) from exc


def _counter_owner(raw: object) -> BudgetId:
    """The budget a counter of an export is kept for: a budget's id (a run's too), or an end
    user's '<budget>/user:<id>', which BudgetId.parse refuses (a user id may hold ':' and '@',
    be longer than a scope's name, and make a path one scope longer than an operator's)."""
    if isinstance(raw, str):
        budget, marker, user = raw.rpartition(f"/{USER_SCOPE_KIND}:")
        if marker and "/" not in user:
            try:
                check_user(user)
            except InvalidRequest as exc:
                raise invalid_export("an end user's counter") from exc
            return _budget(budget, "a counter's budget id")
    return _budget(raw, "a counter's budget id")


def _list(value: object, why: str) -> list[Any]:
    if not isinstance(value, list) or not all(isinstance(x, dict) for x in value):
        raise invalid_export(why)
    return value


def _checked(body: object) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """The organisations and keys of an export's body, once every field is what an export
    writes (invalid_export otherwise): nothing malformed reaches a script."""
    if not isinstance(body, dict):
        raise invalid_export("no body")
    orgs = _list(body.get("organisations"), "no organisations")
    for org in orgs:
        if not isinstance(org.get("tag"), str):
            raise invalid_export("an organisation without a tag")
        tag = _budget(org["tag"], "an organisation's tag").path
        if "/" in tag:
            raise invalid_export(f"{tag} is not a top scope")
        _strings(org.get("meta", {}), "meta")
        for b in _list(org.get("budgets", []), "budgets"):
            if _budget(b.get("budget_id"), "a budget id").tag != tag:
                raise invalid_export(f"{b.get('budget_id')} is not under {tag}")
            _strings(b.get("fields"), "a definition")
        for c in _list(org.get("counters", []), "counters"):
            if _counter_owner(c.get("budget_id")).tag != tag or not isinstance(
                    c.get("window_key"), str) or not _WINDOW.fullmatch(c["window_key"]):
                raise invalid_export("a counter of another organisation or window")
            fields = _strings(c.get("fields"), "a counter")
            for name in ("committed", "reserved", "overshoot"):
                _amount(fields, name)
            ttl = c.get("ttl_ms")
            if ttl is not None and (type(ttl) is not int or not 0 < ttl <= INT_EXACT_MAX):
                raise invalid_export("a counter's ttl_ms")
        for r in _list(org.get("open_reservations", []), "open reservations"):
            if not isinstance(r.get("reservation_id"), str) or not _RESERVATION_ID.fullmatch(
                    r["reservation_id"]) or not isinstance(r.get("record"), str):
                raise invalid_export("an open reservation")
            try:
                record = wire.StoredRecord.unpacked(r["record"])
            except (CeilingError, ValueError, TypeError) as exc:
                raise invalid_export("an open reservation's record") from exc
            if record.state != "open" or not 0 < _amount(
                    {"r": record.reserved_micros}, "r") <= CEILING_MICROS_MAX:
                raise invalid_export("an open reservation's record")
            for budget_id, window_key, _ in legs_of(record):
                if _counter_owner(budget_id).tag != tag or not _WINDOW.fullmatch(window_key):
                    raise invalid_export("an open reservation's legs")
        for u in _list(org.get("users", []), "end users"):
            if _budget(u.get("budget_id"), "a budget id").tag != tag:
                raise invalid_export("end users of another organisation")
            members = u.get("users")
            if not isinstance(members, list):
                raise invalid_export("a budget's end users are not a list")
            for member in members:
                try:
                    check_user(member)
                except InvalidRequest as exc:
                    raise invalid_export("an end user's id") from exc
    key_records = _list(body.get("keys"), "no keys")
    for k in key_records:
        fields = _strings(k, "a key")
        if not _KEY_HASH.fullmatch(fields.get("key_hash", "")) or not _STORED_KEY_ID.fullmatch(
                fields.get("key_id", "")):
            raise invalid_export("a key's id or hash")
        _budget(fields.get("budget_id"), "a key's budget id")
    return orgs, key_records
