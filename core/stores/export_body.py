"""The body of a ledger export (format /2), a document that names no key, hash field or packed
record: what a Redis-speaking ledger holds, by the names of the domain. Read from the ledger
(`organisation`, `key_entry`), checked whole (`checked`), and turned into what
lua/restore_tag.lua writes (`sections`); core/stores/operations.py does the reading and writing.

    {"organisations": [{
       "tag": "org:acme", "reserve_sequence": 12,
       "budgets": [<a budget as GET /v1/admin/budgets/{id} shows it: core/budget_json.py>],
       "counters": [{"budget_id": "org:acme/team:a", "window": "day:2026-12-05",
                     "committed_micros": 1200, "overshoot_micros": 0,
                     "thresholds_alerted_pct": [50], "exceeded_alerted": false,
                     "last_write_ms": null}],
       "reservations": [{"reservation_id": "...", "owner": "key_...", "state": "open",
                         "expire_policy": "charge", "reserved_micros": 70,
                         "created_ms": ..., "lease_ends_at_ms": ..., "retention_ms": ...,
                         "legs": [{"budget_id": "org:acme", "window": "total",
                                   "ceiling_micros": 10000000, "resets_at_ms": null,
                                   "outage_allowance_micros": 0, "concurrency_slot": false,
                                   "velocity_watched": false}],
                         "fingerprint": "...", "price_version": "...", "model": "..."}],
       "users": [{"budget_id": "org:acme", "users": ["alice", "bob"]}]}],
     "keys": [{"key_id": "key_...", "budget_id": "org:acme/team:a", "roles": ["gateway"],
               "key_hash": "<sha256 hex>", "previous_key_hash": null,
               "previous_secret_valid_until_ms": null, "run_ceiling_micros": null,
               "created_ms": ..., "last_used_ms": ..., "rotated_at_ms": null}]}

A counter is one budget path's spend in one period window ('total' for ever), an end user's
('<budget>/user:<id>') and a key's run's ('<budget>/run:<id>', its `last_write_ms` when the run
was last used) among them; its alert marks say which threshold events (and the first refusal's,
`exceeded_alerted`) went out for that window, so a restore sends none of them again. A
reservation's legs are what it holds money in, with the ceiling, reset and outage allowance it
was admitted under; every leg holds its `reserved_micros`. Only open reservations are exported:
a restore charges each as unknown (as an expiry under 'charge' books it), so a late settle or an
operator's correction still lowers it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from core.audit import audit_entry_of_json, stream_position
from core.budget_json import budget_json, definition_of_json
from core.budgets import (
    MODEL_SCOPE_KIND,
    RUN_SCOPE_KIND,
    USER_SCOPE_KIND,
    BudgetDef,
    BudgetId,
    canonical_models,
    check_user,
    is_model_name,
)
from core.errors import InvalidRequest
from core.ledger import (
    ExpirePolicy,
    ReservationState,
    Role,
    invalid_export,
)
from core.lifecycle import Event, effects
from core.limits import CEILING_MICROS_MAX, INT_EXACT_MAX
from core.stores import keys, wire
from core.stores.scripted_catalogue import definition_fields

# Any key id a ledger holds survives an export, not only the shape core/service.py mints: a
# migrated key keeps the id it was made with, and a test names its own.
_STORED_KEY_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_KEY_HASH = re.compile(r"[0-9A-Za-z]{1,128}")  # a SHA-256 in hex, as core.service makes them
# A window key as core/budgets.py makes them: no separator of the key layout.
_WINDOW = re.compile(r"[A-Za-z0-9_+@:/.-]{1,80}")
_RESERVATION_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
# A reservation's owner and fingerprint (an API key's id, 'gw:' and one; a digest): kept in the
# packed record unescaped, so printable and without its separator.
_OWNER = re.compile(r"[^\t\x00-\x1f\x7f]{0,512}")
# A counter's alert mark: a threshold percent, or the first refusal of its window.
_ALERTED = "alerted:"
_EXCEEDED = "exceeded"
# A run's counter: when the run last wrote it (lua/lib.lua touch_run).
_SEEN = "seen"
# (state, outcome, expire_policy) of a reservation an expiry charged as unknown: the one kind of
# resolved reservation an export carries, as a late settle or a correction may still lower it.
CHARGED_AS_UNKNOWN = (ReservationState.EXPIRED.value, "unknown", ExpirePolicy.CHARGE.value)
_VELOCITY_ENTRY = f"{wire.ITEM_SEPARATOR}{{}},{{}}"  # the meta hash's list of velocity alarms


# -- the ledger as the document names it ---------------------------------------------------


def counter_entry(budget_id: str, window: str, fields: Mapping[str, str]) -> dict[str, Any]:
    """A counter's hash (its holds are in the open reservations, not here)."""
    marks = [m.removeprefix(_ALERTED) for m in fields if m.startswith(_ALERTED)]
    seen = fields.get(_SEEN)
    return {"budget_id": budget_id, "window": window,
            "committed_micros": int(fields.get("committed") or 0),
            "overshoot_micros": int(fields.get("overshoot") or 0),
            "thresholds_alerted_pct": sorted(int(m) for m in marks if m != _EXCEEDED),
            "exceeded_alerted": _EXCEEDED in marks,
            "last_write_ms": int(seen) if seen else None}


