"""Request bodies. Strict: a number as a string, a float where an integer belongs, a boolean
for a count, or an unknown field is refused before anything reaches the ledger."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

from core.alerts import THRESHOLDS_PCT_DEFAULT, AlertConfig, VelocityAlarm, multiple_milli
from core.budgets import BudgetDef, BudgetId, Limit, OutagePolicy, Period
from core.errors import InvalidRequest
from core.prices import Usage
from core.service import CallSpec, SettleSpec


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ReserveBody(Strict):
    model: str | None = None
    input_tokens: int | None = None
    messages: list[dict[str, Any]] | None = None
    max_output_tokens: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int = 1
    amount_micros: int | None = None
    ttl_ms: int | None = None

    @model_validator(mode="after")
    def one_output_cap(self) -> ReserveBody:
        caps = {c for c in (self.max_output_tokens, self.max_tokens, self.max_completion_tokens)
                if c is not None}
        if len(caps) > 1:
            raise ValueError("give one output cap (max_output_tokens, max_tokens or "
                             "max_completion_tokens), or equal values")
        return self

    def spec(self) -> CallSpec:
        cap = next((c for c in (self.max_output_tokens, self.max_tokens,
                                self.max_completion_tokens) if c is not None), None)
        return CallSpec(
            model=self.model, input_tokens=self.input_tokens, messages=self.messages,
            output_tokens_max=cap, choices=self.n, amount_micros=self.amount_micros,
            ttl_ms=self.ttl_ms,
        )


class SettleBody(Strict):
    """Token usage as core.prices.Usage counts it (every count but input_tokens and
    output_tokens a part of one of them), or an amount."""

    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_input_tokens: int = 0
    cache_write_tokens: int = 0
    cache_write_1h_tokens: int = 0
    input_audio_tokens: int = 0
    output_audio_tokens: int = 0
    service_tier: str | None = None
    actual_micros: int | None = None

    def spec(self) -> SettleSpec:
        if self.actual_micros is not None:
            if self.input_tokens is not None or self.output_tokens is not None:
                raise InvalidRequest("give either token usage or actual_micros, not both")
            return SettleSpec(actual_micros=self.actual_micros)
        if self.input_tokens is None or self.output_tokens is None:
            raise InvalidRequest("give input_tokens and output_tokens, or actual_micros")
        return SettleSpec(Usage(
            self.input_tokens, self.output_tokens, self.cached_input_tokens,
            self.cache_write_tokens, self.cache_write_1h_tokens, self.input_audio_tokens,
            self.output_audio_tokens, self.service_tier,
        ))


class LimitBody(Strict):
    period: Literal["day", "month", "total"]
    ceiling_micros: int


class VelocityBody(Strict):
    """Issue 16: spend over window_s above max_micros, or above max_rate_multiple times the
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
    thresholds_pct: list[int] = list(THRESHOLDS_PCT_DEFAULT)
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

    def definition(self, budget_id: str) -> BudgetDef:
        return BudgetDef(
            BudgetId.parse(budget_id),
            tuple(Limit(Period(x.period), x.ceiling_micros) for x in self.limits),
            self.timezone,
            self.outage_allowance_micros,
            None if self.outage_policy is None else OutagePolicy(self.outage_policy),
            self.alerts.config() if self.alerts else AlertConfig(),
        )


class KeyBody(Strict):
    budget_id: str
    run_ceiling_micros: int | None = None
    # gateway: the OpenAI-compatible routes; sidecar: reserve / settle / release (CONTRACT.md).
    roles: list[Literal["gateway", "sidecar"]] = ["gateway"]


class RotateBody(Strict):
    """POST /v1/admin/keys/{key_id}/rotate: how long the previous secret keeps working."""

    grace_ms: int | None = None


class CorrectionBody(Strict):
    """An operator's settle of a reservation (POST /v1/admin/reservations/{id}/settle)."""

    actual_micros: int
    reason: str
    # Only for an id minted before ids named their budget's tag (core/ledger.py tag_digest).
    budget_id: str | None = None
