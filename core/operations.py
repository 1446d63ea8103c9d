"""Operating the ledger: lists, deletion and key rotation, the audit stream of every admin change,
and recovery from a wiped ledger with one export, one restore and one confirmation.

Every change an operator makes here is appended to the audit stream: who (a fingerprint of the
admin credential, core.service.operator_fingerprint), what, which target, and when (the entry's
id is the ledger's time). Lists page with an opaque cursor and a bounded page size and never
show a secret or a key's hash.

Export and restore. An export is one JSON document: the ledger id, every
organisation's budgets, every period window's counters (committed, reserved, overshoot), its open
reservations, and the API keys' records (hashes only; the secrets were never stored), with a
checksum over all of it. A restore writes it into an empty (or wiped) ledger under a new ledger
id: committed spend comes back as it was, never refilled; an open reservation comes back charged
as unknown (its hold committed, as expiry under 'charge' books it, so a late settle or an
operator's correction still lowers it); keys keep working. With a provider's bill
(BILL_FORMAT) it also books what the bill shows beyond what the export had: the spend between the
export and the wipe. Running instances that found their ledger reset take the new ledger only
once an operator confirms it (`adopt`): an empty Redis gets a fresh ledger id from the first
instance that opens it, and nothing must mistake that for a restored one.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from core.budgets import USER_SCOPE_KIND, BudgetDef, BudgetId, Period, check_user
from core.errors import BudgetNotFound, CeilingError, InvalidRequest, LedgerNotEmpty
from core.ledger import (
    KeyInfo,
    KeyListing,
    LegStatus,
    ReservationRef,
    ReserveRequest,
    Role,
    UsersPage,
    mint_reservation_id,
    tag_digest,
)
from core.limits import BUDGET_ID_LEN_MAX, CEILING_MICROS_MAX, INT_EXACT_MAX, RESERVATION_TTL_MS_MIN
from core.service import CeilingService, NewKey
from core.stores import keys, wire
from core.stores.operations import TagDump, legs_of, unknown_effects

EXPORT_FORMAT = "spend-ceiling/ledger-export/1"
BILL_FORMAT = "spend-ceiling/bill/1"
# Admin changes are kept as long as day and month counters (core/limits.py COUNTER_RETENTION_MS):
# a change can be looked up for as long as the spend it affected can.
AUDIT_RETENTION_MS = 400 * 24 * 3_600_000
# A list answers this many items unless asked for fewer, and never more than the maximum: one
# page is one bounded read of the ledger (a key's row takes three commands).
PAGE_SIZE_DEFAULT = 100
PAGE_SIZE_MAX = 1_000
# A rotated key's previous secret keeps working this long by default, and at most the maximum:
# long enough to redeploy the clients that hold it, short enough that a leaked secret that
# prompted the rotation does not live on (revoke the key to end both at once).
KEY_ROTATION_GRACE_MS_DEFAULT = 24 * 3_600_000
KEY_ROTATION_GRACE_MS_MAX = 7 * 24 * 3_600_000
# Characters of a cursor: an encoded budget id or stream id, with room.
CURSOR_LEN_MAX = 4 * BUDGET_ID_LEN_MAX
_KEY_ID = re.compile(r"key_[0-9a-f]{1,60}")
# Any id a store was given (keys made before ids were minted, or by a test) survives an export.
_STORED_KEY_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_KEY_HASH = re.compile(r"[0-9A-Za-z]{1,128}")  # a SHA-256 in hex, as core.service makes them
_STREAM_ID = re.compile(r"\d{1,16}-\d{1,16}")
# A window key as core/budgets.py makes them: no separator of the key layout.
_WINDOW = re.compile(r"[A-Za-z0-9_+@:/.-]{1,80}")


class Catalogue(KeyListing, Protocol):
    """The operators' catalogue beside a ledger: lists, deletion, the audit stream, and the raw
    reads and writes of an export and a restore, in the ledger's own layout (core/stores/keys.py,
    core/stores/wire.py). Optional: whoever makes the store passes it (core/backends.py), and
    what needs it says so when there is none."""

    def now_estimate(self) -> int: ...

    def use_ledger(self, ledger_id: str) -> None: ...

    async def budget_ids(self, prefix: str, after: str | None, count: int) -> list[str]: ...

    async def delete_budget(self, tag: str, budget_id: str, force: bool
                            ) -> tuple[int, int, int] | None: ...

    async def audit_append(self, fields: dict[str, str], retention_ms: int) -> str: ...

    async def audit_read(self, before: str | None, count: int
                         ) -> list[tuple[str, dict[str, str]]]: ...

    async def tags(self) -> list[str]: ...

    async def dump_tag(self, tag: str) -> TagDump: ...

    async def index_unlisted_keys(self) -> int: ...

    async def key_records(self) -> list[dict[str, str]]: ...

    async def has_data(self, tags: Iterable[str]) -> list[str]: ...

    async def begin_restore(self) -> None: ...

    async def stamp_ledger(self, ledger_id: str) -> None: ...

    async def write_hash(self, key: str, fields: dict[str, str], ttl_ms: int | None) -> None: ...

    async def read_hash(self, key: str) -> dict[str, str]: ...

    async def has_record(self, tag: str, reservation_id: str) -> bool: ...

    async def write_unknown(self, tag: str, reservation_id: str, record: wire.StoredRecord,
                            now_ms: int) -> bool: ...

    async def catalogue_tag(self, tag: str, ledger_id: str, digest: str) -> None: ...

    async def catalogue_budget(self, budget_id: str) -> None: ...

    async def write_users(self, tag: str, budget_id: str, users: Sequence[str]) -> None: ...

    async def write_key(self, record: dict[str, str]) -> None: ...

    async def adopt(self) -> tuple[str | None, str | None]: ...


@dataclass(frozen=True)
class Page:
    items: list[dict[str, Any]]
    next_cursor: str | None

    def json(self) -> dict[str, Any]:
        return {"items": self.items, "next_cursor": self.next_cursor}


@dataclass(frozen=True)
class UsersListing:
    """A page of a budget's end users (Operations.users): the budget's definition (its
    per_user limits and users_max, None without), the page, and the cursor of the next (None:
    the last)."""

    definition: BudgetDef
    page: UsersPage
    next_cursor: str | None


def page_size(limit: object) -> int:
    if limit is None:
        return PAGE_SIZE_DEFAULT
    if type(limit) is not int or not 1 <= limit <= PAGE_SIZE_MAX:
        raise InvalidRequest(f"limit must be an integer from 1 to {PAGE_SIZE_MAX}", field="limit")
    return limit


def encode_cursor(position: str) -> str:
    return base64.urlsafe_b64encode(position.encode()).decode().rstrip("=")


def decode_cursor(cursor: str | None) -> str | None:
    if cursor is None or cursor == "":
        return None
    if len(cursor) > CURSOR_LEN_MAX:
        raise InvalidRequest("not a cursor this list gave", field="cursor")
    try:
        position = base64.b64decode(cursor + "=" * (-len(cursor) % 4), altchars=b"-_",
                                    validate=True).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError) as exc:
        raise InvalidRequest("not a cursor this list gave", field="cursor") from exc
    if not position or not position.isprintable():
        raise InvalidRequest("not a cursor this list gave", field="cursor")
    return position


def checksum(document: dict[str, Any]) -> str:
    """Over everything but the checksum, in one canonical JSON form."""
    unsigned = {k: v for k, v in document.items() if k != "checksum"}
    text = json.dumps(unsigned, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _invalid(why: str) -> InvalidRequest:
    return InvalidRequest(f"not a valid ledger export: {why}; nothing was written",
                          field="export")


def _strings(value: object, why: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise _invalid(why)
    return value


def _amount(fields: dict[str, str], name: str) -> int:
    text = fields.get(name, "0")
    if not re.fullmatch(r"-?\d{1,16}", text) or abs(int(text)) > INT_EXACT_MAX:
        raise _invalid(f"{name} is not an integer below 2**53")
    return int(text)


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
                raise _invalid("an end user's counter") from exc
            return BudgetId.parse(budget)
    return BudgetId.parse(raw)


def verify_export(document: object) -> dict[str, Any]:
    """The export's body, once its format, checksum and every field are what an export writes."""
    if not isinstance(document, dict) or document.get("format") != EXPORT_FORMAT:
        raise _invalid(f"format is not {EXPORT_FORMAT}")
    if document.get("checksum") != checksum(document):
        raise _invalid("its checksum does not match its content (changed or truncated)")
    body = document.get("body")
    if not isinstance(body, dict) or not isinstance(body.get("organisations"), list) \
            or not isinstance(body.get("keys"), list):
        raise _invalid("no organisations or keys")
    for org in body["organisations"]:
        if not isinstance(org, dict) or not isinstance(org.get("tag"), str):
            raise _invalid("an organisation without a tag")
        tag = BudgetId.parse(org["tag"]).path
        if "/" in tag:
            raise _invalid(f"{tag} is not a top scope")
        _strings(org.get("meta", {}), "meta")
        for b in org.get("budgets", []):
            if BudgetId.parse(b.get("budget_id")).tag != tag:
                raise _invalid(f"{b.get('budget_id')} is not under {tag}")
            _strings(b.get("fields"), "a definition")
        for c in org.get("counters", []):
            if _counter_owner(c.get("budget_id")).tag != tag or not isinstance(
                    c.get("window_key"), str) or not _WINDOW.fullmatch(c["window_key"]):
                raise _invalid("a counter of another organisation or window")
            fields = _strings(c.get("fields"), "a counter")
            for name in ("committed", "reserved", "overshoot"):
                _amount(fields, name)
            ttl = c.get("ttl_ms")
            if ttl is not None and (type(ttl) is not int or not 0 < ttl <= INT_EXACT_MAX):
                raise _invalid("a counter's ttl_ms")
        for r in org.get("open_reservations", []):
            if not isinstance(r.get("reservation_id"), str) or not re.fullmatch(
                    r"[A-Za-z0-9_.:-]{1,128}", r["reservation_id"]) \
                    or not isinstance(r.get("record"), str):
                raise _invalid("an open reservation")
            record = wire.StoredRecord.unpacked(r["record"])
            if record.state != "open" or not 0 < _amount(
                    {"r": record.reserved_micros}, "r") <= CEILING_MICROS_MAX:
                raise _invalid("an open reservation's record")
        for u in org.get("users", []):
            if not isinstance(u, dict) or BudgetId.parse(u.get("budget_id")).tag != tag:
                raise _invalid("end users of another organisation")
            members = u.get("users")
            if not isinstance(members, list):
                raise _invalid("a budget's end users are not a list")
            for member in members:
                try:
                    check_user(member)
                except InvalidRequest as exc:
                    raise _invalid("an end user's id") from exc
    for k in body["keys"]:
        fields = _strings(k, "a key")
        if not _KEY_HASH.fullmatch(fields.get("key_hash", "")) or not _STORED_KEY_ID.fullmatch(
                fields.get("key_id", "")):
            raise _invalid("a key's id or hash")
        BudgetId.parse(fields.get("budget_id"))
    return body


