"""The bundled table: rates from genai-prices' snapshot, resolved per window of
BUNDLED_WINDOW_S (core/prices/table.py says how they stay fresh).

genai-prices is imported on the first lookup that the overrides do not answer, not at import
time: its import is a large share of a cold start (bench/http.py prints the import tree), which
a serverless instance should not pay before it can answer /health.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from core.content import audio_input_tokens_per_s, image_bound, output_tokens_max
from core.errors import ModelUnbounded, ModelUnpriced
from core.limits import RESERVATION_TTL_MS_MAX
from core.money import MICROS_PER_USD
from core.prices.rates import (
    TIER_AUTO,
    TIER_DEFAULT,
    ZERO,
    Rates,
    Tiers,
    _search_family,
    max_tiers,
)

# Bundled rates are resolved once per window this long. Dated prices start on UTC days, so an
# hour keeps them current without a genai-prices lookup per call.
BUNDLED_WINDOW_S = 3_600
# What may follow a model family's name in the name of one of its dated snapshots: nothing, or
# a date as providers write them (`-20251001`, `-2024-08-06`).
_SNAPSHOT_SUFFIX = re.compile(r"(-\d{8}|-\d{4}-\d{2}-\d{2})?")

# Google's names for the versions of one Gemini model (https://ai.google.dev/gemini-api/docs/
# models#model-versions; Vertex AI's https://cloud.google.com/vertex-ai/generative-ai/docs/learn/
# model-versioning): the model's name alone (its latest stable version), a stable version by its
# three digits (`-001`), `-latest`, a dated preview (`-preview-06-05`, `-preview-09-2025`) and an
# experiment (`-exp`, `-exp-03-25`, `-exp-1206`). A model named as a preview
# (gemini-3-pro-preview) takes its date directly (gemini-3-pro-preview-11-2025). Nothing else
# makes a name a version of another: gemini-2.5-flash-image-preview is a model of its own.
_GEMINI_VERSION = re.compile(
    r"(-\d{3}|-latest|-preview-(\d{2}-\d{2}|\d{2}-\d{4})|-exp(-\d{2}-\d{2}|-\d{4})?)?")
_GEMINI_PREVIEW_DATE = re.compile(r"(-\d{2}-\d{2}|-\d{2}-\d{4})?")

# Models whose bundled provider is remembered (bundled_provider): a sidecar's reserve names its
# bill by it; a process sees few models.
PROVIDER_OF_CACHE_MAX = 1024


def gemini_family(model: str, names: Iterable[str]) -> str | None:
    """The name among `names` of which `model` is that name or one of its documented versions
    (_GEMINI_VERSION); None for any other model, whatever it begins with."""
    model = model.lower()
    found = [name for name in names if model.startswith(name) and (
        _GEMINI_PREVIEW_DATE if name.endswith("-preview") else _GEMINI_VERSION).fullmatch(
            model[len(name):])]
    return max(found, key=len) if found else None


# Google's documented limits of Gemini models whose genai-prices entry names no context window
# (or no output limit): the input token limit ("Input token limit") and the output token limit
# ("Output token limit") of each model's card, https://ai.google.dev/gemini-api/docs/models.
# The window holds input a request only refers to (cached content, files, fetched URLs); the
# output limit, the most one thought signature sent back can carry. A version of a model
# (gemini-2.5-pro-preview-06-05) takes its model's limits (gemini_family).
GEMINI_LIMITS_TOKENS: dict[str, tuple[int, int]] = {
    "gemini-2.0-flash": (1_048_576, 8_192),
    "gemini-2.0-flash-lite": (1_048_576, 8_192),
    "gemini-2.5-pro": (1_048_576, 65_536),
    "gemini-2.5-flash": (1_048_576, 65_536),
    "gemini-2.5-flash-lite": (1_048_576, 65_536),
    "gemini-3-pro-preview": (1_048_576, 65_536),
    "gemini-3-flash-preview": (1_048_576, 65_536),
}


# Bedrock's inference profiles by geography (`us.anthropic...`): billed in-region, as the model's
# base id is. genai-prices' 'aws' table keys Claude by `global.anthropic.<id>` (a global profile,
# its own, lower, rates) and `regional.anthropic.<id>` (everything else: from Claude 4.5 on, 10%
# above global).
BEDROCK_GEO_PREFIXES = frozenset({"us", "eu", "apac", "jp", "au", "us-gov", "ca"})


def bedrock_price_key(model_id: str) -> str:
    """The 'aws' table's name for the Claude a Bedrock model id calls: an ARN by its last part,
    a global profile as it is, a geographic profile or a base id as the regional entry.
    Anything not Claude is its own name."""
    name = model_id.rsplit("/", 1)[-1] if model_id.startswith("arn:") else model_id
    prefix, _, rest = name.partition(".")
    if prefix in BEDROCK_GEO_PREFIXES and rest.startswith("anthropic."):
        return "regional." + rest
    if prefix == "anthropic":
        return "regional." + name
    return name


def gemini_limits(model: str) -> tuple[int, int] | None:
    """(input, output) token limits of a Gemini model or of a version of it."""
    family = gemini_family(model, GEMINI_LIMITS_TOKENS)
    return None if family is None else GEMINI_LIMITS_TOKENS[family]


_units: dict[str, tuple[int, Mapping[str, str]]] | None = None


def _unit(price_key: str) -> tuple[int, Mapping[str, str]] | None:
    """genai-prices' unit of a price key: what it is `per`, and its dimensions."""
    global _units
    if _units is None:
        from genai_prices.data_units import unit_data  # deferred: see the module docstring

        _units = {u["price_key"]: (int(u["per"]), u.get("dimensions", {}))
                  for u in unit_data.values()}
    return _units.get(price_key)


