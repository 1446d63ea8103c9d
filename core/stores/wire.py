"""The Lua boundary, named once: what each script takes, what it answers, and what it stores.

Every name here is a Python name, and the scripts use the same ones: the prelude this module
generates (`prelude`, from which core/stores/scripts.py builds every script) hands the scripts
readers and writers for the shapes below, the limits of core/limits.py, the key parts of
core/stores/keys.py and the transition table of core/lifecycle.py, so none of them is written
twice.

What a call costs the server decides the shapes (bench/ledger_cpu.py measures it): every field a
script reads costs it the field's conversion, and Lua reads a field out of a packed string by a
pattern match that costs more per character than the server's own parsing of an argument. So:
- Arguments: a script takes the few values it computes with, each its own argument, named by
  its shape (RESERVE_ARGS, ...); nothing the scripts can know themselves is sent (the limits are
  in the prelude, the period windows only once per zone, not per budget).
- Replies: what the caller reads, in flat arrays read here into named values and nowhere else. A
  reserve answers its legs' status one string per leg (LEG_STATUS_FIELDS); a settle or release
  answers the state, policy and hold it found, from which the caller works out what it booked by
  core/lifecycle.py's table (the script booked by the same table).
- Records: a reservation is one string (RECORD_FIELDS), the fields every step reads first. A
  resolved gateway reservation keeps only those, for RESEND_WINDOW_MS.
- The format of all of it has a version (LEDGER_FORMAT_VERSION), stamped beside the ledger id.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from core.budgets import (
    ALL_MODELS,
    UNLISTED_MODEL,
    Limit,
    ModelLimits,
    Period,
    PerUser,
    Rate,
    Window,
    is_model_name,
)
from core.errors import InvariantBroken, ensure
from core.ledger import (
    ExpirePolicy,
    LegStatus,
    Release,
    Reservation,
    ReservationState,
    ReservationView,
    Settlement,
    Upstream,
)
from core.lifecycle import HOLDINGS, TRANSITIONS, Event, effects
from core.limits import (
    ALERT_RETENTION_MS,
    CONCURRENCY_RETRY_AFTER_S_MIN,
    COUNTER_RETENTION_MS,
    COUNTER_SWEEP_BATCH_MAX,
    DAILY_SPEND_RETENTION_MS,
    DAY_MS,
    IDEMPOTENCY_WINDOW_MS,
    IDEMPOTENT_RECORDS_PER_KEY_MAX,
    INT_EXACT_MAX,
    MODEL_ONE_NAME_LEN_MAX,
    RATE_WINDOW_MS,
    RECLAIM_BATCH_MAX,
    RECLAIM_SAMPLE_DIGITS,
    RECORDS_PER_KEY_PER_WINDOW_MAX,
    RECORDS_QUOTA_WINDOW_MS,
    REPLAY_WINDOW_MS,
    REPLIES_PER_KEY_MAX,
    REPLY_BYTES_PER_KEY_MAX,
    RESEND_WINDOW_MS,
    RUN_COUNTER_IDLE_MS,
    RUNS_PER_KEY_MAX,
    SPEND_BUCKET_MS,
    SPEND_BUCKET_RETENTION_MS,
    STATE_QUOTA_WINDOW_MS,
    UNKNOWN_OUTCOME_RETENTION_MS,
    VELOCITY_SLOTS,
    VELOCITY_TRAILING_HOURS,
)
from core.reconcile import COST_REPORTS
from core.stores import keys

# Between the fields of a record. None of the fields the scripts read can hold it (ids,
# numbers, names of states and policies); the free text a record keeps (a model name, a price
# version, an operator's reason) is escaped (`escaped`), and only Python reads it.
SEPARATOR = "\t"
# Inside a field: between budget ids, legs and zones; and between the parts of one of them
# (budget ids, window keys and zone names never hold either: core/budgets.py).
ITEM_SEPARATOR = " "
PART_SEPARATOR = "|"

# -- the scripts' arguments, each its own ARGV entry -----------------------------------------

# The caller's own clock, for tests that inject one; production sends none (Redis TIME).
NOW = "now_ms"
# `run`: a run's budget id and ceiling, ITEM_SEPARATOR between them, or ''. `record_tail`: the
# record's RECORD_TAIL, packed: a script keeps it as it came, and reads it only on a replay.
# `user`: the call's end user (core/budgets.py check_user), or ''. `model`: the priced model's
# one name (core/prices PriceTable.model_name), which allow-lists and per_model limits name; ''
# for a call priced by its caller (an amount), which names no model; UNLISTED_MODEL for a name
# no budget can name. A status read's `model` is a model whose per_model legs it shows, or
# ALL_MODELS for every model's a budget limits.
RESERVE_ARGS = (
    "ledger_id", "reserved_micros", "ttl_ms", "budget_ids", "run", "zones", "expire_policy",
    "retention_ms", "owner", "record_tail", "user", "model", NOW,
)
BOOK_ARGS = (
    "ledger_id", "admitted_at_ms", "reserved_micros", "actual_micros", "budget_ids", "run",
    "zones", "owner", "record_tail", "user", "model", NOW,
)
STATUS_ARGS = ("ledger_id", "budget_ids", "run", "zones", "user", "model", NOW)
# `upstream`: a gateway call's (core/ledger.py Upstream), whose day it is counted in; else ''.
SETTLE_ARGS = ("owner", "actual_micros", "upstream", NOW)
RELEASE_ARGS = ("owner", NOW)
CORRECT_ARGS = ("actual_micros", "corrected_by", "correction_reason", NOW)
EXPIRE_ARGS = ("ledger_id", "batch_max", NOW)
READ_ARGS = (NOW,)
# `day`: the UTC day as YYYY-MM-DD.
DRIFT_ARGS = ("provider", "day", "ledger_micros", "provider_micros", NOW)
# lua/book_unseen.lua: a budget's path and windows as a status read's, then what a provider's
# cost report shows for `day` (YYYY-MM-DD) beyond what the ledger saw, in micro-dollars.
BOOK_UNSEEN_ARGS = ("ledger_id", "budget_ids", "run", "zones", "user", "provider", "day",
                    "unseen_micros", NOW)
# One time zone's windows that hold the caller's estimate of the ledger's now: a script picks the
# window of each period its budgets limit, and asks again if its own now is outside it.
ZONE_PARTS = (
    "timezone", "day_window_key", "day_start_ms", "day_resets_at_ms", "week_window_key",
    "week_start_ms", "week_resets_at_ms", "month_window_key", "month_start_ms",
    "month_resets_at_ms",
)

# -- what the scripts store --------------------------------------------------------------------

# The version of what this module and the scripts store: the records, definitions, counters and
# keys of a ledger. Stamped beside the ledger id when a ledger is made (keys.LEDGER_FORMAT_KEY);
# an instance enforces only on a ledger of its own version (core/stores/scripted_core.py), since
# its scripts would misread another's records and counters, and `ceiling ledger migrate`
# (core/stores/migrate.py) brings an earlier one to it. Raised only by a change those scripts
# cannot read (a new field with a default is not one), and then with a migration.
LEDGER_FORMAT_VERSION = 2

# One reservation, under keys.RECORD + its id. `legs`: its legs, ITEM_SEPARATOR between them,
# each 'budget_id|window_key|ceiling_micros|resets_at_ms|outage_allowance_micros', then '|run'
# for a run's or a budget's flags (lua/lib.lua parse_legs; resets_at_ms 0 for a total). Every
# step reads the first RECORD_HEAD fields; the free text, which only Python reads, is last.
RECORD_FIELDS = (
    "state", "reserved_micros", "expire_policy", "retention_ms", "owner", "legs",
    "expires_at_ms", "created_ms", "actual_micros", "released_micros", "overshoot_micros",
    "late", "outcome", "resolved_ms", "corrected_by", "corrected_at_ms", "correction_reason",
    "fingerprint", "price_version", "model", "bill",
)
RECORD_HEAD = 8
# `bill`: whose bill the call is on (core/ledger.py Upstream), the day counter every charge of it
# is counted in (lua/lib.lua count_day); last and optional, so a record kept before it had one
# reads with '' (its settle counts on the settle's `upstream`, as it did).
RECORD_TAIL = RECORD_FIELDS[-4:]
# What a reserve writes; what is kept of a gateway call once it is resolved (RESEND_WINDOW_MS):
# all that a resend of its settle or release, or of its reserve, reads.
OPENED_FIELDS = (
    "state", "reserved_micros", "expire_policy", "retention_ms", "owner", "legs",
    "expires_at_ms", "created_ms", "outcome", *RECORD_TAIL,
)
RESOLVED_FIELDS = (
    "state", "reserved_micros", "expire_policy", "retention_ms", "owner", "actual_micros",
    "released_micros", "overshoot_micros", "late", "outcome", "fingerprint",
)
# A budget's definition hash, by Python names, with the ledger id it was put under ('ledger'):
# a reserve refuses a definition of another ledger (`ledger_reset`).
# `rate` and `per_user` as rate_field and per_user_field write them.
DEFINITION_FIELDS = ("ledger", "timezone", "outage_allowance_micros", "ceiling_micros:day",
                     "ceiling_micros:month", "ceiling_micros:total", "paused",
                     "ceiling_micros:week", "rate", "per_user")

CEILING_DEFINITION_FIELDS = {Period.DAY: "ceiling_micros:day", Period.WEEK: "ceiling_micros:week",
                             Period.MONTH: "ceiling_micros:month",
                             Period.TOTAL: "ceiling_micros:total"}
# Alert settings kept in the definition hash, read by get_budget, the thresholds by a settle whose
# spend moved a whole percent, and the velocity alarm's setting by a reserve: core/alerts.py.
VELOCITY_DEFINITION_FIELD = "alert_velocity"
ALERT_DEFINITION_FIELDS = ("alert_thresholds_pct", VELOCITY_DEFINITION_FIELD, "paused_at_ms")
# '1' in a definition whose gateway calls are clamped to the room left (BudgetDef.clamp); read
# by get_budget, on a gateway refusal, never by a script.
CLAMP_DEFINITION_FIELD = "clamp"
# What a reserve reads of each budget's definition: the budget, and whether a velocity alarm
# watches it ('' or none: no), which the reservation's legs carry to its settle (lua/lib.lua
# parse_legs), so that a settle reads the tag's alarms only for a budget that has one.
HOLD_DEFINITION_FIELDS = (*DEFINITION_FIELDS, VELOCITY_DEFINITION_FIELD)
# A budget's models (BudgetDef.models_allow, per_model) as models_allow_field and
# per_model_field write them. Not among the fields every reserve reads: a definition that has
# either says so in its `rate` field (rate_field's MODELS_FLAG), and a reserve reads them then
# only, so that a budget without them costs a call nothing more.
MODEL_DEFINITION_FIELDS = ("models_allow", "per_model")
MODELS_FLAG = "m"
# What follows the ledger id in the `ledger` field of a definition that has models, so that a
# version of spend-ceiling before per-model budgets, which would read past the flag in `rate`
# and enforce neither the allow-list nor the per-model limits (nor the rate), finds another
# ledger's id and refuses the budget's calls (`ledger_reset`): it fails closed, in a fleet in
# the middle of a deploy or after a rollback, rather than letting a disallowed model through.
MODELS_LEDGER_SUFFIX = ITEM_SEPARATOR + MODELS_FLAG

_ESCAPES = {"%": "%25", SEPARATOR: "%09"}


def escaped(text: str) -> str:
    """Free text as a field: no separator, and reversible (`unescaped`)."""
    if "%" in text or SEPARATOR in text:
        return "".join(_ESCAPES.get(c, c) for c in text)
    return text


def unescaped(text: str) -> str:
    return text.replace("%09", SEPARATOR).replace("%25", "%") if "%" in text else text


def arguments(shape: Sequence[str], **fields: str) -> list[str]:
    """One script's ARGV: `fields` in the order of `shape`; now_ms left off when it is ''."""
    if len(fields) != len(shape):  # checked on every call, its message built only on failure
        raise InvariantBroken(f"the arguments {sorted(fields)} are {shape}")
    values = [fields[name] for name in shape]
    return values[:-1] if shape[-1] == NOW and not values[-1] else values