def reservation_entry(reservation_id: str, record: wire.StoredRecord) -> dict[str, Any]:
    """An open reservation's record, or one an expiry charged as unknown (CHARGED_AS_UNKNOWN)."""
    legs = []
    for item in filter(None, record.legs.split(wire.ITEM_SEPARATOR)):
        budget_id, window, ceiling, resets, allowance, *mark = item.split(wire.PART_SEPARATOR)
        flags = mark[0] if mark and mark[0] != RUN_SCOPE_KIND else ""
        legs.append({"budget_id": budget_id, "window": window, "ceiling_micros": int(ceiling),
                     "resets_at_ms": int(resets) or None,
                     "outage_allowance_micros": int(allowance),
                     "concurrency_slot": "c" in flags, "velocity_watched": "v" in flags})
    return {"reservation_id": reservation_id, "owner": record.owner, "state": record.state,
            "outcome": record.outcome, "resolved_ms": _number(record.resolved_ms),
            "expire_policy": record.expire_policy, "reserved_micros": int(record.reserved_micros),
            "created_ms": int(record.created_ms), "lease_ends_at_ms": int(record.expires_at_ms),
            "retention_ms": int(record.retention_ms), "legs": legs,
            "fingerprint": record.fingerprint,
            "price_version": wire.unescaped(record.price_version),
            "model": wire.unescaped(record.model)}


def key_entry(fields: Mapping[str, str]) -> dict[str, Any]:
    """A key's record (lua/key_put.lua's fields): its secrets' hashes, never a secret."""
    previous = fields.get("previous_key_hash") or None
    return {"key_id": fields["key_id"], "budget_id": fields["budget_id"],
            "roles": sorted(fields["roles"].split(",")), "key_hash": fields["key_hash"],
            "previous_key_hash": previous,
            "previous_secret_valid_until_ms":
                _number(fields.get("grace_ends_at_ms")) if previous else None,
            "run_ceiling_micros": _number(fields.get("run_ceiling_micros")),
            "created_ms": _number(fields.get("created_ms")),
            "last_used_ms": _number(fields.get("last_used_ms")),
            "rotated_at_ms": _number(fields.get("rotated_at_ms"))}


def organisation(tag: str, meta: Mapping[str, str], definitions: Mapping[str, BudgetDef],
                 counters: Sequence[dict[str, Any]], reservations: Sequence[dict[str, Any]],
                 users: Mapping[str, Sequence[str]]) -> dict[str, Any]:
    return {"tag": tag, "reserve_sequence": int(meta.get("seq") or 0),
            "budgets": [budget_json(definitions[b]) for b in sorted(definitions)],
            "counters": sorted(counters, key=lambda c: (c["budget_id"], c["window"])),
            "reservations": sorted(reservations, key=lambda r: r["reservation_id"]),
            "users": [{"budget_id": b, "users": sorted(users[b])} for b in sorted(users)]}


def _number(value: str | None) -> int | None:
    return int(value) if value else None


# -- checked ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reservation:
    """A checked reservation: its record as it was open, and when an expiry charged it as
    unknown (None: open still, and the restore charges it)."""

    reservation_id: str
    record: wire.StoredRecord
    resolved_ms: int | None


