"""Budgets: ids that are paths of scopes, limits per period, and the period windows.

A budget id is a path of scopes, `org:acme/team:search/key:k1`. A call is checked against every
budget on its path that exists (and its run budget), so the path is also the unit of sharding:
the top scope is the Redis hash tag of every key one call touches.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from enum import StrEnum
from functools import cached_property, lru_cache
from types import MappingProxyType
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from core.alerts import AlertConfig
from core.errors import InvalidRequest, InvariantBroken, ensure
from core.limits import (
    BUDGET_ID_LEN_MAX,
    CEILING_MICROS_MAX,
    CONCURRENT_MAX_MAX,
    INT_EXACT_MAX,
    MODEL_NAME_LEN_MAX,
    MODEL_ONE_NAME_LEN_MAX,
    MODELS_ALLOW_MAX,
    PER_MODEL_MAX,
    REQUESTS_PER_MINUTE_MAX,
    SCOPES_MAX,
    USERS_MAX_DEFAULT,
    USERS_MAX_MAX,
)

# ASCII only, and none of the characters the key layout or a hash tag gives meaning to:
# '{' '}' (hash tags), '|' and ' ' (separators inside a reservation), '/' and ':' (the path).
_SCOPE = re.compile(r"[a-z][a-z0-9_-]{0,31}:[A-Za-z0-9._-]{1,64}")
_TZ = re.compile(r"[A-Za-z0-9_+-]+(/[A-Za-z0-9_+-]+)*")
RUN_SCOPE_KIND = "run"
USER_SCOPE_KIND = "user"
MODEL_SCOPE_KIND = "model"
# Scope kinds the ledger names budgets by itself, never an operator. Keyed by kind, the reason,
# which a refusal quotes.
RESERVED_SCOPE_KINDS: Mapping[str, str] = MappingProxyType({
    # A key's run is counted as the budget `<key's budget>/run:<run id>` (BudgetId.run), in the
    # counters an operator's budget of that id would have: the run's calls would move them, and
    # the run's idle expiry (RUN_COUNTER_IDLE_MS) would be put on its lifetime total.
    RUN_SCOPE_KIND: "the ledger counts a key's run as the budget '<key's budget>/run:<run id>',"
                    " so a budget of such an id would share its counters with a run",
    # A budget's end users are counted as '<budget>/user:<user id>' (BudgetId.user).
    USER_SCOPE_KIND: "the ledger counts an end user of a budget with per_user limits as the "
                     "budget '<budget>/user:<user id>', so a budget of such an id would share "
                     "its counters with an end user",
    # A budget's spend on one model of its per_model limits is counted as
    # '<budget>/model:<model>' (BudgetId.model).
    MODEL_SCOPE_KIND: "the ledger counts a budget's calls of one model of its per_model limits "
                      "as the budget '<budget>/model:<model>', so a budget of such an id would "
                      "share its counters with a model",
})
# An end user's id as a call names it (X-Ceiling-User, or the provider's user field): what the
# OpenAI and Anthropic SDKs' user ids are made of (e-mail addresses, UUIDs, hashes), and none of
# the characters the key layout gives meaning to ('/', '|', ' ', '{', '}').
_USER = re.compile(r"[A-Za-z0-9._:@-]{1,128}")
# A model's one name as a budget names it (models.allow, per_model) and the ledger matches it: the
# price table's name for it, lower case (PriceTable.model_name), of none of the characters the
# ledger's fields give meaning to (' ', '|', '{', '}', and the tab of a record). '/' (a name
# such as OpenRouter's 'anthropic/claude-3.5-sonnet') may be allowed, but not limited per model:
# there it would be a scope of the counter's budget id.
# At most MODEL_ONE_NAME_LEN_MAX long; a definition takes a name of up to MODEL_NAME_LEN_MAX (what
# the price table looks up) before canonical_models gives it its one name.
# What a call's model is sent to the ledger as when its one name is not one a budget can name:
# no allow-list holds it, no per_model limit names it.
UNLISTED_MODEL = "?"
# What a status read names for the legs of every model a budget limits (core/ledger.py status).
ALL_MODELS = "*"
_MODEL_ALLOWED = re.compile(rf"[a-z0-9._:@+/-]{{1,{MODEL_ONE_NAME_LEN_MAX}}}")
_MODEL_LIMITED = re.compile(rf"[a-z0-9._:@+-]{{1,{MODEL_ONE_NAME_LEN_MAX}}}")


class Period(StrEnum):
    DAY = "day"
    WEEK = "week"  # ISO: from Monday 00:00 in the budget's time zone
    MONTH = "month"
    TOTAL = "total"


@dataclass(frozen=True, order=True)
class BudgetId:
    path: str

    @classmethod
    def parse(cls, raw: object) -> BudgetId:
        if not isinstance(raw, str) or not raw or len(raw) > BUDGET_ID_LEN_MAX:
            raise InvalidRequest("budget_id must be 1 to 256 characters", field="budget_id")
        scopes = raw.split("/")
        if len(scopes) > SCOPES_MAX or not all(_SCOPE.fullmatch(s) for s in scopes):
            raise InvalidRequest(
                "budget_id must be a path of up to 8 scopes 'kind:name' (kind a-z0-9_-, "
                "name A-Za-z0-9._-), such as 'org:acme/team:search'",
                field="budget_id",
            )
        return cls(raw)

    @classmethod
    def operator(cls, raw: object) -> BudgetId:
        """An id an operator names (a budget put, a key made): parse's rules, and no scope of a
        reserved kind. parse alone stays for ids the ledger made itself and reads back (a run's
        counters in listings, the spend page, an export being restored)."""
        budget_id = cls.parse(raw)
        # Any scope, not only the last: a reserved scope higher up still puts a run's counters on
        # the path. `org:x/run:batch/team:t` has `org:x/run:batch` in its lineage, which a key of
        # org:x spends into under the run id `batch`, so the keys of one would be held and
        # charged in the other's counters.
        for scope in budget_id.path.split("/"):
            kind = scope.split(":", 1)[0]
            if kind in RESERVED_SCOPE_KINDS:
                raise InvalidRequest(
                    f"budget_id scope {scope!r} is of the reserved kind {kind!r}, in any scope "
                    f"of a budget id: {RESERVED_SCOPE_KINDS[kind]}", field="budget_id")
        return budget_id

    # Cached: every call asks a key's budget for both, and the id never changes.
    @cached_property
    def tag(self) -> str:
        """The top scope: the hash tag that keeps one call's keys in one cluster slot."""
        return self.path.split("/", 1)[0]

    @cached_property
    def lineage(self) -> tuple[BudgetId, ...]:
        """This budget and its ancestors, top scope first."""
        scopes = self.path.split("/")
        return tuple(BudgetId("/".join(scopes[: i + 1])) for i in range(len(scopes)))

    def run(self, run_id: str) -> BudgetId:
        """The budget of one agent run made under this budget."""
        return BudgetId.parse(f"{self.path}/{RUN_SCOPE_KIND}:{run_id}")

    def user(self, user_id: str) -> BudgetId:
        """The budget of one end user of this budget (its per_user limits). Not a scope an
        operator can name: a user id may hold ':' and '@', and be longer than a scope's name."""
        return BudgetId(f"{self.path}/{USER_SCOPE_KIND}:{check_user(user_id)}")

    def model(self, model: str) -> BudgetId:
        """The budget of this budget's calls of one model (its per_model limits): like a user's,
        not a scope an operator can name (a model's name may hold ':', '@' and '+')."""
        ensure(_MODEL_LIMITED.fullmatch(model) is not None, f"{model!r} is a model's one name")
        return BudgetId(f"{self.path}/{MODEL_SCOPE_KIND}:{model}")

    def __str__(self) -> str:
        return self.path