def record_tail(fingerprint: str, price_version: str, model: str, bill: str = "") -> str:
    """RECORD_TAIL packed; without a bill, as a record was packed before it had one."""
    tail = (fingerprint, escaped(price_version), escaped(model), *((bill,) if bill else ()))
    return SEPARATOR.join(tail)


def run_field(budget_id: str, ceiling_micros: int) -> str:
    return f"{budget_id}{ITEM_SEPARATOR}{ceiling_micros}"


# What a definition keeps for a period it does not limit, in per_user_field.
NO_CEILING = "-"
# The periods of per_user_field's ceilings, in its order (lua/lib.lua user_limits).
PER_USER_PERIODS = (Period.DAY, Period.WEEK, Period.MONTH, Period.TOTAL)


def rate_field(rate: Rate | None, models: bool = False) -> str:
    """A rate as a definition keeps it: 'requests_per_minute concurrent_max', 0 for none; then
    ' m' (MODELS_FLAG) for a definition that has MODEL_DEFINITION_FIELDS."""
    flag = ITEM_SEPARATOR + MODELS_FLAG if models else ""
    if rate is None:
        return "0 0" + flag
    return f"{rate.requests_per_minute or 0} {rate.concurrent_max or 0}{flag}"


def rate_of(field: str | None) -> Rate | None:
    rpm, cmax = (int(v) for v in (field or "0 0").split()[:2])
    return Rate(rpm or None, cmax or None) if rpm or cmax else None