@dataclass(frozen=True)
class Organisation:
    """One organisation of a checked body, ready to be written."""

    tag: str
    reserve_sequence: int
    budgets: tuple[BudgetDef, ...]
    counters: tuple[dict[str, Any], ...]
    reservations: tuple[Reservation, ...]
    users: tuple[tuple[str, tuple[str, ...]], ...]


@dataclass(frozen=True)
class Key:
    key_id: str
    budget_id: str
    roles: tuple[str, ...]
    key_hash: str
    previous_key_hash: str | None
    previous_secret_valid_until_ms: int | None
    run_ceiling_micros: int | None
    created_ms: int | None
    last_used_ms: int | None
    rotated_at_ms: int | None


def checked(body: object, name_of: Callable[[str], str | None]
            ) -> tuple[list[Organisation], list[Key], list[tuple[str, dict[str, str]]]]:
    """The organisations, keys and audit entries (id, fields) of a /2 body, once every field is
    what an export writes (invalid_export otherwise): nothing malformed reaches a script. Each
    model a budget names is given its one name, `name_of`'s (PriceTable.model_name), as a put
    gives it (core/budgets.py canonical_models): a name a restore kept otherwise would be a
    counter no call is counted in."""
    if not isinstance(body, dict):
        raise invalid_export("no body")
    _fields(body, "a body", {"organisations", "keys", "audit"})
    orgs = [_organisation(o, name_of)
            for o in _list(body.get("organisations"), "no organisations")]
    if len({o.tag for o in orgs}) != len(orgs):
        raise invalid_export("an organisation given twice")
    audit = []
    for entry in _list(body.get("audit", []), "an audit that is not a list of entries"):
        try:
            audit.append(audit_entry_of_json(entry))
        except InvalidRequest as exc:
            raise invalid_export("an audit entry") from exc
    if [i for i, _ in audit] != sorted((i for i, _ in audit), key=stream_position):
        raise invalid_export("audit entries out of order")
    return orgs, [_key(k) for k in _list(body.get("keys"), "no keys")], audit


def _organisation(org: dict[str, Any], name_of: Callable[[str], str | None]) -> Organisation:
    _fields(org, "an organisation", {"tag", "reserve_sequence", "budgets", "counters",
                                     "reservations", "users"})
    tag = _budget(org.get("tag"), "an organisation's tag").path
    if "/" in tag:
        raise invalid_export(f"{tag} is not a top scope")
    budgets = []
    for b in _list(org.get("budgets", []), "budgets"):
        bid = _budget(b.get("budget_id"), "a budget id")
        if bid.tag != tag:
            raise invalid_export(f"{bid} is not under {tag}")
        try:
            budgets.append(canonical_models(definition_of_json(bid, b, kept=True), name_of))
        except InvalidRequest as exc:
            raise invalid_export(f"the definition of {bid}: {exc}") from exc
    counters = tuple(_counter(c, tag) for c in _list(org.get("counters", []), "counters"))
    reservations = tuple(_reservation(r, tag)
                         for r in _list(org.get("reservations", []), "reservations"))
    users = []
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
        users.append((u["budget_id"], tuple(members)))
    return Organisation(tag, _integer(org.get("reserve_sequence", 0), "reserve_sequence"),
                        tuple(budgets), counters, reservations, tuple(users))


def _counter(c: dict[str, Any], tag: str) -> dict[str, Any]:
    _fields(c, "a counter", {"budget_id", "window", "committed_micros", "overshoot_micros",
                             "thresholds_alerted_pct", "exceeded_alerted", "last_write_ms"})
    if _counter_owner(c.get("budget_id")).tag != tag:
        raise invalid_export("a counter of another organisation")
    _window(c.get("window"))
    _integer(c.get("committed_micros", 0), "a counter's committed_micros", signed=True)
    _integer(c.get("overshoot_micros", 0), "a counter's overshoot_micros", signed=True)
    pcts = c.get("thresholds_alerted_pct", [])
    if not isinstance(pcts, list) or not all(type(p) is int and 1 <= p <= 100 for p in pcts):
        raise invalid_export("a counter's thresholds_alerted_pct")
    if not isinstance(c.get("exceeded_alerted", False), bool):
        raise invalid_export("a counter's exceeded_alerted")
    if c.get("last_write_ms") is not None:
        _integer(c["last_write_ms"], "a counter's last_write_ms")
    return c


