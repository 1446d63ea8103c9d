"""The stub provider's own price table, and its own arithmetic for what a call costs.

The stub is the witness every gateway test is judged by, so it must not share its prices with
the service it judges: it imports nothing from `core` nor genai-prices. Its default table
(infra/stub_prices.json) holds OpenAI's published rates for the models the demo and tests use;
a caller passes a table of its own (a file path or a dict in the same format) for test models,
merged over the defaults model by model.

Table format, per model (rates are US dollars per million tokens as decimal strings, which is
exactly micro-dollars per token):
    input_usd_per_mtok, output_usd_per_mtok                 required
    cached_input_usd_per_mtok                               prompt-cache reads (else the input rate)
    cache_write_usd_per_mtok                                prompt-cache writes; a model with this
                                                            rate reports the tokens it wrote
    audio_input_usd_per_mtok, audio_output_usd_per_mtok     a model without them refuses audio
    audio_input_tokens_per_s                                audio input tokens per second of audio
    request_usd                                             a fee per request, in US dollars
    service_tiers: {"priority": {...the rates above...}}    a tier absent here is refused
    reasoning: true                                         part of its output is reasoning tokens
    image: {"rule": "tile", "base_tokens": N, "tile_tokens": N}
         | {"rule": "patch", "multiplier": "1.62"}          a model without it refuses images

A call's cost is the exact sum of its parts, rounded up once to whole micro-dollars.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from infra.stub_bill import MICROS_PER_USD, Usage

DEFAULT_TABLE_PATH = Path(__file__).with_name("stub_prices.json")
# What OpenAI answers in `service_tier` for a call served at standard rates.
TIER_STANDARD = "default"
# OpenAI's patch rule caps an image at this many 32 px patches, scaling it down to fit
# (https://developers.openai.com/api/docs/guides/images-vision, "calculating costs").
PATCHES_MAX = 1_536
# Chat audio models do not document their audio token rate; the Realtime API's is 1 token per
# 100 ms of user audio (https://developers.openai.com/api/docs/guides/realtime-costs).
AUDIO_INPUT_TOKENS_PER_S_DEFAULT = 10

RATE_FIELDS = ("input_usd_per_mtok", "output_usd_per_mtok", "cached_input_usd_per_mtok",
               "cache_write_usd_per_mtok", "audio_input_usd_per_mtok",
               "audio_output_usd_per_mtok")
MODEL_FIELDS = frozenset({*RATE_FIELDS, "request_usd", "service_tiers", "reasoning", "image",
                          "audio_input_tokens_per_s"})


@dataclass(frozen=True)
class TierRates:
    """Micro-dollars per token of one service tier; None where the model does not serve it."""

    input: Fraction
    output: Fraction
    cached_input: Fraction
    cache_write: Fraction | None
    audio_input: Fraction | None
    audio_output: Fraction | None


@dataclass(frozen=True)
class TileRule:
    """OpenAI's tile rule: low detail costs the base; high detail the base plus each 512 px tile
    of the image scaled to fit 2048 x 2048 and then to a shortest side of 768 px."""

    base_tokens: int
    tile_tokens: int


@dataclass(frozen=True)
class PatchRule:
    """OpenAI's patch rule: 32 px patches, at most PATCHES_MAX, times the model's multiplier."""

    multiplier: Fraction
    patches_max: int = PATCHES_MAX


@dataclass(frozen=True)
class ModelPrices:
    name: str
    standard: TierRates
    tiers: Mapping[str, TierRates]
    request_micros: Fraction
    reasoning: bool
    image: TileRule | PatchRule | None
    audio_input_tokens_per_s: int

    def rates(self, tier: str) -> TierRates:
        return self.standard if tier == TIER_STANDARD else self.tiers[tier]


class StubPrices:
    """Model prices by name (case-insensitive); a model not in the table is not served."""

    def __init__(self, models: Mapping[str, ModelPrices]) -> None:
        self._models = {name.lower(): prices for name, prices in models.items()}

    @classmethod
    def load(cls, table: str | Path | Mapping[str, Any] | None = None) -> StubPrices:
        """The default table, under `table` (a JSON file's path or the parsed document)."""
        models = _models_from_json(json.loads(DEFAULT_TABLE_PATH.read_text()))
        if table is not None:
            doc = table if isinstance(table, Mapping) else json.loads(Path(table).read_text())
            models |= _models_from_json(doc)
        return cls(models)

    def model(self, name: str) -> ModelPrices | None:
        return self._models.get(name.lower())


def cost_micros(prices: ModelPrices, tier: str, usage: Usage) -> int:
    """What a call with `usage` costs at `tier`, rounded up once to whole micro-dollars."""
    rates = prices.rates(tier)
    write_rate = rates.input if rates.cache_write is None else rates.cache_write
    exact = (usage.text_input_tokens * rates.input
             + usage.cached_input_tokens * rates.cached_input
             + usage.cache_write_tokens * write_rate
             + usage.text_output_tokens * rates.output
             + prices.request_micros)
    for tokens, rate, what in ((usage.audio_input_tokens, rates.audio_input, "audio input"),
                               (usage.audio_output_tokens, rates.audio_output, "audio output")):
        if tokens:
            if rate is None:  # the counting refuses audio for such a model before it is served
                raise ValueError(f"{prices.name} has no {what} rate")
            exact += tokens * rate
    return math.ceil(exact)


def _rate(name: str, key: str, value: object) -> Fraction:
    if not isinstance(value, str):
        raise ValueError(f"{name}.{key} must be a decimal string")
    try:
        rate = Fraction(value)
    except (ValueError, ZeroDivisionError) as exc:
        raise ValueError(f"{name}.{key} is not a decimal: {value!r}") from exc
    if rate < 0:
        raise ValueError(f"{name}.{key} must not be negative")
    return rate


def _tier(name: str, entry: object) -> TierRates:
    if not isinstance(entry, Mapping):
        raise ValueError(f"{name} must be an object of rates")
    unknown = set(entry) - set(RATE_FIELDS)
    if unknown:
        raise ValueError(f"{name}: unknown rate fields {sorted(unknown)}")
    for required in ("input_usd_per_mtok", "output_usd_per_mtok"):
        if required not in entry:
            raise ValueError(f"{name}.{required} is required")

    def optional(key: str) -> Fraction | None:
        return _rate(name, key, entry[key]) if key in entry else None

    input_rate = _rate(name, "input_usd_per_mtok", entry["input_usd_per_mtok"])
    cached_rate = optional("cached_input_usd_per_mtok")
    return TierRates(
        input=input_rate,
        output=_rate(name, "output_usd_per_mtok", entry["output_usd_per_mtok"]),
        cached_input=input_rate if cached_rate is None else cached_rate,
        cache_write=optional("cache_write_usd_per_mtok"),
        audio_input=optional("audio_input_usd_per_mtok"),
        audio_output=optional("audio_output_usd_per_mtok"),
    )


def _image_rule(name: str, doc: object) -> TileRule | PatchRule | None:
    if doc is None:
        return None
    if not isinstance(doc, Mapping):
        raise ValueError(f"{name}.image must be an object")
    if doc.get("rule") == "tile" and set(doc) == {"rule", "base_tokens", "tile_tokens"}:
        base, tile = doc["base_tokens"], doc["tile_tokens"]
        if type(base) is int and type(tile) is int and base > 0 and tile > 0:
            return TileRule(base, tile)
    if doc.get("rule") == "patch" and set(doc) <= {"rule", "multiplier", "patches_max"}:
        patches_max = doc.get("patches_max", PATCHES_MAX)
        if type(patches_max) is int and patches_max > 0:
            return PatchRule(_rate(name, "image.multiplier", doc.get("multiplier")), patches_max)
    raise ValueError(f"{name}.image must be a tile rule (base_tokens, tile_tokens) or a patch "
                     "rule (multiplier)")


def _model(name: str, entry: object) -> ModelPrices:
    if not isinstance(entry, Mapping):
        raise ValueError(f"{name} must be an object")
    unknown = set(entry) - MODEL_FIELDS
    if unknown:
        raise ValueError(f"{name}: unknown fields {sorted(unknown)}")
    tiers_doc = entry.get("service_tiers", {})
    if not isinstance(tiers_doc, Mapping) or TIER_STANDARD in tiers_doc:
        raise ValueError(f"{name}.service_tiers must be an object of tiers other than default")
    reasoning = entry.get("reasoning", False)
    per_s = entry.get("audio_input_tokens_per_s", AUDIO_INPUT_TOKENS_PER_S_DEFAULT)
    if type(reasoning) is not bool or type(per_s) is not int or per_s < 1:
        raise ValueError(f"{name}: reasoning is a boolean, audio_input_tokens_per_s a positive "
                         "integer")
    return ModelPrices(
        name=name,
        standard=_tier(name, {k: v for k, v in entry.items() if k in RATE_FIELDS}),
        tiers={tier: _tier(f"{name}.service_tiers.{tier}", rates)
               for tier, rates in tiers_doc.items()},
        request_micros=(_rate(name, "request_usd", entry["request_usd"]) * MICROS_PER_USD
                        if "request_usd" in entry else Fraction(0)),
        reasoning=reasoning,
        image=_image_rule(name, entry.get("image")),
        audio_input_tokens_per_s=per_s,
    )


def _models_from_json(doc: object) -> dict[str, ModelPrices]:
    if not isinstance(doc, Mapping) or not isinstance(doc.get("models"), Mapping):
        raise ValueError('a stub price table is {"models": {name: {...}}}')
    return {str(name).lower(): _model(str(name), entry) for name, entry in doc["models"].items()}