def models_allow_field(models: tuple[str, ...] | None) -> str:
    """An allow-list as a definition keeps it: its names with ITEM_SEPARATOR before and after
    each (' a b '), so a reserve finds ' <model> ' in it by one plain search; '' for none."""
    if models is None:
        return ""
    ensure(all(is_model_name(m, limited=False) for m in models), "models given their one names")
    return ITEM_SEPARATOR + ITEM_SEPARATOR.join(models) + ITEM_SEPARATOR


def models_allow_of(field: str | None) -> tuple[str, ...] | None:
    return tuple(field.split()) if field else None


# The periods of per_model_field's ceilings, in its order (lua/lib.lua resolve_legs).
PER_MODEL_PERIODS = (Period.DAY, Period.WEEK, Period.MONTH, Period.TOTAL)


def per_model_field(per_model: tuple[ModelLimits, ...]) -> str:
    """per_model as a definition keeps it: for each model, ITEM_SEPARATOR then
    'model|day|week|month|total', each ceiling NO_CEILING for a period it does not limit, so a
    reserve finds ' <model>|' by one plain search; '' for none."""
    out = []
    for entry in per_model:
        ensure(is_model_name(entry.model, limited=True), "models given their one names")
        ceilings = {lim.period: str(lim.ceiling_micros) for lim in entry.limits}
        out.append(ITEM_SEPARATOR + PART_SEPARATOR.join(
            (entry.model, *(ceilings.get(p, NO_CEILING) for p in PER_MODEL_PERIODS))))
    return "".join(out)