def _reservation(r: dict[str, Any], tag: str) -> Reservation:
    _fields(r, "a reservation", {"reservation_id", "owner", "state", "outcome", "resolved_ms",
                                 "expire_policy",
                                 "reserved_micros", "created_ms", "lease_ends_at_ms",
                                 "retention_ms", "legs", "fingerprint", "price_version",
                                 "model"})
    rid = r.get("reservation_id")
    if not isinstance(rid, str) or not _RESERVATION_ID.fullmatch(rid):
        raise invalid_export("a reservation's id")
    state = (r.get("state"), r.get("outcome", ""), r.get("expire_policy"))
    if state != CHARGED_AS_UNKNOWN and (state[:2] != (ReservationState.OPEN.value, "")
                                        or state[2] not in ExpirePolicy.__members__.values()):
        raise invalid_export("a reservation neither open nor charged as unknown")
    if (r.get("resolved_ms") is None) != (state[0] == ReservationState.OPEN.value):
        raise invalid_export("a reservation's resolved_ms")
    resolved_ms = None if r.get("resolved_ms") is None else _integer(
        r["resolved_ms"], "a reservation's resolved_ms")
    for name in ("owner", "fingerprint"):
        if not isinstance(r.get(name), str) or not _OWNER.fullmatch(r[name]):
            raise invalid_export(f"a reservation's {name}")
    for name in ("price_version", "model"):
        if not isinstance(r.get(name), str):
            raise invalid_export(f"a reservation's {name}")
    reserved = _integer(r.get("reserved_micros"), "a reservation's reserved_micros")
    if not 0 < reserved <= CEILING_MICROS_MAX:
        raise invalid_export("a reservation's reserved_micros")
    legs = []
    for leg in _list(r.get("legs"), "a reservation's legs") or [None]:
        if leg is None:
            raise invalid_export("a reservation with no legs")
        _fields(leg, "a leg", {"budget_id", "window", "ceiling_micros", "resets_at_ms",
                               "outage_allowance_micros", "concurrency_slot",
                               "velocity_watched"})
        owner = leg.get("budget_id")
        if _counter_owner(owner).tag != tag:
            raise invalid_export("a reservation's legs")
        resets = leg.get("resets_at_ms")
        numbers = [_integer(leg.get("ceiling_micros"), "a leg's ceiling_micros", signed=True),
                   0 if resets is None else _integer(resets, "a leg's resets_at_ms"),
                   _integer(leg.get("outage_allowance_micros"), "a leg's allowance")]
        slot, watched = leg.get("concurrency_slot"), leg.get("velocity_watched")
        if not isinstance(slot, bool) or not isinstance(watched, bool):
            raise invalid_export("a leg's flags")
        # The flags lua/lib.lua gives a leg, in its order, from what its budget id says: an end
        # user's ('e') and a model's ('m') raise no alerts of their own.
        user = f"/{USER_SCOPE_KIND}:" in owner
        model = _model_of(owner) is not None
        flags = (RUN_SCOPE_KIND if f"/{RUN_SCOPE_KIND}:" in owner else
                 ("e" if user else "") + ("m" if model else "") + ("c" if slot else "")
                 + ("v" if watched else ""))
        legs.append(wire.PART_SEPARATOR.join(
            [owner, _window(leg.get("window")), *map(str, numbers), *filter(None, [flags])]))
    times = {name: str(_integer(r.get(name), f"a reservation's {name}"))
             for name in ("created_ms", "lease_ends_at_ms", "retention_ms")}
    record = wire.StoredRecord(
        state=ReservationState.OPEN.value, reserved_micros=str(reserved),
        expire_policy=r["expire_policy"], retention_ms=times["retention_ms"],
        owner=r["owner"], legs=wire.ITEM_SEPARATOR.join(legs),
        expires_at_ms=times["lease_ends_at_ms"], created_ms=times["created_ms"],
        actual_micros="", released_micros="", overshoot_micros="", late="", outcome="",
        resolved_ms="", corrected_by="", corrected_at_ms="", correction_reason="",
        fingerprint=r["fingerprint"], price_version=wire.escaped(r["price_version"]),
        model=wire.escaped(r["model"]))
    return Reservation(rid, record, resolved_ms)


