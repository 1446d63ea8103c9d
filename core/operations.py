"""Operating the ledger: lists, deletion and key rotation, the audit stream of every admin change,
and recovery from a wiped ledger with one export, one restore and one confirmation.

Every change an operator makes here is appended to the audit stream: who (a fingerprint of the
admin credential, core.service.operator_fingerprint), what, which target, and when (the entry's
id is the ledger's time). Lists page with an opaque cursor and a bounded page size and never
show a secret or a key's hash.

Export and restore. An export is one JSON document (EXPORT_FORMAT): the ledger id, every
organisation's budgets (as the admin API shows them), every period window's spend, its open
reservations and those charged as unknown, its end users, the API keys (hashes only; the secrets
were never stored) and the audit stream, with a checksum over all of it. Its body names no part
of the ledger's layout; the store reads and writes it (Catalogue.export_body, restore_body, and
an export of format /1 through the store's one reader of it); this module makes and checks the
envelope around it, and books the bill. A restore writes it into an empty (or wiped) ledger under
a new ledger id: committed spend comes back as it was, never refilled; an open reservation comes
back charged as unknown (its hold committed, as expiry under 'charge' books it, so a late settle
or an operator's correction still lowers it); keys keep working. With a provider's bill
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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from core.audit import STREAM_ID, audit_fields, audit_json
from core.budget_json import budget_json
from core.budgets import BudgetDef, BudgetId, Period, check_user
from core.errors import BudgetNotFound, InvalidRequest
from core.ledger import (
    KeyInfo,
    KeyListing,
    LegStatus,
    ReservationRef,
    ReserveRequest,
    Restored,
    Role,
    UsersPage,
    invalid_export,
    mint_reservation_id,
)
from core.limits import BUDGET_ID_LEN_MAX, CEILING_MICROS_MAX, RESERVATION_TTL_MS_MIN
from core.service import CeilingService, NewKey

EXPORT_FORMAT = "spend-ceiling/ledger-export/2"
# Formats a restore reads: this one, and /1 (an export made before /2), which the store reads as
# the /2 body it means (Catalogue.restore_body).
EXPORT_FORMATS_READ = ("spend-ceiling/ledger-export/1", EXPORT_FORMAT)
BILL_FORMAT = "spend-ceiling/bill/1"
# Admin changes are kept as long as day and month counters (core/limits.py COUNTER_RETENTION_MS):
# a change can be looked up for as long as the spend it affected can.
AUDIT_RETENTION_MS = 400 * 24 * 3_600_000
# A list answers this many items unless asked for fewer, and never more than the maximum: one
# page is one bounded read of the ledger (a key's row takes one command).
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


class Catalogue(KeyListing, Protocol):
    """The operators' catalogue beside a ledger: lists, deletion, the audit stream, and the body
    of an export and of its restore, a document the store writes and reads (JSON values only;
    core/stores/operations.py says what it holds). Optional: whoever makes the store passes it
    (core/backends.py), and what needs it says so when there is none."""

    def now_estimate(self) -> int:
        """The ledger's time as this instance last learnt it, advanced by its own clock."""
        ...

    async def budget_ids(self, prefix: str, after: str | None, count: int) -> list[str]: ...

    async def delete_budget(self, tag: str, budget_id: str, force: bool
                            ) -> tuple[int, int, int] | None: ...

    async def audit_append(self, fields: dict[str, str], retention_ms: int) -> str: ...

    async def audit_read(self, before: str | None, count: int
                         ) -> list[tuple[str, dict[str, str]]]: ...

    async def export_body(self) -> dict[str, Any]:
        """Every organisation's budgets, counters, open reservations and end users, and every
        key's record (its secrets' hashes, never a secret): the body of an export."""
        ...

    async def restore_body(self, body: object, force: bool, document_format: str,
                           name_of: Callable[[str], str | None]) -> Restored:
        """Check `body`, of an export of `document_format` (one of EXPORT_FORMATS_READ), whole
        (invalid_export: nothing written; each model a budget names by its one name, `name_of`'s
        as a put's), refuse a ledger with data unless `force` (LedgerNotEmpty), then write it
        under a new ledger id, each organisation in one step, and use that id from then on. Not
        stamped (stamp_restored): until then an instance reads the old (or a fresh) id, finds
        these budgets under another one and refuses them (`ledger_reset`), so none serves a
        budget half restored."""
        ...

    async def stamp_restored(self, ledger_id: str) -> None:
        """Make `ledger_id`, which a restore wrote, the ledger's: the last step of a restore."""
        ...

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


