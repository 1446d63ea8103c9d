"""Request bodies of the admin routes, as strict as the hot routes' (api/models.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from api.models import Strict
from core.alerts import THRESHOLDS_PCT_DEFAULT, AlertConfig, VelocityAlarm, multiple_milli
from core.budgets import BudgetDef, BudgetId, Limit, OutagePolicy, Period, PerUser, Rate
from core.limits import USERS_MAX_DEFAULT


class LimitBody(Strict):
    period: Literal["day", "week", "month", "total"]
    ceiling_micros: int

    def limit(self) -> Limit:
        return Limit(Period(self.period), self.ceiling_micros)


class RateBody(Strict):
    """At most requests_per_minute reservations in any 60 s, and concurrent_max open at once."""

    requests_per_minute: int | None = None
    concurrent_max: int | None = None

    def rate(self) -> Rate:
        return Rate(self.requests_per_minute, self.concurrent_max)


class PerUserBody(Strict):
    """Each end user's own limits, as '<budget>/user:<id>'; users_max bounds how many."""

    limits: list[LimitBody]
    users_max: int = USERS_MAX_DEFAULT
    required: bool = False
    rate: RateBody | None = None

    def per_user(self) -> PerUser:
        return PerUser(tuple(x.limit() for x in self.limits), self.users_max, self.required,
                       self.rate.rate() if self.rate else None)


class VelocityBody(Strict):
    """A velocity alarm: spend over window_s above max_micros, or above max_rate_multiple times the
    trailing hourly rate; pause stops the budget until an operator resumes it."""

    window_s: int = 300
    max_micros: int | None = None
    max_rate_multiple: float | None = None
    pause: bool = False

    def alarm(self) -> VelocityAlarm:
        return VelocityAlarm(
            self.window_s, self.max_micros or 0,
            0 if self.max_rate_multiple is None else multiple_milli(self.max_rate_multiple),
            self.pause)


class AlertsBody(Strict):
    # Field(): a pydantic model copies a default per body, which ruff cannot see through Strict.
    thresholds_pct: list[int] = Field(default=list(THRESHOLDS_PCT_DEFAULT))
    velocity: VelocityBody | None = None

    def config(self) -> AlertConfig:
        return AlertConfig(tuple(self.thresholds_pct),
                           self.velocity.alarm() if self.velocity else None)


class BudgetBody(Strict):
    limits: list[LimitBody]
    timezone: str = "UTC"
    outage_allowance_micros: int = 0
    # None: 'allowance' when an allowance is given, else 'closed' (core/budgets.py BudgetDef).
    outage_policy: Literal["closed", "allowance", "open"] | None = None
    alerts: AlertsBody | None = None
    rate: RateBody | None = None
    per_user: PerUserBody | None = None
    clamp: bool = False

    def definition(self, budget_id: str) -> BudgetDef:
        return BudgetDef(
            BudgetId.operator(budget_id),  # an operator names it: no reserved scope kind
            tuple(x.limit() for x in self.limits),
            self.timezone,
            self.outage_allowance_micros,
            None if self.outage_policy is None else OutagePolicy(self.outage_policy),
            self.alerts.config() if self.alerts else AlertConfig(),
            rate=self.rate.rate() if self.rate else None,
            per_user=self.per_user.per_user() if self.per_user else None,
            clamp=self.clamp,
        )


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
    # Only for an id minted before ids named their budget's tag (core/ledger.py tag_digest).
    budget_id: str | None = None
