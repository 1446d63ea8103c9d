"""The prices file (CEILING_PRICES_FILE): rates for private models, and overrides of the
bundled ones, read into Rates; a file that is not valid is refused whole.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from core.content import ImageBound, audio_input_tokens_per_s, image_bound, output_tokens_max
from core.errors import InvalidRequest
from core.limits import AMOUNT_MICROS_MAX, MODEL_NAME_LEN_MAX
from core.money import MICROS_PER_USD
from core.prices.rates import (
    SERVICE_TIER_LEN_MAX,
    TIER_AUTO,
    TIER_DEFAULT,
    Rates,
    _search_family,
)

# A prices file's rates above this are typos, not prices; it also keeps Decimal arithmetic far
# from its exponent limits. USD per million tokens, and USD per request.
RATE_USD_PER_MTOK_MAX = Decimal(1_000_000)
REQUEST_USD_MAX = Decimal(AMOUNT_MICROS_MAX) / MICROS_PER_USD
# A prices file's per-image bound above this is a typo: it is 20 full-resolution tilings.
IMAGE_TOKENS_MAX = 1_000_000
# A prices file's audio rate above this is a typo (documented rates are 10 to 32 a second).
AUDIO_TOKENS_PER_S_MAX = 10_000
# A prices file's bound on one web search's results above this is a typo: it is five times the
# largest context window any provider offers for one whole call.
WEB_SEARCH_RESULT_TOKENS_MAX = 5_000_000
# A prices file's searches per call above this is a typo: search models run one, and a deep
# research call a few dozen.
WEB_SEARCHES_PER_CALL_MAX = 1_000
# A prices file's context window above this is a typo: no model reads more than 10M tokens.
CONTEXT_WINDOW_TOKENS_MAX = 10_000_000

# Field of a model (or of one of its service tiers) -> the Rates field it sets.
RATE_FIELDS = {
    "input_usd_per_mtok": "input",
    "output_usd_per_mtok": "output",
    "cached_input_usd_per_mtok": "cached_input",
    "cache_write_usd_per_mtok": "cache_write",
    "cache_write_1h_usd_per_mtok": "cache_write_1h",
    "input_audio_usd_per_mtok": "input_audio",
    "cached_input_audio_usd_per_mtok": "cached_input_audio",
    "output_audio_usd_per_mtok": "output_audio",
}
REQUEST_FIELD = "usd_per_request"
WEB_SEARCH_FIELD = "usd_per_web_search"
SEARCHES_PER_CALL_FIELD = "web_searches_per_call"
SEARCHES_MAX_FIELD = "web_searches_max"
WINDOW_FIELD = "context_window_tokens"
OUTPUT_MAX_FIELD = "output_tokens_max"
TIER_FIELDS = frozenset({*RATE_FIELDS, REQUEST_FIELD, WEB_SEARCH_FIELD})
MODEL_FIELDS = frozenset({*TIER_FIELDS, "service_tiers", "image_input_tokens_max",
                          "audio_input_tokens_per_s", "web_search_result_tokens_max",
                          SEARCHES_PER_CALL_FIELD, SEARCHES_MAX_FIELD, WINDOW_FIELD,
                          OUTPUT_MAX_FIELD})


def load_prices_file(path: str) -> tuple[dict[str, Rates], str]:
    """The models of a prices file and a digest of its bytes; InvalidRequest if it is not
    valid (an unknown field included: a typo must not silently price a model lower)."""
    raw = Path(path).read_bytes()
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or set(doc) != {"models"}:
            raise ValueError('the file must be {"models": {...}}')
        models = doc["models"]
        if not isinstance(models, dict):
            raise ValueError("models must be an object")
        overrides = {}
        for name, entry in models.items():
            if not 0 < len(name) <= MODEL_NAME_LEN_MAX:
                raise ValueError(f"model names are 1 to {MODEL_NAME_LEN_MAX} characters")
            overrides[name] = _rates_from_json(name, entry)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InvalidRequest(f"prices file {path} is not valid: {exc}") from exc
    return overrides, hashlib.sha256(raw).hexdigest()[:12]


def _decimal(name: str, field: str, value: object, limit: Decimal) -> Decimal:
    try:
        d = Decimal(value) if isinstance(value, str) else None
    except InvalidOperation:
        d = None
    if d is None or not d.is_finite() or not 0 <= d <= limit:
        raise ValueError(f"{name}.{field} must be a decimal string from 0 to {limit}")
    return d


def _count(name: str, field: str, value: object, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{name}.{field} must be an integer from {low} to {high}")
    return value


def _rate_values(name: str, entry: Mapping[str, object], allowed: frozenset[str]) -> dict[str, Any]:
    if not isinstance(entry, dict):
        raise ValueError(f"{name} must be an object")
    unknown = set(entry) - allowed
    if unknown:
        raise ValueError(f"{name}: unknown fields {sorted(unknown)}")
    values: dict[str, Any] = {
        attr: ((0, _decimal(name, key, entry[key], RATE_USD_PER_MTOK_MAX)),)
        for key, attr in RATE_FIELDS.items() if key in entry
    }
    if REQUEST_FIELD in entry:
        usd = _decimal(name, REQUEST_FIELD, entry[REQUEST_FIELD], REQUEST_USD_MAX)
        values["request_micros"] = usd * MICROS_PER_USD
    if WEB_SEARCH_FIELD in entry:
        usd = _decimal(name, WEB_SEARCH_FIELD, entry[WEB_SEARCH_FIELD], REQUEST_USD_MAX)
        values["web_search_micros"] = usd * MICROS_PER_USD
    return values


def _rates_from_json(name: str, entry: Any) -> Rates:
    values = _rate_values(name, entry, MODEL_FIELDS)
    if "input" not in values:
        raise ValueError(f"{name}.input_usd_per_mtok is required")
    # A model without an output rate writes nothing (an embedding model): a call with any
    # output cap, or a usage with output, is refused for it (ModelUnpriced), never priced at 0.
    values.setdefault("output", None)
    values.update(_search_family(name))
    if SEARCHES_PER_CALL_FIELD in entry:
        values["web_searches_per_call"] = _count(name, SEARCHES_PER_CALL_FIELD,
                                                 entry[SEARCHES_PER_CALL_FIELD], 0,
                                                 WEB_SEARCHES_PER_CALL_MAX)
    if SEARCHES_MAX_FIELD in entry:
        values["web_searches_max"] = _count(name, SEARCHES_MAX_FIELD, entry[SEARCHES_MAX_FIELD],
                                            1, WEB_SEARCHES_PER_CALL_MAX)
    if WINDOW_FIELD in entry:
        values["context_window_tokens"] = _count(name, WINDOW_FIELD, entry[WINDOW_FIELD], 1,
                                                 CONTEXT_WINDOW_TOKENS_MAX)
    values["output_tokens_max"] = output_tokens_max(name)
    if OUTPUT_MAX_FIELD in entry:
        values["output_tokens_max"] = _count(name, OUTPUT_MAX_FIELD, entry[OUTPUT_MAX_FIELD], 1,
                                             CONTEXT_WINDOW_TOKENS_MAX)
    tiers_doc = entry.get("service_tiers", {})
    if not isinstance(tiers_doc, dict):
        raise ValueError(f"{name}.service_tiers must be an object of tiers")
    tiers = {}
    for tier, tier_entry in tiers_doc.items():
        if tier in (TIER_AUTO, TIER_DEFAULT) or not 0 < len(tier) <= SERVICE_TIER_LEN_MAX:
            raise ValueError(f"{name}.service_tiers: {tier!r} cannot name a tier")
        # A tier's entry changes the rates it names; the others are the model's own.
        tiers[tier] = Rates(**{**values, **_rate_values(f"{name}.service_tiers.{tier}",
                                                        tier_entry, TIER_FIELDS)})
    image = image_bound(name)
    if "image_input_tokens_max" in entry:
        given = entry["image_input_tokens_max"]
        if not isinstance(given, dict) or "high" not in given or set(given) - {"low", "high"}:
            raise ValueError(f'{name}.image_input_tokens_max must be {{"low": N, "high": N}}')
        high = _count(name, "image_input_tokens_max.high", given["high"], 0, IMAGE_TOKENS_MAX)
        low = _count(name, "image_input_tokens_max.low", given.get("low", high), 0,
                     IMAGE_TOKENS_MAX)
        image = ImageBound(low, high)
    audio_per_s = audio_input_tokens_per_s(name)
    if "audio_input_tokens_per_s" in entry:
        audio_per_s = _count(name, "audio_input_tokens_per_s", entry["audio_input_tokens_per_s"],
                             1, AUDIO_TOKENS_PER_S_MAX)
    search_tokens = None
    if "web_search_result_tokens_max" in entry:
        search_tokens = _count(name, "web_search_result_tokens_max",
                               entry["web_search_result_tokens_max"], 1,
                               WEB_SEARCH_RESULT_TOKENS_MAX)
    return Rates(**values, service_tiers=tiers, image_tokens_max=image,
                 audio_input_tokens_per_s=audio_per_s,
                 web_search_result_tokens_max=search_tokens)
