"""The operators' catalogue on a Redis-speaking ledger: lists, deletion, the audit stream, and
the body of an export and its restore (core/operations.py says what they mean to an operator).
Keys are made, rotated and revoked by the store itself (core/ledger.py KeyStore), each in one
script on the key's record.

The body of an export (core/stores/export_body.py: a document by the domain's names, format
/2) is read here from the ledger's layout and written back into it: a restore checks all of it
before it writes anything, then writes each organisation in one script (lua/restore_tag.lua)
and each key in the key's own. A body of format /1 is read as the /2 body it means
(core/stores/export_v1.py).

Nothing here runs on a call's path. The catalogue's keys (core/stores/keys.py CATALOGUE) share
the ledger id's slot, so on Redis Cluster every command below that names one of them goes to one
master; what belongs to an organisation is read and written under its own hash tag.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from core.audit import audit_json, stream_position
from core.errors import BudgetInUse, CeilingError, LedgerNotEmpty, ensure
from core.ledger import (
    KeyInfo,
    ReservationState,
    Restored,
    tag_digest,
)
from core.limits import COUNTER_RETENTION_MS, DAY_MS
from core.stores import export_body as document
from core.stores import keys, wire
from core.stores.export_v1 import EXPORT_FORMAT_1, body_of_format_1
from core.stores.scripted import ScriptedStore
from core.stores.scripted_catalogue import definition_of
from core.stores.scripts import script

# Keys one dump_tag page scans: enough that a tag of a few hundred budgets takes a few pages,
# small enough that one page holds the server for well under a millisecond.
DUMP_PAGE_KEYS = 1_000
# The longest period window (a month), a bound on how far from now a window still open ends.
WINDOW_MS_MAX = 31 * DAY_MS
# Pages one tag's dump may take before it is refused as runaway (a scan that never ends).
DUMP_PAGES_MAX = 100_000

# A key's record (lua/key_put.lua): who it is, what it may do, and the secrets it takes.
KEY_RECORD_FIELDS = ("key_id", "budget_id", "run_ceiling_micros", "roles", "created_ms",
                     "last_used_ms", "rotated_at_ms", "key_hash", "previous_key_hash",
                     "grace_ends_at_ms")


@dataclass(frozen=True)
class TagDump:
    """One tag as kept: its hashes (meta, definitions, counters) by key suffix with their time to
    live (None: kept for ever), its open reservations' records and those an expiry charged as
    unknown, and the end users of each budget that counts them (its users set,
    core/stores/keys.py USERS), by budget id."""

    hashes: dict[str, tuple[int | None, dict[str, str]]]
    open_records: dict[str, wire.StoredRecord]
    unknown_records: dict[str, wire.StoredRecord] = field(default_factory=dict)
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
        if f["key_hash"] is None:
            return None
        grace_ends_at_ms = _number(f["grace_ends_at_ms"])
        left_ms = None if grace_ends_at_ms is None or not f["previous_key_hash"] \
            else grace_ends_at_ms - self.store.now_estimate()
        return KeyInfo(key_id, str(f["budget_id"]), tuple(sorted(str(f["roles"]).split(","))),
                       _number(f["run_ceiling_micros"]), _number(f["created_ms"]),
                       _number(f["last_used_ms"]), _number(f["rotated_at_ms"]),
                       left_ms if left_ms is not None and left_ms > 0 else None)

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
        """The body of an export (core/stores/export_body.py says what it holds)."""
        organisations = []
        for tag in await self._tags():
            dump = await self._dump_tag(tag)
            meta: dict[str, str] = {}
            definitions, counters = {}, []
            for suffix, (_, stored) in dump.hashes.items():
                if suffix == keys.META:
                    meta = stored
                elif suffix.startswith(keys.DEFINITION):
                    budget_id = suffix[len(keys.DEFINITION):]
                    definitions[budget_id] = definition_of(budget_id, stored)
                else:
                    budget_id, _, window = suffix[len(keys.COUNTER):].rpartition("|")
                    counters.append(document.counter_entry(budget_id, window, stored))
            reservations = [document.reservation_entry(rid, record) for rid, record in
                            (*dump.open_records.items(), *dump.unknown_records.items())]
            # Each budget's end users (their counters are among the counters): who counts
            # against users_max, which a restore keeps.
            if definitions or counters or reservations or dump.users:
                organisations.append(document.organisation(
                    tag, meta, definitions, counters, reservations, dump.users))
        return {"organisations": organisations,
                "keys": [document.key_entry(k) for k in await self._key_records()],
                "audit": [audit_json(entry_id, f) for entry_id, f in await self._audit_all()]}

    async def _audit_all(self) -> list[tuple[str, dict[str, str]]]:
        """The whole audit stream, oldest first, DUMP_PAGE_KEYS entries a read."""
        entries: list[tuple[str, dict[str, str]]] = []
        for _ in range(DUMP_PAGES_MAX):
            low = f"({entries[-1][0]}" if entries else "-"
            found = await self._t.execute("XRANGE", keys.AUDIT_KEY, low, "+", "COUNT",
                                          str(DUMP_PAGE_KEYS))
            entries += [(str(entry_id), _pairs(fields)) for entry_id, fields in found]
            if len(found) < DUMP_PAGE_KEYS:
                return entries
        ensure(False, "the read of the audit stream did not end")
        return entries

    async def _tags(self) -> list[str]:
        """Every organisation the ledger knows: the catalogue's."""
        return sorted(_pairs(await self._t.execute("HGETALL", keys.ORGS_KEY)))

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
        unknown: dict[str, wire.StoredRecord] = {}
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
                elif kind == "unknown":
                    # One that expired since it was read open is exported open: a restore
                    # charges it as its expiry did.
                    rid = suffix.removeprefix(keys.RECORD)
                    if rid not in records:
                        unknown[rid] = wire.StoredRecord.unpacked(str(values[0]))
                else:
                    hashes[suffix] = (pttl if pttl > 0 else None, _pairs(list(values)))
            if cursor == "0":
                break
        else:
            ensure(False, f"the dump of {tag} did not end")
        return TagDump(hashes, records, unknown, users)

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

    async def _key_records(self) -> list[dict[str, str]]:
        """Every indexed key's record: its secrets' hashes, never a secret."""
        members = await self._t.execute("ZRANGE", keys.KEYS_KEY, "0", "-1")
        out = []
        for member in members:
            key_id = str(member).rpartition(" ")[2]
            found = _pairs(await self._t.execute("HGETALL", keys.api_key_record(key_id)))
            if "key_hash" in found:  # one revoked since the index was read holds no secret
                out.append(found)
        return out

    # -- restore -----------------------------------------------------------------------------

    async def restore_body(self, body: object, force: bool, document_format: str,
                           name_of: Callable[[str], str | None]) -> Restored:
        """core/operations.py Catalogue.restore_body: checked whole first (a /1 body read as
        the /2 body it means: core/stores/export_v1.py), then each organisation in one script,
        then the keys."""
        if document_format == EXPORT_FORMAT_1:
            body = body_of_format_1(body)
        orgs, key_records, audit = document.checked(body, name_of)
        tags = [o.tag for o in orgs]
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
        # The ledger's clock (Redis TIME), not this process's: a restore is often the first
        # thing a fresh CLI does, before it has learned how far its clock is off.
        now_ms = await self.store.ledger_time_ms()
        counters = charged_count = charged_micros = 0
        for org in orgs:
            written, charged, micros = await self._restore_tag(
                org.tag, [b.budget_id.path for b in org.budgets],
                document.sections(org, now_ms), ledger_id, now_ms, force, "restore")
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
        await self._restore_audit(audit)
        return Restored(
            ledger_id, previous, sum(len(o.budgets) for o in orgs), counters,
            sum(len(members) for o in orgs for _, members in o.users), len(key_records),
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

    async def _restore_audit(self, entries: Sequence[tuple[str, dict[str, str]]]) -> None:
        """The exported audit entries after the last one the stream holds, under their own ids:
        a restore run again adds none twice, and a ledger's own later entries stay its word."""
        last = await self._t.execute("XREVRANGE", keys.AUDIT_KEY, "+", "-", "COUNT", "1")
        after = stream_position(str(last[0][0])) if last else (0, 0)
        for entry_id, fields in entries:
            if stream_position(entry_id) > after:
                await self._t.execute("XADD", keys.AUDIT_KEY, entry_id,
                                      *(x for kv in fields.items() for x in kv))

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

    async def _write_key(self, key: document.Key) -> None:
        """An exported key as a record (lua/key_put.lua), its previous secret with what is left
        of its grace. A key the ledger holds already, or revoked, stays as it is: the ledger's is
        the later word. Each secret's hash gets an entry that leads to the record, for a secret
        made before secrets carried their key id (one made since has no use for it)."""
        record = document.key_record(key)
        grace_ends_at_ms = key.previous_secret_valid_until_ms
        previous = key.previous_key_hash or ""
        previous_valid_ms = 0 if not previous or grace_ends_at_ms is None \
            else max(0, grace_ends_at_ms - self.store.now_estimate())
        await self._t.execute("ZADD", keys.KEYS_KEY, "0", f"{key.budget_id} {key.key_id}")
        await self.store.put_key_record(
            key.key_id, key.key_hash, key.budget_id, record["run_ceiling_micros"],
            record["roles"], previous_key_hash=previous if previous_valid_ms else "",
            previous_valid_ms=previous_valid_ms, created_ms=record["created_ms"],
            rotated_at_ms=record["rotated_at_ms"], last_used_ms=record["last_used_ms"])
        for secret_hash in filter(None, [key.key_hash, previous if previous_valid_ms else ""]):
            await self._t.execute("HSET", keys.api_key(secret_hash), "key_id", key.key_id,
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