def per_model_of(field: str | None) -> tuple[ModelLimits, ...]:
    out = []
    for item in (field or "").split():
        model, *ceilings = item.split(PART_SEPARATOR)
        out.append(ModelLimits(model, tuple(
            Limit(p, int(c)) for p, c in zip(PER_MODEL_PERIODS, ceilings, strict=True)
            if c != NO_CEILING)))
    return tuple(out)


def per_user_field(per_user: PerUser | None) -> str:
    """per_user as a definition keeps it: 'users_max required(0|1) rate' then the day, week,
    month and total ceilings (NO_CEILING for a period it does not limit); '' for none."""
    if per_user is None:
        return ""
    ceilings = {lim.period: str(lim.ceiling_micros) for lim in per_user.limits}
    return ITEM_SEPARATOR.join((
        str(per_user.users_max), "1" if per_user.required else "0", rate_field(per_user.rate),
        *(ceilings.get(p, NO_CEILING) for p in PER_USER_PERIODS)))


def per_user_of(field: str | None) -> PerUser | None:
    if not field:
        return None
    users_max, required, rpm, cmax, *ceilings = field.split(ITEM_SEPARATOR)
    return PerUser(
        tuple(Limit(p, int(c)) for p, c in zip(PER_USER_PERIODS, ceilings, strict=True)
              if c != NO_CEILING),
        int(users_max), required == "1", rate_of(f"{rpm} {cmax}"))


def zone_entry(timezone: str, day: Window, week: Window, month: Window) -> str:
    return PART_SEPARATOR.join((timezone, *(part for w in (day, week, month) for part in (
        w.key, str(w.start_ms), str(w.resets_at_ms)))))


def items(values: Iterable[str]) -> str:
    return ITEM_SEPARATOR.join(values)


# -- the scripts' replies ----------------------------------------------------------------------


def leg(status: str) -> LegStatus:
    bid, wkey, ceiling, committed, reserved, overshoot, resets, allowance = status.split(
        PART_SEPARATOR)
    # Positional, in LegStatus' field order: every reserve builds one per leg, and keyword
    # arguments cost a third more on this path.
    return LegStatus(bid, wkey, int(ceiling), int(committed), int(reserved), int(overshoot),
                     int(resets) or None, int(allowance))


def legs(statuses: Sequence[Any]) -> tuple[LegStatus, ...]:
    return tuple(leg(str(s)) for s in statuses)


class Refused(NamedTuple):
    """{'exceeded'|'busy', now_ms, the failing leg's status}"""

    kind: str
    now_ms: int
    leg: LegStatus


class Resolved(NamedTuple):
    """{'resolved', state, outcome, reserved_micros, charged_micros}: a repeat of a reserve (or
    a correction) of a reservation that is no longer open."""

    state: ReservationState
    outcome: str
    reserved_micros: int
    charged_micros: int


class WindowRetry(NamedTuple):
    """{'timezone', budget_id, timezone} or {'clock', now_ms}: the caller's windows did not fit
    the ledger's budgets or its time; it asks again with these."""

    kind: str
    budget_id: str
    timezone: str
    now_ms: int


def refused(reply: Sequence[Any]) -> Refused:
    return Refused(str(reply[0]), int(reply[1]), leg(str(reply[2])))


def resolved(reply: Sequence[Any]) -> Resolved:
    return Resolved(ReservationState(reply[1]), str(reply[2]), int(reply[3]), int(reply[4]))


def window_retry(reply: Sequence[Any]) -> WindowRetry | None:
    if reply[0] == "timezone":
        return WindowRetry("timezone", str(reply[1]), str(reply[2]), 0)
    if reply[0] == "clock":
        return WindowRetry("clock", "", "", int(reply[1]))
    return None