def _as_tiers(price: object) -> Tiers:
    if isinstance(price, Decimal):
        return ((0, price),)
    base, tiers = getattr(price, "base", None), getattr(price, "tiers", None)
    if isinstance(base, Decimal) and isinstance(tiers, list):
        return ((0, base), *((int(t.start), Decimal(t.price)) for t in tiers))
    raise ValueError(f"a price of an unknown shape: {price!r}")


def _price_keys(model_price: object) -> dict[str, Tiers]:
    return {key: _as_tiers(value) for key, value in vars(model_price).items()
            if not key.startswith("_") and value is not None}


def _dearest(sets: Iterable[dict[str, Tiers]]) -> dict[str, Tiers]:
    merged: dict[str, Tiers] = {}
    for prices in sets:
        for key, tiers in prices.items():
            merged[key] = max_tiers(merged.get(key), tiers) or tiers
    return merged


def _prices_at(info: Any, instant: datetime, tier: str | None) -> dict[str, Tiers]:
    """A model's prices in force at `instant` (at a service tier), counting every time-of-day
    price in: a call may start in one period and be billed in the next."""
    from genai_prices.types import ModelPrice, TimeOfDateConstraint

    if isinstance(info.prices, ModelPrice):
        candidates = [info.prices]
    else:
        # genai-prices' rule: the last price whose constraint holds, else the first.
        candidates = []
        for conditional in reversed(info.prices):
            constraint = conditional.constraint
            if isinstance(constraint, TimeOfDateConstraint):
                candidates.append(conditional.prices)
            elif constraint is None or constraint.active(instant):
                candidates.append(conditional.prices)
                break
        else:
            candidates.append(info.prices[0].prices)
    prices = _dearest(_price_keys(p) for p in candidates)
    if tier is None:
        return prices
    overrides: dict[str, Tiers] = {}
    for variant in getattr(info, "price_variants", None) or ():
        constraint = variant.constraint
        if variant.when != {"service_tier": tier} or not (
                constraint is None or isinstance(constraint, TimeOfDateConstraint)
                or constraint.active(instant)):
            continue
        for key, tiers in _price_keys(variant.prices).items():
            overrides.setdefault(key, tiers)  # genai-prices' rule: the first variant wins
    return {**prices, **overrides}