@dataclass(frozen=True)
class BillEntry:
    budget_id: BudgetId
    billed_micros: int
    period: Period | None


def parse_bill(document: object) -> list[BillEntry]:
    """A provider's bill for the budgets it covers (BILL_FORMAT):

        {"format": "spend-ceiling/bill/1",
         "entries": [{"budget_id": "org:acme/team:search", "billed_micros": 1234567,
                      "period": "total"}]}

    `billed_micros` is what the provider billed for calls made with that budget's keys in that
    period's current window (`total`: ever; the default is the budget's longest period). List
    the budgets keys spend under, not their ancestors: an entry is booked up its whole path."""
    if not isinstance(document, dict) or document.get("format") != BILL_FORMAT \
            or not isinstance(document.get("entries"), list):
        raise InvalidRequest(f"not a bill: give {{\"format\": \"{BILL_FORMAT}\", \"entries\": "
                             "[...]}}", field="bill")
    out = []
    for e in document["entries"]:
        if not isinstance(e, dict):
            raise InvalidRequest("a bill entry is an object", field="bill")
        billed = e.get("billed_micros")
        if type(billed) is not int or not 0 <= billed <= CEILING_MICROS_MAX:
            raise InvalidRequest("billed_micros must be an integer micro-dollar amount",
                                 field="bill")
        period = e.get("period")
        if period is not None and period not in Period.__members__.values():
            raise InvalidRequest("period must be day, month or total", field="bill")
        out.append(BillEntry(BudgetId.parse(e.get("budget_id")), billed,
                             None if period is None else Period(period)))
    return out