def check_user(raw: object) -> str:
    """An end user's id: 1 to 128 of A-Za-z0-9._:@-."""
    if not isinstance(raw, str) or not _USER.fullmatch(raw):
        raise InvalidRequest("the end user id must be 1 to 128 of A-Za-z0-9._:@-", field="user")
    return raw


# What a hashed end user id starts with: a user field's value that is not an id (Claude Code
# sends a JSON string of its ids in metadata.user_id) names its user by a digest of its value.
HASHED_USER_PREFIX = "sha256:"
HASHED_USER_HEX_LEN = 32  # 128 bits: no two values a key sends share a user by chance


def user_of_value(raw: object) -> str:
    """The end user a provider's user field names: the value itself when it is an id
    (check_user), else a digest of its JSON, so that a value of any shape names one user."""
    if isinstance(raw, str) and _USER.fullmatch(raw):
        return raw
    encoded = json.dumps(raw, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(encoded.encode(errors="surrogatepass")).hexdigest()
    return HASHED_USER_PREFIX + digest[:HASHED_USER_HEX_LEN]


@dataclass(frozen=True)
class Limit:
    period: Period
    ceiling_micros: int


@dataclass(frozen=True)
class Rate:
    """How fast and how many at once a budget's calls may go, across every instance: at most
    `requests_per_minute` reservations in any 60 seconds, and `concurrent_max` open at once (a
    reservation is open until it is settled, released or expires). None: no such limit."""

    requests_per_minute: int | None = None
    concurrent_max: int | None = None

    def __post_init__(self) -> None:
        if self.requests_per_minute is None and self.concurrent_max is None:
            raise InvalidRequest("rate needs requests_per_minute, concurrent_max or both",
                                 field="rate")
        if self.requests_per_minute is not None:
            check_micros(self.requests_per_minute, "rate.requests_per_minute",
                         REQUESTS_PER_MINUTE_MAX)
        if self.concurrent_max is not None:
            check_micros(self.concurrent_max, "rate.concurrent_max", CONCURRENT_MAX_MAX)

    def json(self) -> dict[str, int | None]:
        return {"requests_per_minute": self.requests_per_minute,
                "concurrent_max": self.concurrent_max}


@dataclass(frozen=True)
class PerUser:
    """Limits each end user of a budget is held to, as the budget '<budget>/user:<id>', made on
    a user's first call: at most `users_max` users (then users_exhausted), and with `required` a
    call that names no user is refused (user_required). A user's `total` never refills: its
    counter is kept as long as the budget."""

    limits: tuple[Limit, ...]
    users_max: int = USERS_MAX_DEFAULT
    required: bool = False
    rate: Rate | None = None

    def __post_init__(self) -> None:
        check_limits(self.limits, "per_user.limits")
        check_micros(self.users_max, "per_user.users_max", USERS_MAX_MAX)
        if not isinstance(self.required, bool):
            raise InvalidRequest("per_user.required must be true or false",
                                 field="per_user.required")

    def json(self) -> dict[str, object]:
        return {"limits": [{"period": lim.period.value, "ceiling_micros": lim.ceiling_micros}
                           for lim in self.limits],
                "users_max": self.users_max, "required": self.required,
                "rate": self.rate.json() if self.rate else None}


@dataclass(frozen=True)
class ModelLimits:
    """Limits a budget's calls of one model are held to, as the budget '<budget>/model:<model>'
    (BudgetId.model), in the same script as the budget's own: `model` is the priced model's one
    name (PriceTable.model_name), so a dated or aliased name of it, or the name an upstream
    routes it by, is counted here too. Its periods are in the budget's time zone; its `total`
    never refills."""

    model: str
    limits: tuple[Limit, ...]

    def __post_init__(self) -> None:
        if not _given(self.model):
            raise InvalidRequest(f"per_model: a model's name is 1 to {MODEL_NAME_LEN_MAX} "
                                 "characters", field="per_model")
        check_limits(self.limits, f"per_model.{self.model}.limits")

    def json(self) -> dict[str, object]:
        return {"limits": [{"period": lim.period.value, "ceiling_micros": lim.ceiling_micros}
                           for lim in self.limits]}


def check_models_allow(models: tuple[str, ...]) -> None:
    """An allow-list: 1 to MODELS_ALLOW_MAX distinct names."""
    if not models:
        raise InvalidRequest("models.allow must name at least one model: a budget's calls stop "
                             "at a ceiling of 0", field="models.allow")
    if len(models) > MODELS_ALLOW_MAX:
        raise InvalidRequest(f"models.allow names at most {MODELS_ALLOW_MAX} models",
                             field="models.allow")
    for i, model in enumerate(models):
        if not _given(model):
            raise InvalidRequest(f"models.allow[{i}]: a model's name is 1 to "
                                 f"{MODEL_NAME_LEN_MAX} characters", field=f"models.allow[{i}]")


def _given(model: object) -> bool:
    return isinstance(model, str) and 0 < len(model) <= MODEL_NAME_LEN_MAX


def is_model_name(name: str, *, limited: bool) -> bool:
    """Whether `name` is a model's one name as the ledger keeps it: in an allow-list, or (when
    `limited`) in per_model, where it is a scope of its counter's budget id."""
    return (_MODEL_LIMITED if limited else _MODEL_ALLOWED).fullmatch(name) is not None


def check_per_model(per_model: tuple[ModelLimits, ...]) -> None:
    if len(per_model) > PER_MODEL_MAX:
        raise InvalidRequest(f"per_model limits at most {PER_MODEL_MAX} models",
                             field="per_model")
    if len({m.model for m in per_model}) != len(per_model):
        raise InvalidRequest("per_model names a model twice", field="per_model")


def canonical_models(definition: BudgetDef, name_of: Callable[[str], str | None]) -> BudgetDef:
    """`definition` with each model it names (models.allow, per_model) as the priced model's one
    name, `name_of`'s (PriceTable.model_name: None for a name no price table knows, refused
    naming its field): one name, one price, one counter. Two names of one model are one entry
    of an allow-list, and refused in per_model, whose limits they would split."""
    if definition.models_allow is None and not definition.per_model:
        return definition
    allow = None
    if definition.models_allow is not None:
        names: dict[str, None] = {}
        for i, model in enumerate(definition.models_allow):
            names[_known(name_of, model, f"models.allow[{i}]")] = None
        allow = tuple(sorted(names))
    limited: dict[str, ModelLimits] = {}
    for entry in definition.per_model:
        name = _known(name_of, entry.model, f"per_model.{entry.model}")
        if name in limited:
            raise InvalidRequest(
                f"per_model names {name!r} twice ({limited[name].model!r} and {entry.model!r} "
                "are one model): give its limits once", field=f"per_model.{entry.model}")
        limited[name] = ModelLimits(entry.model, entry.limits)
    per_model = tuple(ModelLimits(name, limited[name].limits) for name in sorted(limited))
    return replace(definition, models_allow=allow, per_model=per_model)


def _known(name_of: Callable[[str], str | None], model: str, field: str) -> str:
    name = name_of(model)
    if name is None:
        raise InvalidRequest(
            f"{field}: no price table knows model {model!r}: name it as the price table does "
            "(or price it in the prices file, CEILING_PRICES_FILE)", field=field)
    if not _MODEL_ALLOWED.fullmatch(name) or (
            field.startswith("per_model") and not _MODEL_LIMITED.fullmatch(name)):
        raise InvalidRequest(
            f"{field}: model {model!r} is priced as {name!r}, which a budget cannot name "
            + ("per model ('/' would be a scope of its counter's id)"
               if _MODEL_ALLOWED.fullmatch(name) else "(a-z0-9._:@+/- only)"), field=field)
    return name


def check_limits(limits: tuple[Limit, ...], field: str) -> None:
    if not limits:
        raise InvalidRequest("a budget needs at least one limit", field=field)
    if len({lim.period for lim in limits}) != len(limits):
        raise InvalidRequest("one limit per period", field=field)
    for lim in limits:
        check_micros(lim.ceiling_micros, "ceiling_micros", CEILING_MICROS_MAX, minimum=0)


class OutagePolicy(StrEnum):
    """What an instance does for a budget while the shared ledger is unreachable (core/outage.py).

    closed: refuse (the default). allowance: admit up to outage_allowance_micros per instance.
    open: admit without limit, and journal what was admitted, booked when the ledger returns."""

    CLOSED = "closed"
    ALLOWANCE = "allowance"
    OPEN = "open"


# How an `open` budget's allowance is stored and carried on its legs: an amount no real allowance
# can reach (above CEILING_MICROS_MAX, so never put as one) and still exact in Lua, so the ledger
# scripts, the reservation records and core/outage.py need no field of their own for the policy.
OUTAGE_OPEN_ALLOWANCE_MICROS = INT_EXACT_MAX


def outage_policy_of(ledger_allowance_micros: int) -> tuple[OutagePolicy, int]:
    """The policy and allowance of a budget from the allowance the ledger keeps for it."""
    if ledger_allowance_micros >= OUTAGE_OPEN_ALLOWANCE_MICROS:
        return OutagePolicy.OPEN, 0
    if ledger_allowance_micros > 0:
        return OutagePolicy.ALLOWANCE, ledger_allowance_micros
    return OutagePolicy.CLOSED, 0


@dataclass(frozen=True)
class BudgetDef:
    """`outage_policy` None: `allowance` when an allowance is given (a body that names an
    allowance and no policy means it to be spent in an outage), else `closed`."""

    budget_id: BudgetId
    limits: tuple[Limit, ...]
    timezone: str = "UTC"
    outage_allowance_micros: int = 0
    outage_policy: OutagePolicy | None = None
    # Alerts: what it alerts on; and, as read back, when a velocity alarm paused it (state the
    # ledger keeps beside the definition; a put leaves it as it is).
    alerts: AlertConfig = field(default_factory=AlertConfig)
    paused_at_ms: int | None = None
    rate: Rate | None = None
    per_user: PerUser | None = None
    # Every gateway call under it is sent with the largest output cap that fits the room left,
    # as if it sent X-Ceiling-Clamp: 1 (core/gateway.py hold).
    clamp: bool = False
    # The models its calls may name (the priced model's one name each, sorted; None: any model),
    # and the limits of its calls of some models, by name: core/budgets.py canonical_models
    # gives both their one names before a put.
    models_allow: tuple[str, ...] | None = None
    per_model: tuple[ModelLimits, ...] = ()

    @property
    def policy(self) -> OutagePolicy:
        ensure(self.outage_policy is not None, "__post_init__ sets the policy")
        assert self.outage_policy is not None
        return self.outage_policy

    @property
    def ledger_allowance_micros(self) -> int:
        """The allowance as the ledger keeps it and the outage journal reads it off the legs."""
        if self.policy is OutagePolicy.OPEN:
            return OUTAGE_OPEN_ALLOWANCE_MICROS
        return self.outage_allowance_micros if self.policy is OutagePolicy.ALLOWANCE else 0

    @classmethod
    def from_ledger(cls, budget_id: BudgetId, limits: tuple[Limit, ...], timezone: str,
                    ledger_allowance_micros: int, alerts: AlertConfig | None = None,
                    paused_at_ms: int | None = None, rate: Rate | None = None,
                    per_user: PerUser | None = None, clamp: bool = False,
                    models_allow: tuple[str, ...] | None = None,
                    per_model: tuple[ModelLimits, ...] = ()) -> BudgetDef:
        policy, allowance = outage_policy_of(ledger_allowance_micros)
        return cls(budget_id, limits, timezone, allowance, policy,
                   alerts if alerts is not None else AlertConfig(), paused_at_ms, rate, per_user,
                   clamp, models_allow, per_model)

    def model_limits(self, model: str) -> ModelLimits | None:
        """The per_model limits of `model` (its one name), if it has some."""
        return next((m for m in self.per_model if m.model == model), None)

    def __post_init__(self) -> None:
        if self.outage_policy is None:
            # Given or not, a definition has its policy: equal definitions compare equal.
            object.__setattr__(self, "outage_policy", OutagePolicy.ALLOWANCE
                               if self.outage_allowance_micros else OutagePolicy.CLOSED)
        if not isinstance(self.outage_policy, OutagePolicy):
            raise InvalidRequest("outage_policy must be closed, allowance or open",
                                 field="outage_policy")
        if self.outage_policy is OutagePolicy.ALLOWANCE and not self.outage_allowance_micros:
            raise InvalidRequest("outage_policy 'allowance' needs an outage_allowance_micros "
                                 "above 0", field="outage_allowance_micros")
        if self.outage_policy is OutagePolicy.OPEN and self.outage_allowance_micros:
            raise InvalidRequest("an open budget admits without limit during an outage: give "
                                 "no allowance with it", field="outage_allowance_micros")
        if self.outage_policy is OutagePolicy.CLOSED and self.outage_allowance_micros:
            raise InvalidRequest("a closed budget admits nothing during an outage: give "
                                 "outage_policy 'allowance' with an allowance, or no allowance",
                                 field="outage_allowance_micros")
        check_limits(self.limits, "limits")
        check_micros(
            self.outage_allowance_micros, "outage_allowance_micros", CEILING_MICROS_MAX, minimum=0
        )
        check_timezone(self.timezone)
        if self.models_allow is not None:
            check_models_allow(self.models_allow)
        check_per_model(self.per_model)


def check_micros(value: object, field: str, maximum: int, *, minimum: int = 1) -> int:
    """An integer amount in [minimum, maximum]; bools and floats are refused, not coerced."""
    if type(value) is not int or not minimum <= value <= maximum:
        raise InvalidRequest(
            f"{field} must be an integer from {minimum} to {maximum}", field=field
        )
    return value


def check_timezone(name: str) -> ZoneInfo:
    if not _TZ.fullmatch(name) or len(name) > 64:
        raise InvalidRequest(f"unknown timezone {name!r}", field="timezone")
    try:
        return _zone(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise InvalidRequest(f"unknown timezone {name!r}", field="timezone") from exc


@lru_cache(maxsize=256)
def _zone(name: str) -> ZoneInfo:
    return ZoneInfo(name)


@dataclass(frozen=True)
class Window:
    """One calendar period in one time zone, as UTC milliseconds [start_ms, resets_at_ms): its
    end is when its budget resets, by the name the ledger's legs and the API give it."""

    key: str
    start_ms: int
    resets_at_ms: int

    @property
    def period(self) -> Period:
        return Period(self.key.split(":", 1)[0])


# A dict lookup: Period(name) goes through Enum.__call__, costlier on a path run once per leg.
_PERIODS = {p.value: p for p in Period}


def period_of(window_key: str) -> Period:
    return _PERIODS[window_key.split(":", 1)[0]]


def _ms(dt: datetime) -> int:
    return int(dt.timestamp() * 1000)


def _month_start(year: int, month: int, zone: ZoneInfo) -> datetime:
    year, month = year + (month - 1) // 12, (month - 1) % 12 + 1
    return datetime(year, month, 1, tzinfo=zone)


@lru_cache(maxsize=4096)
def _windows_for_day(tz: str, year: int, month: int, day: int) -> tuple[Window, ...]:
    zone = _zone(tz)
    out: list[Window] = []
    base = datetime(year, month, day)
    for shift in (-1, 0, 1):
        d = base + timedelta(days=shift)
        start = datetime(d.year, d.month, d.day, tzinfo=zone)
        nxt = d + timedelta(days=1)
        end = datetime(nxt.year, nxt.month, nxt.day, tzinfo=zone)
        out.append(Window(f"day:{d:%Y-%m-%d}", _ms(start), _ms(end)))
    monday = base - timedelta(days=base.weekday())
    for shift in (-7, 0, 7):
        d = monday + timedelta(days=shift)
        start = datetime(d.year, d.month, d.day, tzinfo=zone)
        nxt = d + timedelta(days=7)
        end = datetime(nxt.year, nxt.month, nxt.day, tzinfo=zone)
        iso = d.isocalendar()
        out.append(Window(f"week:{iso.year}-W{iso.week:02d}", _ms(start), _ms(end)))
    for shift in (-1, 0, 1):
        start = _month_start(year, month + shift, zone)
        end = _month_start(year, month + shift + 1, zone)
        out.append(Window(f"month:{start:%Y-%m}", _ms(start), _ms(end)))
    return tuple(out)


def windows_around(tz: str, now_ms: int) -> tuple[Window, ...]:
    """Day, week and month windows before, at and after `now_ms` in `tz`.

    The ledger picks the one that holds its own time, so a caller whose clock is off by less
    than a day still names the right window.
    """
    local = datetime.fromtimestamp(now_ms / 1000, tz=_zone(tz))
    return _windows_for_day(tz, local.year, local.month, local.day)


def window_at(tz: str, period: Period, now_ms: int) -> Window | None:
    """The window of `period` holding `now_ms`; None for `total`, which never resets."""
    if period is Period.TOTAL:
        return None
    for w in windows_around(tz, now_ms):
        if w.period is period and w.start_ms <= now_ms < w.resets_at_ms:
            return w
    raise InvariantBroken("windows_around always holds now_ms")