def _rates_from_keys(model: str, prices: dict[str, Tiers], **extra: Any) -> Rates:
    """Rates from genai-prices' price keys, by their units' dimensions. Every component of a
    price is held in the worst case, or the model is refused:
    - a token rate is held at the dearest of its side (input or output) and of its tiers;
    - a fee per request on every call; a fee per web search for the searches a call may run
      (the `max_uses` of a Messages web search tool, and a search model's own searches:
      WEB_SEARCH_EVERY_CALL_MODELS);
    - other hosted tools' fees (file, social and code tools) and video tokens are held at zero,
      because nothing that runs them is forwarded: the gateway refuses hosted tools, fields not on
      its allow-lists and unknown content types;
    - any other component (characters, pages, durations, pixels, a unit the gateway does not
      know) makes the model unbounded (ModelUnbounded names the component)."""
    kinds: dict[str, list[Tiers]] = {}
    request_micros = ZERO
    web_search_micros: Decimal | None = None
    for key, tiers in prices.items():
        unit = _unit(key)
        if unit is None:
            raise ModelUnbounded(f"model {model!r} is billed by {key}, a unit the gateway "
                                 "does not know", model=model, component=key)
        per, dims = unit
        family, direction = dims.get("family"), dims.get("direction")
        modality, purpose = dims.get("modality"), dims.get("token_type")
        if family == "tool_calls" and dims.get("tool_type") == "web_search":
            web_search_micros = max(web_search_micros or ZERO,
                                    max(rate for _, rate in tiers) * MICROS_PER_USD / per)
            continue
        if family == "tool_calls" or modality == "video":
            continue
        if family == "requests":
            request_micros = max(request_micros,
                                 max(rate for _, rate in tiers) * MICROS_PER_USD / per)
            continue
        if family != "tokens" or per != 1_000_000:
            raise ModelUnbounded(f"model {model!r} is billed by {key}, which no request's "
                                 "worst case bounds", model=model, component=key)
        if direction == "output":
            kind = "output_audio" if modality == "audio" else "output"
        elif modality == "audio":
            kind = "cached_input_audio" if purpose == "cache_read" else "input_audio"
        elif purpose == "cache_read":
            kind = "cached_input"
        elif purpose == "cache_write":
            kind = "cache_write_1h" if dims.get("cache_ttl") == "1h" else "cache_write"
        else:
            kind = "input"  # text, image and tool-use input: the dearest of them
        kinds.setdefault(kind, []).append(tiers)
    def dearest(kind: str) -> Tiers | None:
        return max_tiers(*kinds.get(kind, ()))

    input_rates = dearest("input")
    if input_rates is None:
        raise ModelUnpriced(f"no input price for model {model!r}", model=model)
    return Rates(
        input_rates, dearest("output"), dearest("cached_input"), dearest("cache_write"),
        dearest("cache_write_1h"), dearest("input_audio"), dearest("cached_input_audio"),
        dearest("output_audio"), request_micros, web_search_micros, **extra,
    )


def _named(clause: Any, model: str) -> bool:
    """Whether a genai-prices match clause names `model` (besides the entry's own id): by
    equality (a documented alias), or
    as a family's prefix itself or followed by a dated snapshot (Anthropic names its snapshots
    `claude-haiku-4-5-20251001`). Not by another prefix's tail, a substring or a pattern."""
    equals, prefix = getattr(clause, "equals", None), getattr(clause, "starts_with", None)
    if isinstance(equals, str) and model == equals.lower():
        return True
    if isinstance(prefix, str) and model.startswith(prefix.lower()) and (
            _SNAPSHOT_SUFFIX.fullmatch(model[len(prefix):])):
        return True
    return any(_named(child, model) for child in getattr(clause, "or_", None) or ())