def reservation(reservation_id: str, reserved_micros: int, ttl_ms: int,
                reply: Sequence[Any]) -> Reservation:
    """{'ok', now_ms, leg status...}: a new hold of what was asked, from the ledger's now; or
    {'replayed', reserved_micros, expires_at_ms, now_ms, leg status...}: the open reservation
    a replay found."""
    if reply[0] == "ok":
        now_ms = int(reply[1])
        return Reservation(reservation_id, reserved_micros, now_ms + ttl_ms, now_ms, False,
                           legs(reply[2:]))
    return Reservation(reservation_id, int(reply[1]), int(reply[2]), int(reply[3]), True,
                       legs(reply[4:]))


def _found(event: Event, reply: Sequence[Any], actual_micros: int) -> Any:
    """{'ok', state, expire_policy, reserved_micros}: what the step found; what it booked
    follows from the lifecycle's table, by which the script booked it."""
    return effects(event, str(reply[1]), ExpirePolicy(reply[2]), int(reply[3]), actual_micros)


def settlement(reply: Sequence[Any], actual_micros: int, event: Event = Event.SETTLE
               ) -> Settlement:
    """{'ok', ...} (`_found`) or {'replayed', charged_micros, released_micros,
    overshoot_micros, late 0|1}: a settle (or correction) made before, as it was answered."""
    if reply[0] == "replayed":
        return Settlement(int(reply[1]), int(reply[2]), int(reply[3]), int(reply[4]) == 1, True)
    fx = _found(event, reply, actual_micros)
    return Settlement(fx.charged_micros, fx.released_micros, fx.overshoot_micros, fx.late, False)


def release(reply: Sequence[Any]) -> Release:
    """{'ok', ...} (`_found`) or {'replayed', released_micros}."""
    if reply[0] == "replayed":
        return Release(int(reply[1]), True)
    return Release(_found(Event.RELEASE, reply, 0).released_micros, False)


def status(reply: Sequence[Any]) -> tuple[int, tuple[LegStatus, ...]]:
    """{'ok', now_ms, leg status...}"""
    return int(reply[1]), legs(reply[2:])


class StoredRecord(NamedTuple):
    """A reservation's record as read.lua returns it: RECORD_FIELDS. Empty fields are what the
    record no longer keeps (or never had)."""

    state: str
    reserved_micros: str
    expire_policy: str
    retention_ms: str
    owner: str
    legs: str
    expires_at_ms: str
    created_ms: str
    actual_micros: str
    released_micros: str
    overshoot_micros: str
    late: str
    outcome: str
    resolved_ms: str
    corrected_by: str
    corrected_at_ms: str
    correction_reason: str
    fingerprint: str
    price_version: str
    model: str
    bill: str = ""

    def packed(self) -> str:
        """As the scripts pack it (pack_record): an empty `bill` left out with its separator."""
        return SEPARATOR.join(self if self.bill else self[:-1])

    @classmethod
    def unpacked(cls, packed_record: str) -> StoredRecord:
        fields = packed_record.split(SEPARATOR)
        ensure(len(fields) in (len(RECORD_FIELDS), len(RECORD_FIELDS) - 1),
               "a record has every field of RECORD_FIELDS (`bill` may be missing)")
        return cls(*fields)

    def view(self, reservation_id: str, *, full: bool) -> ReservationView:
        """As the protocol reads it: `full` for an operator, with the owner and the correction;
        otherwise as its owner reads it."""
        state = ReservationState(self.state)
        charged = _number(self.actual_micros) if state is ReservationState.SETTLED else None
        common = (reservation_id, state, int(self.reserved_micros),
                  _number(self.expires_at_ms), unescaped(self.model),
                  unescaped(self.price_version), charged, self.outcome)
        if not full:
            return ReservationView(*common)
        corrected = bool(self.corrected_by)
        return ReservationView(
            *common, self.owner, _number(self.created_ms), _number(self.resolved_ms),
            self.corrected_by or None, _number(self.corrected_at_ms),
            int(self.reserved_micros) if corrected else None,
            unescaped(self.correction_reason) if corrected else None,
        )


def _number(text: str) -> int | None:
    return int(text) if text else None


ensure(StoredRecord._fields == RECORD_FIELDS, "StoredRecord is RECORD_FIELDS, in order")

# -- the prelude ---------------------------------------------------------------------------------

