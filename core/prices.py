"""Model prices: the genai-prices bundled snapshot, under an overrides file for private models.

Rates are US dollars per million tokens, which is exactly micro-dollars per token, so a cost is
an exact Decimal of micro-dollars that is rounded up once, at the end.

genai-prices is imported on the first lookup that the overrides do not answer, not at import
time: importing it costs ~0.4 s, which a serverless cold start should not pay before it can
answer /health. The bundled snapshot is used as shipped; nothing refreshes it in the background.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from functools import cached_property
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

from core.errors import InvalidRequest, ModelUnpriced
from core.limits import AMOUNT_MICROS_MAX, CHOICES_MAX, TOKENS_MAX
from core.money import charge_micros

# Model names are looked up case-insensitively, as genai-prices does.
MODEL_NAME_LEN_MAX = 200
# Rates cached per process; bounded because model names come from callers.
RATES_CACHE_MAX = 4_096


@dataclass(frozen=True)
class Rates:
    """USD per million tokens (= micro-dollars per token) for one model; tier-aware.

    A tiered rate is a list of (input_tokens_from, rate): a call with more input tokens than a
    tier's start pays that tier's rate on all its tokens (the providers' "cliff" model).
    """

    input: tuple[tuple[int, Decimal], ...]
    output: tuple[tuple[int, Decimal], ...] | None
    cached_input: tuple[tuple[int, Decimal], ...] | None

    # The highest tier of each: what a worst case is priced at, asked for on every reserve.
    @cached_property
    def input_max(self) -> Decimal:
        return max(rate for _, rate in self.input)

    @cached_property
    def output_max(self) -> Decimal | None:
        return None if self.output is None else max(rate for _, rate in self.output)

    @staticmethod
    def at(tiers: tuple[tuple[int, Decimal], ...], input_tokens: int) -> Decimal:
        rate = tiers[0][1]
        for start, tier_rate in tiers:
            if input_tokens > start:
                rate = tier_rate
        return rate


@dataclass(frozen=True)
class Usage:
    input_tokens: int
    output_tokens: int
    cached_input_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("input_tokens", "output_tokens", "cached_input_tokens"):
            check_tokens(getattr(self, name), name, minimum=0)
        if self.cached_input_tokens > self.input_tokens:
            raise InvalidRequest(
                "cached_input_tokens cannot exceed input_tokens", field="cached_input_tokens"
            )


def check_tokens(value: object, field: str, *, minimum: int) -> int:
    if type(value) is not int or not minimum <= value <= TOKENS_MAX:
        raise InvalidRequest(
            f"{field} must be an integer from {minimum} to {TOKENS_MAX}", field=field
        )
    return value


class PriceTable:
    """Prices for models by name. An unpriced model raises ModelUnpriced; it is never free."""

    def __init__(self, overrides: Mapping[str, Rates] | None = None, overrides_digest: str = ""):
        self._overrides = {k.lower(): v for k, v in (overrides or {}).items()}
        self._cache: dict[str, Rates] = {}
        suffix = f"+overrides.{overrides_digest}" if overrides_digest else ""
        self.version = f"genai-prices-{package_version('genai-prices')}{suffix}"

    @classmethod
    def from_file(cls, path: str | None) -> PriceTable:
        """The bundled table, under the overrides in `path` (CEILING_PRICES_FILE) if given."""
        if not path:
            return cls()
        raw = Path(path).read_bytes()
        try:
            doc = json.loads(raw)
            models = doc["models"]
            overrides = {name: _rates_from_json(name, entry) for name, entry in models.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InvalidRequest(f"prices file {path} is not valid: {exc}") from exc
        return cls(overrides, hashlib.sha256(raw).hexdigest()[:12])

    def rates(self, model: str) -> Rates:
        if not isinstance(model, str) or not 0 < len(model) <= MODEL_NAME_LEN_MAX:
            raise InvalidRequest("model must be a name of 1 to 200 characters", field="model")
        key = model.lower()
        found = self._overrides.get(key) or self._cache.get(key)
        if found is None:
            found = _bundled_rates(key)
            if len(self._cache) < RATES_CACHE_MAX:
                self._cache[key] = found
        return found

    def worst_case_micros(
        self, model: str, input_tokens: int, output_tokens_max: int, choices: int = 1
    ) -> int:
        """Input at the input rate plus the output cap at the output rate, times choices."""
        check_tokens(input_tokens, "input_tokens", minimum=0)
        check_tokens(output_tokens_max, "max_output_tokens", minimum=1)
        if type(choices) is not int or not 1 <= choices <= CHOICES_MAX:
            raise InvalidRequest(f"n must be an integer from 1 to {CHOICES_MAX}", field="n")
        r = self.rates(model)
        output_max = r.output_max
        if output_max is None:
            raise ModelUnpriced(f"model {model!r} has no output price", model=model)
        # Worst case: the highest tier any of these tokens could reach.
        exact = input_tokens * r.input_max + output_tokens_max * choices * output_max
        return _bounded(charge_micros(exact))

    def cost_micros(self, model: str, usage: Usage) -> int:
        r = self.rates(model)
        if usage.output_tokens and r.output is None:
            raise ModelUnpriced(f"model {model!r} has no output price", model=model)
        uncached = usage.input_tokens - usage.cached_input_tokens
        cached_rate = Rates.at(r.cached_input or r.input, usage.input_tokens)
        exact = uncached * Rates.at(r.input, usage.input_tokens) + (
            usage.cached_input_tokens * cached_rate
        )
        if r.output is not None:
            exact += usage.output_tokens * Rates.at(r.output, usage.input_tokens)
        return _bounded(charge_micros(exact))


def _bounded(micros: int) -> int:
    if micros > AMOUNT_MICROS_MAX:
        raise InvalidRequest(f"cost {micros} micro-dollars is above the per-call limit")
    return micros


def _decimal(name: str, field: str, value: object) -> Decimal:
    try:
        d = Decimal(value) if isinstance(value, str) else None
    except InvalidOperation:
        d = None
    if d is None or not d.is_finite() or d < 0:
        raise ValueError(f"{name}.{field} must be a non-negative decimal string")
    return d


def _rates_from_json(name: str, entry: dict[str, Any]) -> Rates:
    def one(field: str) -> tuple[tuple[int, Decimal], ...] | None:
        if field not in entry:
            return None
        return ((0, _decimal(name, field, entry[field])),)

    known = {"input_usd_per_mtok", "output_usd_per_mtok", "cached_input_usd_per_mtok"}
    unknown = set(entry) - known
    if unknown:
        raise ValueError(f"{name}: unknown fields {sorted(unknown)}")
    input_rate = one("input_usd_per_mtok")
    if input_rate is None:
        raise ValueError(f"{name}.input_usd_per_mtok is required")
    return Rates(input_rate, one("output_usd_per_mtok"), one("cached_input_usd_per_mtok"))


def _tiers(price: object) -> tuple[tuple[int, Decimal], ...] | None:
    if price is None:
        return None
    if isinstance(price, Decimal):
        return ((0, price),)
    base = getattr(price, "base", None)
    tiers = getattr(price, "tiers", None)
    if isinstance(base, Decimal) and isinstance(tiers, list):
        return ((0, base), *((int(t.start), Decimal(t.price)) for t in tiers))
    return None


def _bundled_rates(model: str) -> Rates:
    from genai_prices import data_snapshot  # deferred: see the module docstring

    try:
        _, info = data_snapshot.get_snapshot().find_provider_model(model, None, None, None)
    except LookupError as exc:
        raise ModelUnpriced(f"no price for model {model!r}", model=model) from exc
    prices = info.get_prices(datetime.now(UTC))
    input_rate = _tiers(getattr(prices, "input_mtok", None))
    if input_rate is None:
        raise ModelUnpriced(f"no input price for model {model!r}", model=model)
    return Rates(
        input_rate,
        _tiers(getattr(prices, "output_mtok", None)),
        _tiers(getattr(prices, "cache_read_mtok", None)),
    )