def _model_info(model: str, provider: str | None) -> Any:
    """genai-prices' entry that names `model`: `provider`'s, where it has one, else the first
    any provider has; ModelUnpriced for none."""
    from genai_prices import data_snapshot  # deferred: see the module docstring

    snapshot = data_snapshot.get_snapshot()
    resembled = None
    for provider_id in dict.fromkeys((provider, None)):
        try:
            _, info = snapshot.find_provider_model(model, None, provider_id, None)
        except LookupError:
            # genai-prices matches an entry by its clauses, which need not name its own id (the
            # 'aws' table's `regional.anthropic.<id>`): the provider's entry of that exact id.
            info = _entry_of(snapshot, model, provider_id)
            if info is None:
                continue
        if model == info.id.lower() or _named(info.match, model):
            return info
        # genai-prices also matches by prefix, pattern and date normalisation, across
        # providers: a name it resolves that way may be billed unlike the entry it lands on (a
        # search model as its base model). One name, one price: only the names an entry gives.
        resembled = resembled or info.id
    if resembled is None:
        raise ModelUnpriced(f"no price for model {model!r}", model=model)
    raise ModelUnpriced(
        f"no price for model {model!r}: the price table has no entry of that exact name "
        f"(it resembles {resembled!r}); name it in the prices file", model=model)


def bundled_model_id(model: str, provider: str | None = None) -> str | None:
    """The id of genai-prices' entry that names `model` (lower case), as the bundled table
    prices it (_model_info: `provider`'s entry where it has one, else any provider's); None
    for a name no entry gives."""
    try:
        return str(_model_info(model, provider).id).lower()
    except ModelUnpriced:
        return None


@functools.lru_cache(maxsize=PROVIDER_OF_CACHE_MAX)
def bundled_provider(model: str) -> str | None:
    """The genai-prices provider whose entry names `model` exactly (the first any provider
    has: the one a call priced with no provider is priced by), or None where none does."""
    from genai_prices import data_snapshot  # deferred: see the module docstring

    key = model.lower()
    try:
        provider, info = data_snapshot.get_snapshot().find_provider_model(key, None, None, None)
    except LookupError:
        return None
    return str(provider.id) if key == info.id.lower() or _named(info.match, key) else None


def _entry_of(snapshot: Any, model: str, provider: str | None) -> Any:
    """`provider`'s entry whose id is `model` exactly, or None."""
    if provider is None:
        return None
    for candidate in snapshot.providers:
        if candidate.id == provider:
            return next((m for m in candidate.models if m.id.lower() == model), None)
    return None


def _bundled_rates(model: str, window: int, provider: str | None = None) -> Rates:
    info = _model_info(model, provider)
    extra = _search_family(model)
    context_window = getattr(info, "context_window", None)
    extra["context_window_tokens"] = context_window if (
        type(context_window) is int and context_window > 0) else None
    limits = gemini_limits(model)
    if limits is not None and extra["context_window_tokens"] is None:
        extra["context_window_tokens"] = limits[0]
    start = datetime.fromtimestamp(window * BUNDLED_WINDOW_S, UTC)
    instants = (start, start + timedelta(seconds=BUNDLED_WINDOW_S,
                                         milliseconds=RESERVATION_TTL_MS_MAX))
    try:
        tiers = {
            tier: _rates_from_keys(model, _dearest(_prices_at(info, t, tier) for t in instants),
                                   **extra)
            for tier in sorted({v.when["service_tier"]
                                for v in getattr(info, "price_variants", None) or ()
                                if set(v.when) == {"service_tier"}} - {TIER_DEFAULT, TIER_AUTO})
        }
        prices = _dearest(_prices_at(info, t, None) for t in instants)
    except (ValueError, TypeError, AttributeError) as exc:
        raise ModelUnpriced(f"the price data of model {model!r} cannot be read: {exc}",
                            model=model) from exc
    return _rates_from_keys(model, prices, service_tiers=tiers, **extra,
                            image_tokens_max=image_bound(model),
                            output_tokens_max=output_tokens_max(model) or (
                                limits[1] if limits is not None else None),
                            audio_input_tokens_per_s=audio_input_tokens_per_s(model))