def _key(k: dict[str, Any]) -> Key:
    _fields(k, "a key", {"key_id", "budget_id", "roles", "key_hash", "previous_key_hash",
                         "previous_secret_valid_until_ms", "run_ceiling_micros", "created_ms",
                         "last_used_ms", "rotated_at_ms"})
    key_id, key_hash, previous = k.get("key_id"), k.get("key_hash"), k.get("previous_key_hash")
    if not isinstance(key_id, str) or not _STORED_KEY_ID.fullmatch(key_id) \
            or not isinstance(key_hash, str) or not _KEY_HASH.fullmatch(key_hash) \
            or not (previous is None or (isinstance(previous, str)
                    and _KEY_HASH.fullmatch(previous))):
        raise invalid_export("a key's id or hash")
    roles = k.get("roles")
    if not isinstance(roles, list) or not roles or not all(
            isinstance(r, str) and r in Role.__members__.values() for r in roles):
        raise invalid_export("a key's roles")
    numbers = {name: None if k.get(name) is None else _integer(k[name], f"a key's {name}")
               for name in ("previous_secret_valid_until_ms", "run_ceiling_micros",
                            "created_ms", "last_used_ms", "rotated_at_ms")}
    return Key(key_id, _budget(k.get("budget_id"), "a key's budget id").path,
               tuple(sorted(roles)), key_hash, previous, **numbers)


def _fields(value: dict[str, Any], what: str, allowed: set[str]) -> None:
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise invalid_export(f"{what} has no field {unknown[0]!r}")


def _list(value: object, why: str) -> list[Any]:
    if not isinstance(value, list) or not all(isinstance(x, dict) for x in value):
        raise invalid_export(why)
    return value


def _integer(value: object, why: str, *, signed: bool = False) -> int:
    if type(value) is not int or not (-INT_EXACT_MAX if signed else 0) <= value <= INT_EXACT_MAX:
        raise invalid_export(f"{why} is not an integer below 2**53")
    return value


def _window(value: object) -> str:
    if not isinstance(value, str) or not _WINDOW.fullmatch(value):
        raise invalid_export("a period window")
    return value


def _budget(raw: object, why: str) -> BudgetId:
    try:
        return BudgetId.parse(raw)
    except InvalidRequest as exc:
        raise invalid_export(why) from exc


def _model_of(budget_id: str) -> str | None:
    """The model of a model's counter '<budget>/model:<model>' (BudgetId.model), else None."""
    _, marker, model = budget_id.rpartition(f"/{MODEL_SCOPE_KIND}:")
    return model if marker and is_model_name(model, limited=True) else None


def _counter_owner(raw: object) -> BudgetId:
    """The budget a counter is kept for: a budget's id (a run's too), an end user's
    '<budget>/user:<id>', or a model's '<budget>/model:<model>', which BudgetId.parse refuses
    (a user id or a model's name may hold ':' and '@', be longer than a scope's name, and make
    a path one scope longer than an operator's)."""
    if isinstance(raw, str):
        budget, marker, _ = raw.rpartition(f"/{MODEL_SCOPE_KIND}:")
        if marker:
            if _model_of(raw) is None:
                raise invalid_export("a model's counter")
            return _budget(budget, "a counter's budget id")
        budget, marker, user = raw.rpartition(f"/{USER_SCOPE_KIND}:")
        if marker and "/" not in user:
            try:
                check_user(user)
            except InvalidRequest as exc:
                raise invalid_export("an end user's counter") from exc
            return _budget(budget, "a counter's budget id")
    return _budget(raw, "a counter's budget id")


# -- as lua/restore_tag.lua writes it --------------------------------------------------------


def unknown_effects(held_micros: int) -> tuple[int, int]:
    """(reserved delta, committed delta) of charging an open hold as unknown (core/lifecycle.py's
    expiry under 'charge')."""
    fx = effects(Event.EXPIRE, ReservationState.OPEN, ExpirePolicy.CHARGE, held_micros)
    return fx.reserved_delta, fx.committed_delta


