"""Request bodies of the hot routes (reserve, settle). Strict: a number as a string, a float where
an integer belongs, a boolean for a count, or an unknown field is refused before anything reaches
the ledger. The admin routes' bodies are in api/admin_models.py, imported with those routes."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

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
