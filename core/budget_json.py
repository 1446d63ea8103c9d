"""A budget's definition as JSON, both ways: what `PUT /v1/admin/budgets/{id}` takes
(`definition_of_json`) and what `GET` shows (`budget_json`), which is also how a ledger export
carries a budget (core/stores/operations.py). In core so that the store reads a definition the
way the admin API does, without the web layer; api/admin_models.py keeps the HTTP schema.

    {"limits": [{"period": "day", "ceiling_micros": 1000000}], "timezone": "UTC",
     "outage_policy": "allowance", "outage_allowance_micros": 5000,
     "alerts": {"thresholds_pct": [50, 80, 100],
                "velocity": {"window_s": 300, "max_micros": 200000, "max_rate_multiple": 3.5,
                             "pause": false}},
     "rate": {"requests_per_minute": 60, "concurrent_max": 4},
     "per_user": {"limits": [...], "users_max": 100, "required": false, "rate": null},
     "clamp": false,
     "models": {"allow": ["gpt-5", "claude-haiku-4-5"]},
     "per_model": {"gpt-5": {"limits": [{"period": "day", "ceiling_micros": 50000000}]}}}

Model names are taken as given here; the service gives each its one name before a put
(core/budgets.py canonical_models), and GET shows those.

Every field but `limits` is optional; null is the same as left out. What GET shows beside these,
`budget_id` and `paused_at_ms` (the pause a velocity alarm put on it: state, not definition), is
read back only from an export (`kept=True`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core.alerts import THRESHOLDS_PCT_DEFAULT, AlertConfig, VelocityAlarm, multiple_milli
from core.budgets import (
    BudgetDef,
    BudgetId,
    Limit,
    ModelLimits,
    OutagePolicy,
    Period,
    PerUser,
    Rate,
)
from core.errors import InvalidRequest
from core.limits import INT_EXACT_MAX, USERS_MAX_DEFAULT

VELOCITY_WINDOW_S_DEFAULT = 300
_BUDGET_FIELDS = frozenset({"limits", "timezone", "outage_allowance_micros", "outage_policy",
                            "alerts", "rate", "per_user", "clamp", "models", "per_model"})
# What GET shows of a budget beside its definition.
_KEPT_FIELDS = frozenset({"budget_id", "paused_at_ms"})


def budget_json(definition: BudgetDef) -> dict[str, Any]:
    """A budget as GET shows it: `definition_of_json(..., kept=True)` reads it back equal."""
    return {
        "budget_id": definition.budget_id.path,
        "limits": _limits_json(definition.limits),
        "timezone": definition.timezone,
        "outage_policy": definition.policy.value,
        "outage_allowance_micros": definition.outage_allowance_micros,
        "alerts": definition.alerts.json(),
        "paused_at_ms": definition.paused_at_ms,
        "rate": definition.rate.json() if definition.rate else None,
        "per_user": definition.per_user.json() if definition.per_user else None,
        "clamp": definition.clamp,
        "models": None if definition.models_allow is None else {
            "allow": list(definition.models_allow)},
        "per_model": {m.model: m.json() for m in definition.per_model} or None,
    }


def definition_of_json(budget_id: BudgetId, raw: object, *, kept: bool = False) -> BudgetDef:
    """The definition `raw` gives `budget_id` (InvalidRequest naming the field otherwise). With
    `kept`, also what GET shows of it: a `budget_id`, which must be this one, and the pause."""
    body = _object(raw, "budget", _BUDGET_FIELDS | (_KEPT_FIELDS if kept else frozenset()))
    if "budget_id" in body and body["budget_id"] != budget_id.path:
        raise InvalidRequest(f"budget_id is not {budget_id.path}", field="budget_id")
    policy = body.get("outage_policy")
    if policy is not None and policy not in OutagePolicy.__members__.values():
        raise InvalidRequest("outage_policy must be closed, allowance or open",
                             field="outage_policy")
    paused_at_ms = body.get("paused_at_ms")
    if paused_at_ms is not None:
        _integer(paused_at_ms, "paused_at_ms", 0, INT_EXACT_MAX)
    alerts = body.get("alerts")
    return BudgetDef(
        budget_id,
        _limits(body.get("limits"), "limits"),
        _string(body.get("timezone", "UTC"), "timezone"),
        _integer(body.get("outage_allowance_micros", 0), "outage_allowance_micros", 0,
                 INT_EXACT_MAX),
        None if policy is None else OutagePolicy(policy),
        AlertConfig() if alerts is None else _alerts(alerts),
        paused_at_ms,
        _rate(body.get("rate"), "rate"),
        _per_user(body.get("per_user")),
        _boolean(body.get("clamp", False), "clamp"),
        _models_allow(body.get("models")),
        _per_model(body.get("per_model")),
    )


def _limits_json(limits: tuple[Limit, ...]) -> list[dict[str, Any]]:
    return [{"period": x.period.value, "ceiling_micros": x.ceiling_micros} for x in limits]


def _object(raw: object, field: str, allowed: frozenset[str]) -> Mapping[str, Any]:
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{field} must be an object", field=field)
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise InvalidRequest(f"{field} has no field {unknown[0]!r}", field=field)
    # null is what is left out: GET shows an optional setting a budget lacks as null.
    return {k: v for k, v in raw.items() if v is not None}


def _integer(raw: object, field: str, minimum: int, maximum: int) -> int:
    """Ranges are checked where the definition is made (core/budgets.py): this is the type."""
    if type(raw) is not int or not minimum <= raw <= maximum:
        raise InvalidRequest(f"{field} must be an integer", field=field)
    return raw


def _string(raw: object, field: str) -> str:
    if not isinstance(raw, str):
        raise InvalidRequest(f"{field} must be a string", field=field)
    return raw


def _boolean(raw: object, field: str) -> bool:
    if not isinstance(raw, bool):
        raise InvalidRequest(f"{field} must be true or false", field=field)
    return raw


def _limits(raw: object, field: str) -> tuple[Limit, ...]:
    if not isinstance(raw, list):
        raise InvalidRequest(f"{field} must be a list of {{period, ceiling_micros}}", field=field)
    out = []
    for item in raw:
        limit = _object(item, field, frozenset({"period", "ceiling_micros"}))
        if limit.get("period") not in Period.__members__.values():
            raise InvalidRequest("period must be day, week, month or total", field=field)
        out.append(Limit(Period(limit["period"]),
                         _integer(limit.get("ceiling_micros"), "ceiling_micros", -INT_EXACT_MAX,
                                  INT_EXACT_MAX)))
    return tuple(out)


def _rate(raw: object, field: str) -> Rate | None:
    if raw is None:
        return None
    rate = _object(raw, field, frozenset({"requests_per_minute", "concurrent_max"}))
    rpm, concurrent = rate.get("requests_per_minute"), rate.get("concurrent_max")
    return Rate(None if rpm is None else _integer(rpm, f"{field}.requests_per_minute", 0,
                                                  INT_EXACT_MAX),
                None if concurrent is None else _integer(
                    concurrent, f"{field}.concurrent_max", 0, INT_EXACT_MAX))


def _per_user(raw: object) -> PerUser | None:
    if raw is None:
        return None
    per_user = _object(raw, "per_user", frozenset({"limits", "users_max", "required", "rate"}))
    return PerUser(_limits(per_user.get("limits"), "per_user.limits"),
                   _integer(per_user.get("users_max", USERS_MAX_DEFAULT), "per_user.users_max",
                            0, INT_EXACT_MAX),
                   _boolean(per_user.get("required", False), "per_user.required"),
                   _rate(per_user.get("rate"), "per_user.rate"))


def _models_allow(raw: object) -> tuple[str, ...] | None:
    if raw is None:
        return None
    models = _object(raw, "models", frozenset({"allow"}))
    allow = models.get("allow")
    if not isinstance(allow, list):
        raise InvalidRequest("models.allow must be a list of model names", field="models.allow")
    for i, model in enumerate(allow):
        _string(model, f"models.allow[{i}]")
    return tuple(allow)


def _per_model(raw: object) -> tuple[ModelLimits, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise InvalidRequest("per_model must be an object of {model: {limits}}",
                             field="per_model")
    out = []
    for model, entry in raw.items():
        field = f"per_model.{model}"
        limits = _object(entry, field, frozenset({"limits"}))
        out.append(ModelLimits(model, _limits(limits.get("limits"), f"{field}.limits")))
    return tuple(out)


def _alerts(raw: object) -> AlertConfig:
    alerts = _object(raw, "alerts", frozenset({"thresholds_pct", "velocity"}))
    pcts = alerts.get("thresholds_pct", list(THRESHOLDS_PCT_DEFAULT))
    if not isinstance(pcts, list):
        raise InvalidRequest("alerts.thresholds_pct must be a list", field="alerts.thresholds_pct")
    velocity = alerts.get("velocity")
    return AlertConfig(tuple(pcts), None if velocity is None else _velocity(velocity))


def _velocity(raw: object) -> VelocityAlarm:
    field = "alerts.velocity"
    v = _object(raw, field, frozenset({"window_s", "max_micros", "max_rate_multiple", "pause"}))
    multiple = v.get("max_rate_multiple")
    return VelocityAlarm(
        _integer(v.get("window_s", VELOCITY_WINDOW_S_DEFAULT), f"{field}.window_s", 0,
                 INT_EXACT_MAX),
        _integer(v.get("max_micros", 0), f"{field}.max_micros", 0, INT_EXACT_MAX),
        0 if multiple is None else multiple_milli(multiple),
        _boolean(v.get("pause", False), f"{field}.pause"))