def budget_json(definition: BudgetDef) -> dict[str, Any]:
    return {
        "budget_id": definition.budget_id.path,
        "limits": [{"period": x.period.value, "ceiling_micros": x.ceiling_micros}
                   for x in definition.limits],
        "timezone": definition.timezone,
        "outage_policy": definition.policy.value,
        "outage_allowance_micros": definition.outage_allowance_micros,
        "alerts": definition.alerts.json(),
        "paused_at_ms": definition.paused_at_ms,
        "rate": definition.rate.json() if definition.rate else None,
        "per_user": definition.per_user.json() if definition.per_user else None,
        "clamp": definition.clamp,
    }


def key_json(info: KeyInfo) -> dict[str, Any]:
    return {
        "key_id": info.key_id, "budget_id": info.budget_id, "roles": list(info.roles),
        "run_ceiling_micros": info.run_ceiling_micros, "created_ms": info.created_ms,
        "last_used_ms": info.last_used_ms, "rotated_at_ms": info.rotated_at_ms,
        "previous_secret_valid_ms": info.previous_valid_ms,
    }


def check_key_id(key_id: str) -> str:
    if not isinstance(key_id, str) or not _KEY_ID.fullmatch(key_id):
        raise InvalidRequest("not a key id", field="key_id")
    return key_id