ARGUMENT_SHAPES = {
    "reserve_args": RESERVE_ARGS, "book_args": BOOK_ARGS, "status_args": STATUS_ARGS,
    "settle_args": SETTLE_ARGS, "release_args": RELEASE_ARGS, "correct_args": CORRECT_ARGS,
    "expire_args": EXPIRE_ARGS, "read_args": READ_ARGS, "drift_args": DRIFT_ARGS,
    "book_unseen_args": BOOK_UNSEEN_ARGS,
}
CONSTANTS = {
    "INT_MAX": INT_EXACT_MAX,
    "MODEL_ONE_NAME_LEN_MAX": MODEL_ONE_NAME_LEN_MAX,
    "RECLAIM_BATCH_MAX": RECLAIM_BATCH_MAX,
    "RUN_COUNTER_IDLE_MS": RUN_COUNTER_IDLE_MS,
    "COUNTER_RETENTION_MS": COUNTER_RETENTION_MS,
    "COUNTER_SWEEP_BATCH_MAX": COUNTER_SWEEP_BATCH_MAX,
    "RESEND_WINDOW_MS": RESEND_WINDOW_MS,
    "REPLAY_WINDOW_MS": REPLAY_WINDOW_MS,
    "IDEMPOTENCY_WINDOW_MS": IDEMPOTENCY_WINDOW_MS,
    "STATE_QUOTA_WINDOW_MS": STATE_QUOTA_WINDOW_MS,
    "IDEMPOTENT_RECORDS_PER_KEY_MAX": IDEMPOTENT_RECORDS_PER_KEY_MAX,
    "RECORDS_PER_KEY_PER_WINDOW_MAX": RECORDS_PER_KEY_PER_WINDOW_MAX,
    "RECORDS_QUOTA_WINDOW_MS": RECORDS_QUOTA_WINDOW_MS,
    "RUNS_PER_KEY_MAX": RUNS_PER_KEY_MAX,
    "REPLIES_PER_KEY_MAX": REPLIES_PER_KEY_MAX,
    "REPLY_BYTES_PER_KEY_MAX": REPLY_BYTES_PER_KEY_MAX,
    "UNKNOWN_OUTCOME_RETENTION_MS": UNKNOWN_OUTCOME_RETENTION_MS,
    "ALERT_RETENTION_MS": ALERT_RETENTION_MS,
    "SPEND_BUCKET_MS": SPEND_BUCKET_MS,
    "SPEND_BUCKET_RETENTION_MS": SPEND_BUCKET_RETENTION_MS,
    "VELOCITY_SLOTS": VELOCITY_SLOTS,
    "VELOCITY_TRAILING_HOURS": VELOCITY_TRAILING_HOURS,
    "DAILY_SPEND_RETENTION_MS": DAILY_SPEND_RETENTION_MS,
    "DAY_MS": DAY_MS,
    "RATE_WINDOW_MS": RATE_WINDOW_MS,
    "CONCURRENCY_RETRY_AFTER_S_MIN": CONCURRENCY_RETRY_AFTER_S_MIN,
}
KEY_PARTS = {
    "META_KEY": keys.META, "RECORD_KEY": keys.RECORD, "DEFINITION_KEY": keys.DEFINITION,
    "COUNTER_KEY": keys.COUNTER, "QUOTA_KEY": keys.QUOTA,
    "ALERT_KEY": keys.ALERT, "OUTBOX_KEY": keys.OUTBOX, "ALERT_LOG_KEY": keys.ALERT_LOG,
    "SPEND_KEY": keys.SPEND, "VELOCITY_KEY": keys.VELOCITY, "VELOCITY_MARK_KEY": keys.VELOCITY_MARK,
    "VELOCITY_FIELD": keys.VELOCITY_FIELD, "DAILY_SPEND_KEY": keys.DAILY_SPEND,
    "REFUSED_KEY": keys.REFUSED, "DRIFT_MARK_KEY": keys.DRIFT_MARK, "USERS_KEY": keys.USERS,
    "PENDING_USERS_KEY": keys.PENDING_USERS,
    "WINDOWS_KEY": keys.WINDOWS, "RUNS_KEY": keys.RUNS,
    "RATE_KEY": keys.RATE, "CONCURRENCY_KEY": keys.CONCURRENCY,
}

# Sets of names a script checks an argument or a record's field against, as Lua tables
# ({name = true, ...}): the bills a call can be on (core/ledger.py Upstream), and the providers
# whose cost report reconcile reads and books (core/reconcile.py COST_REPORTS).
NAME_SETS = {
    "UPSTREAMS": tuple(Upstream),
    "COST_REPORT_PROVIDERS": tuple(COST_REPORTS),
}


def _lua_set(values: Iterable[str]) -> str:
    return "{" + ", ".join(f"[{_lua_string(v)}] = true" for v in values) + "}"


def _lua_string(text: str) -> str:
    ensure(all(c.isprintable() and c not in "'\\" for c in text), f"{text!r} is a plain name")
    return f"'{text}'"


