"""Request bodies of the admin routes, as strict as the hot routes' (api/models.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from api.models import Strict
from core.alerts import THRESHOLDS_PCT_DEFAULT
from core.budget_json import VELOCITY_WINDOW_S_DEFAULT, definition_of_json
from core.budgets import BudgetDef, BudgetId
from core.limits import USERS_MAX_DEFAULT


class LimitBody(Strict):
    period: Literal["day", "week", "month", "total"]
    ceiling_micros: int


class RateBody(Strict):
    """At most requests_per_minute reservations in any 60 s, and concurrent_max open at once."""

    requests_per_minute: int | None = None
    concurrent_max: int | None = None


class PerUserBody(Strict):
    """Each end user's own limits, as '<budget>/user:<id>'; users_max bounds how many."""

    limits: list[LimitBody]
    users_max: int = USERS_MAX_DEFAULT
    required: bool = False
    rate: RateBody | None = None


class ModelsBody(Strict):
    """The models a budget's calls may name; any other is refused (model_not_allowed)."""

    allow: list[str]


class ModelLimitsBody(Strict):
    """One model's own limits under a budget, as '<budget>/model:<model>'."""

    limits: list[LimitBody]


class VelocityBody(Strict):
    """A velocity alarm: spend over window_s above max_micros, or above max_rate_multiple times the
    trailing hourly rate; pause stops the budget until an operator resumes it."""

    window_s: int = VELOCITY_WINDOW_S_DEFAULT
    max_micros: int | None = None
    max_rate_multiple: float | None = None
    pause: bool = False


class AlertsBody(Strict):
    # Field(): a pydantic model copies a default per body, which ruff cannot see through Strict.
    thresholds_pct: list[int] = Field(default=list(THRESHOLDS_PCT_DEFAULT))
    velocity: VelocityBody | None = None


class BudgetBody(Strict):
    """The schema of PUT /v1/admin/budgets/{id}; what it means is core/budget_json.py's, which
    reads the body as it came (the fields given, not this schema's defaults)."""

    limits: list[LimitBody]
    timezone: str = "UTC"
    outage_allowance_micros: int = 0
    # None: 'allowance' when an allowance is given, else 'closed' (core/budgets.py BudgetDef).
    outage_policy: Literal["closed", "allowance", "open"] | None = None
    alerts: AlertsBody | None = None
    rate: RateBody | None = None
    per_user: PerUserBody | None = None
    clamp: bool = False
    models: ModelsBody | None = None
    per_model: dict[str, ModelLimitsBody] | None = None

    def definition(self, budget_id: str) -> BudgetDef:
        # An operator names it: no reserved scope kind.
        return definition_of_json(BudgetId.operator(budget_id),
                                  self.model_dump(exclude_unset=True))


class KeyBody(Strict):
    budget_id: str
    run_ceiling_micros: int | None = None
    # gateway: the OpenAI-compatible routes; sidecar: reserve / settle / release.
    roles: list[Literal["gateway", "sidecar"]] = Field(default=["gateway"])


class RotateBody(Strict):
    """POST /v1/admin/keys/{key_id}/rotate: how long the previous secret keeps working."""

    grace_ms: int | None = None


class CorrectionBody(Strict):
    """An operator's settle of a reservation (POST /v1/admin/reservations/{id}/settle)."""

    actual_micros: int
    reason: str