def check_prefix(prefix: str | None) -> str:
    prefix = prefix or ""
    if len(prefix) > BUDGET_ID_LEN_MAX or not re.fullmatch(r"[A-Za-z0-9._:/-]*", prefix):
        raise InvalidRequest("prefix must be the beginning of a budget id", field="prefix")
    return prefix


class Operations:
    """The admin operations over one service's ledger. Without a catalogue (a store that keeps
    none) lists, export and restore say so; changes still work and are not audited."""

    def __init__(self, service: CeilingService, catalogue: Catalogue | None) -> None:
        self.service = service
        self.catalogue = catalogue

    def _needs(self) -> Catalogue:
        if self.catalogue is None:
            raise InvalidRequest("this needs a shared ledger (REDIS_URL or Upstash); the "
                                 "in-memory ledger keeps no catalogue")
        return self.catalogue

    async def audit(self, by: str, what: str, target: str, **detail: Any) -> None:
        if self.catalogue is None:
            return
        await self.catalogue.audit_append(
            {"who": by, "what": what, "target": target,
             "detail": json.dumps(detail, sort_keys=True, separators=(",", ":"))},
            AUDIT_RETENTION_MS)

    async def audit_page(self, cursor: str | None, limit: object = None) -> Page:
        before = decode_cursor(cursor)
        if before is not None and not _STREAM_ID.fullmatch(before):
            raise InvalidRequest("not a cursor this list gave", field="cursor")
        count = page_size(limit)
        found = await self._needs().audit_read(before, count)
        items = [{"id": entry_id, "at_ms": int(entry_id.split("-")[0]),
                  "who": f.get("who"), "what": f.get("what"), "target": f.get("target"),
                  "detail": json.loads(f.get("detail") or "{}")} for entry_id, f in found]
        return Page(items, encode_cursor(found[-1][0]) if len(found) == count else None)

    # -- budgets -------------------------------------------------------------------------

    async def put_budget(self, definition: BudgetDef, by: str) -> None:
        await self.service.put_budget(definition)
        await self.audit(by, "budget.put", definition.budget_id.path, **budget_json(definition))

    async def resume(self, budget_id: BudgetId, by: str) -> dict[str, Any]:
        """Lift the pause a velocity alarm put on a budget; `resumed` False if it had none."""
        resumed = await self.service.store.resume(budget_id)
        if resumed:
            await self.audit(by, "budget.resume", budget_id.path)
        return {"budget_id": budget_id.path, "resumed": resumed}

    async def budgets(self, prefix: str | None, cursor: str | None, limit: object = None
                      ) -> Page:
        prefix = check_prefix(prefix)
        count = page_size(limit)
        ids = await self._needs().budget_ids(prefix, decode_cursor(cursor), count)
        items = []
        for budget_id in ids:
            definition = await self.service.store.get_budget(BudgetId(budget_id))
            if definition is not None:
                items.append(budget_json(definition))
        return Page(items, encode_cursor(ids[-1]) if len(ids) == count else None)

    async def delete_budget(self, budget_id: BudgetId, force: bool, by: str) -> dict[str, Any]:
        catalogue = self._needs()
        done = await catalogue.delete_budget(budget_id.tag, budget_id.path, force)
        if done is None:
            raise BudgetNotFound(f"no budget {budget_id}", budget_id=budget_id.path)
        # Its keys go with it: a key of a deleted budget is refused (401), not left to spend
        # under whichever ancestors happen to have budgets.
        revoked = []
        while infos := await catalogue.keys_of(budget_id.path, None, PAGE_SIZE_MAX):
            for info in infos:
                await self.service.revoke_key(info.key_id)
                revoked.append(info.key_id)
        charged, held, users = done
        result = {"budget_id": budget_id.path, "deleted": True,
                  "reservations_charged_as_unknown": charged, "charged_micros": held,
                  "users_deleted": users, "keys_revoked": revoked}
        await self.audit(by, "budget.delete", budget_id.path, force=force,
                         reservations_charged_as_unknown=charged, charged_micros=held,
                         users_deleted=users, keys_revoked=revoked)
        return result

    async def users(self, budget_id: BudgetId, cursor: str | None, limit: object = None
                    ) -> UsersListing:
        """A page of the budget's end users in byte order of their ids, each with its legs now;
        the cursor is the last user of the page before, encoded. A budget without per_user
        limits lists the users it still keeps (from when it had them: they come back with their
        spend if per_user is put again), each with no legs; one that never had any, none."""
        definition = await self.service.store.get_budget(budget_id)
        if definition is None:
            raise BudgetNotFound(f"no budget {budget_id}", budget_id=budget_id.path)
        count = page_size(limit)
        after = decode_cursor(cursor)
        if after is not None:
            try:
                check_user(after)
            except InvalidRequest as exc:
                raise InvalidRequest("not a cursor this list gave", field="cursor") from exc
        page = await self.service.store.users_of(budget_id, after, count)
        last = page.users[-1].user if page.users else None
        return UsersListing(definition, page,
                            encode_cursor(last) if page.more and last is not None else None)

    # -- keys ----------------------------------------------------------------------------

    async def create_key(self, budget_id: BudgetId, run_ceiling_micros: int | None,
                         roles: frozenset[Role], by: str) -> NewKey:
        new = await self.service.create_key(budget_id, run_ceiling_micros, roles)
        await self.audit(by, "key.create", new.key_id, budget_id=budget_id.path,
                         roles=sorted(new.record.roles), run_ceiling_micros=run_ceiling_micros)
        return new

    async def revoke_key(self, key_id: str, by: str) -> bool:
        revoked = await self.service.revoke_key(check_key_id(key_id))
        if revoked:
            await self.audit(by, "key.revoke", key_id)
        return revoked

    async def rotate_key(self, key_id: str, grace_ms: object, by: str) -> dict[str, Any]:
        check_key_id(key_id)
        grace = KEY_ROTATION_GRACE_MS_DEFAULT if grace_ms is None else grace_ms
        if type(grace) is not int or not 0 <= grace <= KEY_ROTATION_GRACE_MS_MAX:
            raise InvalidRequest(f"grace_ms must be an integer from 0 to "
                                 f"{KEY_ROTATION_GRACE_MS_MAX}", field="grace_ms")
        # One step on the key's record (core/ledger.py KeyStore.rotate_key): of rotations
        # that race, the last leaves its secret and the one before it, for its grace.
        api_key = await self.service.rotate_key(key_id, grace)
        if api_key is None:
            raise BudgetNotFound(f"no key {key_id}", key_id=key_id)
        await self.audit(by, "key.rotate", key_id, grace_ms=grace)
        return {"key_id": key_id, "api_key": api_key, "previous_secret_valid_ms": grace,
                "note": "the api_key is shown once; only its hash is stored"}

    async def keys(self, budget_id: str | None, cursor: str | None, limit: object = None
                   ) -> Page:
        bid = None if budget_id is None else BudgetId.parse(budget_id).path
        count = page_size(limit)
        after = decode_cursor(cursor)
        found = await self._needs().keys_of(bid, after, count)
        items = [key_json(x) for x in found]
        last = f"{found[-1].budget_id} {found[-1].key_id}" if found else None
        return Page(items, encode_cursor(last) if last and len(found) == count else None)

    # -- corrections -------------------------------------------------------------------------

    async def correct(self, reservation_id: str, actual_micros: object, reason: object,
                      by: str, budget_id: BudgetId | None = None) -> Any:
        settled = await self.service.correct(reservation_id, actual_micros, reason, by,
                                             budget_id)
        await self.audit(by, "reservation.correct", reservation_id,
                         actual_micros=actual_micros, reason=reason)
        return settled

    # -- export, restore, adopt ----------------------------------------------------------------

    async def export(self, by: str) -> dict[str, Any]:
        catalogue = self._needs()
        ledger_id = await self.service.store.open()
        await catalogue.index_unlisted_keys()
        organisations = []
        for tag in await catalogue.tags():
            dump = await catalogue.dump_tag(tag)
            org: dict[str, Any] = {"tag": tag, "meta": {}, "budgets": [], "counters": [],
                                   "open_reservations": [], "users": []}
            for suffix, (ttl_ms, fields) in sorted(dump.hashes.items()):
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
        document: dict[str, Any] = {
            "format": EXPORT_FORMAT, "ledger_id": ledger_id,
            "exported_at_ms": catalogue.now_estimate(),
            "body": {"organisations": organisations, "keys": await catalogue.key_records()},
        }
        document["checksum"] = checksum(document)
        await self.audit(by, "ledger.export", ledger_id, organisations=len(organisations),
                         keys=len(document["body"]["keys"]))
        return document

    async def restore(self, document: object, bill: object | None, force: bool, by: str
                      ) -> dict[str, Any]:
        catalogue = self._needs()
        body = verify_export(document)
        entries = parse_bill(bill) if bill is not None else []
        assert isinstance(document, dict)
        orgs = body["organisations"]
        tags = [o["tag"] for o in orgs]
        live_tags = await catalogue.tags()
        found = await catalogue.has_data(tags)
        if found and not force:
            raise LedgerNotEmpty(
                "the ledger is not empty (" + ", ".join(found[:10]) + "); restore into an "
                "empty or wiped ledger, or give --force, which keeps the larger committed spend "
                "of every counter (never refills)", found=found[:10])
        try:
            previous: str | None = await self.service.store.open()
        except CeilingError:  # a reset ledger: its id is what is being replaced
            previous = None
        ledger_id = uuid.uuid4().hex
        # Everything is written under the new id before the ledger id itself, last: until then
        # an instance reads the old (or a fresh) id, finds these budgets under another one and
        # refuses (`ledger_reset`), so none serves a budget half restored.
        await catalogue.begin_restore()
        catalogue.use_ledger(ledger_id)
        now_ms = catalogue.now_estimate()
        charged_count = charged_micros = counters = budgets = users = 0
        for org in orgs:
            tag = org["tag"]
            deltas: dict[str, tuple[int, int]] = {}
            runs: set[str] = set()
            records = {r["reservation_id"]: wire.StoredRecord.unpacked(r["record"])
                       for r in org.get("open_reservations", [])}
            if force and tag in live_tags:
                # A reservation the ledger still has is booked in its counters as it stands.
                records = {rid: r for rid, r in records.items()
                           if not await catalogue.has_record(tag, rid)}
            for record in records.values():
                reserved_d, committed_d = unknown_effects(int(record.reserved_micros))
                for budget_id, window_key, run in legs_of(record):
                    suffix = f"{budget_id}|{window_key}"
                    if run:
                        runs.add(suffix)
                    r0, c0 = deltas.get(suffix, (0, 0))
                    deltas[suffix] = (r0 + reserved_d, c0 + committed_d)
            meta = {**org.get("meta", {}), "ledger": ledger_id}
            await catalogue.write_hash(keys.meta(tag), meta, None)
            for b in org.get("budgets", []):
                fields = dict(b["fields"])
                if "timezone" in fields:
                    fields["ledger"] = ledger_id
                await catalogue.write_hash(keys.definition(tag, b["budget_id"]), fields, None)
                await catalogue.catalogue_budget(b["budget_id"])
                budgets += 1
            for u in org.get("users", []):
                # Counted against users_max again, as before the export; their counters (a
                # user's total is never refilled) come back with the counters below.
                await catalogue.write_users(tag, u["budget_id"], u["users"])
                users += len(u["users"])
            exported = {f"{c['budget_id']}|{c['window_key']}": c for c in org.get("counters", [])}
            for suffix in sorted(set(exported) | {s for s in deltas if s not in runs}):
                c = exported.get(suffix)
                fields = dict(c["fields"]) if c else {}
                _, committed_d = deltas.get(suffix, (0, 0))
                committed = _amount(fields, "committed") + committed_d
                # Every hold the export recorded is charged above; any other the counter held
                # was taken or resolved while the export read (core/stores/operations.py
                # dump_tag), and nothing in the restored ledger holds it.
                reserved = 0
                overshoot = _amount(fields, "overshoot")
                budget_id, _, window_key = suffix.rpartition("|")
                key = keys.counter(tag, budget_id, window_key)
                if force and tag in live_tags:
                    live = await catalogue.read_hash(key)
                    if live:
                        committed = max(committed, _amount(live, "committed"))
                        reserved = _amount(live, "reserved")  # the live ledger's own holds
                        overshoot = max(overshoot, _amount(live, "overshoot"))
                fields.update(committed=str(committed), reserved=str(reserved),
                              overshoot=str(overshoot))
                await catalogue.write_hash(key, fields, c.get("ttl_ms") if c else None)
                counters += 1
            for rid, record in records.items():
                if await catalogue.write_unknown(tag, rid, record, now_ms):
                    charged_count += 1
                    charged_micros += int(record.reserved_micros)
            await catalogue.catalogue_tag(tag, ledger_id, tag_digest(tag))
        if force:
            # Organisations the ledger has and the export does not: under the new id too.
            for tag in sorted(set(live_tags) - set(tags)):
                dump = await catalogue.dump_tag(tag)
                for suffix, (ttl_ms, fields) in dump.hashes.items():
                    if suffix == keys.META or (suffix.startswith(keys.DEFINITION)
                                               and "timezone" in fields):
                        await catalogue.write_hash(f"{keys.prefix(tag)}{suffix}",
                                                   {**fields, "ledger": ledger_id}, ttl_ms)
                await catalogue.catalogue_tag(tag, ledger_id, tag_digest(tag))
        for k in body["keys"]:
            await catalogue.write_key(k)
        booked = [await self._book_from_bill(e, ledger_id, by) for e in entries]
        await catalogue.stamp_ledger(ledger_id)
        result = {
            "ledger_id": ledger_id, "previous_ledger_id": previous,
            "exported_ledger_id": document.get("ledger_id"), "budgets": budgets,
            "counters": counters, "users": users, "keys": len(body["keys"]),
            "open_reservations_charged_as_unknown": charged_count,
            "charged_micros": charged_micros, "booked_from_bill": booked,
            "next": "instances that reported ledger_reset serve again once you run "
                    "`ceiling ledger adopt` (or POST /v1/admin/ledger/adopt)",
        }
        await self.audit(by, "ledger.restore", ledger_id, force=force,
                         **{k: v for k, v in result.items() if k != "next"})
        return result

    async def _book_from_bill(self, entry: BillEntry, ledger_id: str, by: str
                              ) -> dict[str, Any]:
        """Book what the bill shows beyond what the restored counter holds, up the budget's path,
        once (the booking's id is made from the ledger id and the entry)."""
        catalogue, store = self._needs(), self.service.store
        bid = entry.budget_id
        legs = await store.status((bid,))
        own = [leg for leg in legs if leg.budget_id == bid.path]
        if not own:
            raise BudgetNotFound(f"the bill names {bid}, which the export has no budget for",
                                 budget_id=bid.path)
        leg = _leg_for(own, entry.period)
        gap = entry.billed_micros - leg.committed_micros
        out: dict[str, Any] = {"budget_id": bid.path, "period": leg.period.value,
                               "billed_micros": entry.billed_micros,
                               "restored_committed_micros": leg.committed_micros,
                               "booked_micros": max(0, gap)}
        if gap > 0:
            digest = hashlib.sha256(f"{ledger_id} {bid.path} {leg.window_key}".encode())
            rid = mint_reservation_id(bid.tag, digest.hexdigest()[:32])
            await store.book(ReserveRequest(
                ref=ReservationRef(bid.tag, rid, by), budget_ids=bid.lineage,
                amount_micros=gap, ttl_ms=RESERVATION_TTL_MS_MIN, fingerprint=rid,
                price_version="provider-bill"), gap, catalogue.now_estimate())
            out["reservation_id"] = rid
        return out

    async def adopt(self, by: str) -> dict[str, Any]:
        current, restored = await self._needs().adopt()
        if current is None or current != restored:
            raise InvalidRequest(
                "nothing to adopt: no restore stamped the ledger that is there now (restore "
                "first: `ceiling ledger restore FILE`), and no instance found it rolled back",
                field="ledger_id")
        await self.audit(by, "ledger.adopt", current)
        return {"ledger_id": current, "adopted": True,
                "note": "instances that reported ledger_reset or ledger_rolled_back take this "
                        "ledger within a second of their next call or health check"}


def _leg_for(legs: list[LegStatus], period: Period | None) -> LegStatus:
    order = [period] if period is not None else [Period.TOTAL, Period.MONTH, Period.DAY]
    for p in order:
        for leg in legs:
            if leg.period is p:
                return leg
    raise InvalidRequest(f"the budget has no {period} limit to compare the bill with",
                         field="bill")