def _lua_list(values: Iterable[str]) -> str:
    return "{" + ", ".join(_lua_string(v) for v in values) + "}"


def _table(names: Sequence[str], values: Sequence[str]) -> str:
    return "{" + ", ".join(f"{n} = {v}" for n, v in zip(names, values, strict=True)) + "}"


def _argument_reader(name: str, shape: Sequence[str]) -> str:
    """ARGV as a table by the shape's names (one constructor, sized once)."""
    return (f"local function {name}(argv)\n"
            f"  return {_table(shape, [f'argv[{i}]' for i in range(1, len(shape) + 1)])}\n"
            "end")


def _pattern(count: int, separator: str, *, whole: bool = True, last_optional: bool = False
             ) -> str:
    """`last_optional`: a string without the last field (nor its separator) matches too, the
    last field read as ''."""
    sep = "\\t" if separator == SEPARATOR else "%" + separator
    field = f"([^{sep}]*)"
    if last_optional:
        return "^" + sep.join([field] * (count - 1)) + sep + "?" + field + "$"
    return "^" + sep.join([field] * count) + ("$" if whole else sep)


def _values_reader(name: str, fields: Sequence[str]) -> str:
    """A function that reads the first `fields` of a packed record as that many values (nil if
    it is not one): no table is built."""
    return (f"local function {name}(s)\n"
            f"  return string.match(s, '{_pattern(len(fields), SEPARATOR, whole=False)}')\n"
            "end")


def _reader(name: str, fields: Sequence[str], separator: str = SEPARATOR, *,
            whole: bool = True, last_optional: bool = False) -> str:
    """A function that reads the fields of a packed string (all of them, or the first ones when
    not `whole`) into a table by their names, in one match and one constructor (a table filled
    key by key grows five times over); nil for a string of another shape."""
    names = ", ".join(fields)
    return (
        f"local function {name}(s)\n"
        f"  local {names} = string.match(s, "
        f"'{_pattern(len(fields), separator, whole=whole, last_optional=last_optional)}')\n"
        f"  if {fields[0]} == nil then\n    return nil\n  end\n"
        f"  return {_table(fields, fields)}\n"
        "end"
    )


def _writer(name: str, fields: Sequence[str], *, last_optional: bool = False) -> str:
    """A function that packs a table keyed by `fields` (strings; a missing one is empty);
    `last_optional`: an empty last field is left out with its separator (_pattern's)."""
    head = fields[:-1] if last_optional else fields
    parts = " .. '\\t' .. ".join(f"(t.{f} or '')" for f in head)
    if last_optional:
        last = fields[-1]
        parts += f" .. ((t.{last} or '') ~= '' and '\\t' .. t.{last} or '')"
    return f"local function {name}(t)\n  return {parts}\nend"


def _positional_writer(name: str, given: Sequence[str]) -> str:
    """A function that packs a record from the fields `given`, its parameters in RECORD_FIELDS'
    order under their names (RECORD_TAIL as one, `record_tail`, where all of it is given); the
    others are empty. One concatenation: no table is built."""
    ensure(list(given) == [f for f in RECORD_FIELDS if f in given], "given in record order")
    packed_tail = set(RECORD_TAIL) <= set(given)
    fields = [f for f in RECORD_FIELDS if not (packed_tail and f in RECORD_TAIL)]
    fields += ["record_tail"] if packed_tail else []
    if fields[-1] == RECORD_FIELDS[-1] not in given:
        fields.pop()  # the optional last field (`bill`), left out with its separator
    pieces: list[str] = []  # the names, and the separators between them as one literal each
    literal = ""
    for i, field in enumerate(fields):
        literal += "\\t" if i else ""
        if field in given or field == "record_tail":
            pieces += [f"'{literal}'", field] if literal else [field]
            literal = ""
    pieces += [f"'{literal}'"] if literal else []
    params = [f for f in fields if f in given or f == "record_tail"]
    return f"local function {name}({', '.join(params)})\n  return {' .. '.join(pieces)}\nend"


def _definition_reader(name: str, fields: Sequence[str]) -> str:
    """A budget's definition read under `fields`, as that many values (no table is built)."""
    return (f"local function {name}(key)\n"
            f"  local d = redis.call('HMGET', key, {', '.join(map(_lua_string, fields))})\n"
            f"  return {', '.join(f'd[{i}]' for i in range(1, len(fields) + 1))}\n"
            "end")


def _amount(share: str) -> str:
    return {"held": "held", "actual": "actual"}.get(share, "0")


def _minus(x: str, y: str) -> str:
    if y == "0":
        return x
    if x == y:
        return "0"
    return f"-{y}" if x == "0" else f"{x} - {y}"


def _above(x: str, y: str) -> str:
    """max(0, x - y) for amounts that are never negative."""
    if y == "0" or x == y or x == "0":
        return x if y == "0" else "0"
    return f"({x} > {y} and {x} - {y} or 0)"