def verify_export(document: object) -> tuple[str, dict[str, Any]]:
    """The export's format and body, once its format and checksum are what an export writes;
    what the body holds is the store's to check (Catalogue.restore_body)."""
    if not isinstance(document, dict) or document.get("format") not in EXPORT_FORMATS_READ:
        raise invalid_export(f"format is not {EXPORT_FORMAT} (or /1)")
    if document.get("checksum") != checksum(document):
        raise invalid_export("its checksum does not match its content (changed or truncated)")
    body = document.get("body")
    if not isinstance(body, dict):
        raise invalid_export("no body")
    return str(document["format"]), body


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
        await self.catalogue.audit_append(audit_fields(by, what, target, detail),
                                          AUDIT_RETENTION_MS)

    async def audit_page(self, cursor: str | None, limit: object = None) -> Page:
        before = decode_cursor(cursor)
        if before is not None and not STREAM_ID.fullmatch(before):
            raise InvalidRequest("not a cursor this list gave", field="cursor")
        count = page_size(limit)
        found = await self._needs().audit_read(before, count)
        items = [audit_json(entry_id, f) for entry_id, f in found]
        return Page(items, encode_cursor(found[-1][0]) if len(found) == count else None)

    # -- budgets -------------------------------------------------------------------------

    async def put_budget(self, definition: BudgetDef, by: str) -> None:
        definition = await self.service.put_budget(definition)
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
                      by: str) -> Any:
        settled = await self.service.correct(reservation_id, actual_micros, reason, by)
        await self.audit(by, "reservation.correct", reservation_id,
                         actual_micros=actual_micros, reason=reason)
        return settled

    # -- export, restore, adopt ----------------------------------------------------------------

    async def export(self, by: str) -> dict[str, Any]:
        catalogue = self._needs()
        ledger_id = await self.service.store.open()
        body = await catalogue.export_body()
        document: dict[str, Any] = {
            "format": EXPORT_FORMAT, "ledger_id": ledger_id,
            "exported_at_ms": catalogue.now_estimate(), "body": body,
        }
        document["checksum"] = checksum(document)
        await self.audit(by, "ledger.export", ledger_id, organisations=len(body["organisations"]),
                         keys=len(body["keys"]))
        return document

    async def restore(self, document: object, bill: object | None, force: bool, by: str
                      ) -> dict[str, Any]:
        catalogue = self._needs()
        document_format, body = verify_export(document)
        entries = parse_bill(bill) if bill is not None else []
        assert isinstance(document, dict)
        done = await catalogue.restore_body(body, force, document_format,
                                            self.service.prices.model_name)
        # Under the restored id, before its stamp: the spend between the export and the wipe.
        booked = [await self._book_from_bill(e, done.ledger_id, by) for e in entries]
        await catalogue.stamp_restored(done.ledger_id)
        result = {
            "ledger_id": done.ledger_id, "previous_ledger_id": done.previous_ledger_id,
            "exported_ledger_id": document.get("ledger_id"), "budgets": done.budgets,
            "counters": done.counters, "users": done.users, "keys": done.keys,
            "open_reservations_charged_as_unknown": done.charged_count,
            "charged_micros": done.charged_micros, "booked_from_bill": booked,
            "next": "instances that reported ledger_reset serve again once you run "
                    "`ceiling ledger adopt` (or POST /v1/admin/ledger/adopt)",
        }
        await self.audit(by, "ledger.restore", done.ledger_id, force=force,
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