def _charged(record: wire.StoredRecord, now_ms: int) -> str:
    """An open reservation as expiry under 'charge' leaves it, packed: committed in its legs
    (lua/restore_tag.lua books that), outcome 'unknown', so a late settle or an operator's
    correction still corrects it."""
    fx = effects(Event.EXPIRE, ReservationState.OPEN, ExpirePolicy.CHARGE,
                 int(record.reserved_micros))
    return record._replace(
        state=fx.to.value, expire_policy=ExpirePolicy.CHARGE.value, outcome=fx.outcome,
        resolved_ms=str(now_ms), released_micros=str(fx.released_micros),
        overshoot_micros=str(fx.overshoot_micros), late="1" if fx.late else "0",
        actual_micros="").packed()


def _counter_kind(budget_id: str, window: str) -> str:
    """Which sweep index lists a counter (lua/restore_tag.lua): a period window's, a run's, or
    none (a budget's total, kept as long as the budget)."""
    if window != "total":
        return "window"
    return "run" if f"/{RUN_SCOPE_KIND}:" in budget_id else "total"


def _flat(fields: Mapping[str, str]) -> list[str]:
    return [str(len(fields)), *(x for kv in fields.items() for x in kv)]


def sections(org: Organisation, now_ms: int) -> list[str]:
    """An organisation of a checked body as lua/restore_tag.lua's sections, in its 'restore'
    mode: definitions, users, open reservations, counters, then the meta hash."""
    out = [str(len(org.budgets))]
    for b in org.budgets:
        out += [b.budget_id.path, *_flat(definition_fields(b))]
    out.append(str(len(org.users)))
    for budget_id, members in org.users:
        out += [budget_id, str(len(members)), *members]
    out.append(str(len(org.reservations)))
    for r in org.reservations:
        if r.resolved_ms is not None:  # charged by its expiry: in the counters already
            out += [r.reservation_id, _charged(r.record, r.resolved_ms), "0", "0", "0"]
            continue
        record = r.record
        legs = [item.split(wire.PART_SEPARATOR)[:2] for item in record.legs.split()]
        out += [r.reservation_id, _charged(record, now_ms), record.reserved_micros,
                str(unknown_effects(int(record.reserved_micros))[1]), str(len(legs))]
        for budget_id, window in legs:
            out += [f"{budget_id}|{window}", _counter_kind(budget_id, window)]
    out.append(str(len(org.counters)))
    for c in org.counters:
        fields = {"committed": str(c.get("committed_micros", 0)),
                  "overshoot": str(c.get("overshoot_micros", 0))}
        fields.update({f"{_ALERTED}{p}": "1" for p in c.get("thresholds_alerted_pct", [])})
        if c.get("exceeded_alerted"):
            fields[_ALERTED + _EXCEEDED] = "1"
        if c.get("last_write_ms") is not None:
            fields[_SEEN] = str(c["last_write_ms"])
        out += [f"{c['budget_id']}|{c['window']}", _counter_kind(c["budget_id"], c["window"]),
                "", *_flat(fields)]
    # The tag's list of velocity alarms, read by every settle (lua/put_budget.lua writes it).
    alarms = "".join(_VELOCITY_ENTRY.format(b.budget_id.path, b.alerts.velocity.ledger_form)
                     for b in org.budgets if b.alerts.velocity is not None)
    meta = {"seq": str(org.reserve_sequence)} if org.reserve_sequence else {}
    if alarms:
        meta[keys.VELOCITY_FIELD] = alarms
    return out + [x for kv in meta.items() for x in kv]


def key_record(key: Key) -> dict[str, str]:
    """A checked key as the fields of its record (lua/key_put.lua takes them as strings)."""
    def text(value: int | None) -> str:
        return "" if value is None else str(value)
    return {"key_id": key.key_id, "budget_id": key.budget_id, "roles": ",".join(key.roles),
            "key_hash": key.key_hash, "previous_key_hash": key.previous_key_hash or "",
            "grace_ends_at_ms": text(key.previous_secret_valid_until_ms),
            "run_ceiling_micros": text(key.run_ceiling_micros),
            "created_ms": text(key.created_ms), "last_used_ms": text(key.last_used_ms),
            "rotated_at_ms": text(key.rotated_at_ms)}