def _effects() -> list[str]:
    """core/lifecycle.py effects, compiled: for each event, a function with a branch per row
    of TRANSITIONS, its amounts worked out from HOLDINGS, so a step costs a script a few
    comparisons and a little arithmetic (no table, no call per share); and `effects`, which
    picks the event's. Each returns to, outcome, and the deltas of reserved and committed, the
    overshoot, the released and the charged amounts, and whether the step is late; nothing
    where the table has no row."""
    out, events = [], []
    for event in Event:
        rows = [(key, row) for key, row in TRANSITIONS.items() if key[0] == event]
        name = f"{event}_effects"
        events.append((event, name))
        code = [f"local function {name}(state, policy, held, actual)"]
        for (_, state, policy), row in rows:
            before, after = HOLDINGS[(state, policy)], HOLDINGS[(row.to, policy)]
            charged, covered = _amount(after.committed), _amount(before.covered)
            values = [
                _lua_string(row.to), _lua_string(row.outcome),
                _minus(_amount(after.reserved), _amount(before.reserved)),
                _minus(charged, _amount(before.committed)),
                _above(charged, covered), _above(covered, charged), charged,
                "true" if state == ReservationState.EXPIRED or event is Event.BOOK else "false",
            ]
            code.append(f"  if state == {_lua_string(state)} and policy == {_lua_string(policy)}"
                        f" then\n    return {', '.join(values)}\n  end")
        code.append("  return nil\nend")
        out.append("\n".join(code))
    dispatch = ["local function effects(event, state, policy, held, actual)"]
    for event, name in events:
        dispatch.append(f"  if event == {_lua_string(event)} then\n"
                        f"    return {name}(state, policy, held, actual)\n  end")
    dispatch.append("  return nil\nend")
    out.append("\n".join(dispatch))
    return out


def _committed() -> str:
    """core/lifecycle.py charged_micros, compiled: what a reservation in a state counts as
    spent."""
    out = ["local function committed_of(state, policy, held, actual)"]
    for (state, policy), holding in HOLDINGS.items():
        out.append(f"  if state == {_lua_string(state)} and policy == {_lua_string(policy)} "
                   f"then\n    return {_amount(holding.committed)}\n  end")
    out.append("  return 0\nend")
    return "\n".join(out)


def prelude() -> list[str]:
    """Lua that defines, for the scripts, the names this module, core/limits.py,
    core/stores/keys.py and core/lifecycle.py give, one top-level statement each: a script is
    built from the statements it uses (core/stores/scripts.py)."""
    out = [f"local {name} = {value}" for name, value in CONSTANTS.items()]
    # Compared with a record's field as it is stored: a gateway call's retention.
    out.append(f"local RESEND_WINDOW_MS_TEXT = '{RESEND_WINDOW_MS}'")
    out.append(f"local RECLAIM_SAMPLE_DIGITS = {_lua_string(RECLAIM_SAMPLE_DIGITS)}")
    out.append(f"local MODELS_FLAG = {_lua_string(MODELS_FLAG)}")
    out.append(f"local MODELS_LEDGER_SUFFIX = {_lua_string(MODELS_LEDGER_SUFFIX)}")
    out.append(f"local UNLISTED_MODEL = {_lua_string(UNLISTED_MODEL)}")
    out.append(f"local ALL_MODELS = {_lua_string(ALL_MODELS)}")
    out.append(f"local MODEL_DEFINITION_FIELDS = {_lua_list(MODEL_DEFINITION_FIELDS)}")
    out += [f"local {name} = {_lua_string(part)}" for name, part in KEY_PARTS.items()]
    out += [_argument_reader(name, shape) for name, shape in ARGUMENT_SHAPES.items()]
    out.append(_reader("unpack_record", RECORD_FIELDS, last_optional=True))
    out.append(_values_reader("record_head", RECORD_FIELDS[:RECORD_HEAD]))
    out.append(_writer("pack_record", RECORD_FIELDS, last_optional=True))
    out.append(_positional_writer("pack_opened", OPENED_FIELDS))
    out.append(_positional_writer("pack_resolved", RESOLVED_FIELDS))
    out.append(f"local RECORD_FIELDS = {_lua_list(RECORD_FIELDS)}")
    out.append(_reader("unpack_zone", ZONE_PARTS, PART_SEPARATOR))
    out.append(_definition_reader("read_definition", HOLD_DEFINITION_FIELDS))
    out.append(f"local DEFINITION_FIELDS = {_lua_list(DEFINITION_FIELDS)}")
    out += _effects()
    out.append(_committed())
    out += [f"local {name} = {_lua_set(values)}" for name, values in NAME_SETS.items()]
    return out
