"""The stub provider's own price table, and its own arithmetic for what a call costs.

The stub is the witness every gateway test is judged by, so it must not share its prices with
the service it judges: it imports nothing from `core` nor genai-prices. Its default table
(infra/stub_prices.json) holds OpenAI's and Anthropic's published rates for the models the demo
and tests use; a caller passes a table of its own (a file path or a dict in the same format)
for test models, merged over the defaults model by model.

Table format, per model (rates are US dollars per million tokens as decimal strings, which is
exactly micro-dollars per token):
    input_usd_per_mtok, output_usd_per_mtok                 required
    cached_input_usd_per_mtok                               prompt-cache reads (else the input rate)
    cache_write_usd_per_mtok                                prompt-cache writes (Anthropic: 5-minute
                                                            writes); a model with this rate reports
                                                            the tokens it wrote
    cache_write_1h_usd_per_mtok                             1-hour cache writes; a model without it
                                                            refuses `"ttl": "1h"`
    audio_input_usd_per_mtok, audio_output_usd_per_mtok     a model without them refuses audio
    audio_input_tokens_per_s                                audio input tokens per second of audio
    request_usd                                             a fee per request, in US dollars
    web_search_usd_per_1k                                   a fee per 1,000 server-side web
                                                            searches; a model without it refuses
                                                            web search (Anthropic's)
    web_search_usd_per_call                                 a search model (OpenAI's chat search
                                                            models): it searches on every call it
                                                            serves, billed this fee once a call
    service_tiers: {"priority": {...the rates above...}}    a tier absent here is refused
    long_context: {"above_input_tokens": N, "beta": FLAG, "context_window_tokens": N,
                   ...the rates above...}                   Anthropic: a call sent with the beta
                                                            FLAG whose input (cached, written and
                                                            plain) is above N tokens is billed
                                                            whole at these rates; OpenAI: no
                                                            beta, any call above N
    reasoning: true                                         part of its output is reasoning tokens
                                                            (Anthropic: it accepts `thinking`)
    image: {"rule": "tile", "base_tokens": N, "tile_tokens": N}
         | {"rule": "patch", "multiplier": "1.62"}
         | {"rule": "area"}                                 a model without it refuses images
    anthropic: {"context_window_tokens": N, "output_tokens_max": N, "cache_tokens_min": N,
                "tool_prompt_tokens": {"auto": N, "any": N}, "keeps_thinking": false}
                                                            served by the Messages API (and only
                                                            there); a model without it is served
                                                            by the OpenAI routes only
    gemini: {"output_tokens_max": N, "thinking": "budget" | "level" | "none",
             "thinking_budget_min": N, "thinking_budget_max": N, "thinks_by_default": BOOL,
             "grounding_usd_per_1k": "35", "grounding_per": "prompt" | "query",
             "media_tokens": {"low": N, "medium": N, "high": N} (optional)}
                                                            served by the Gemini API and Vertex
                                                            AI (infra/stub_gemini.py); its input
                                                            window is `context_window_tokens`,
                                                            its long-context tier `long_context`
                                                            (no beta, any prompt above N);
                                                            `media_tokens`: an image's (a PDF
                                                            page's) tokens by media resolution
                                                            (Gemini 3), else Gemini 2's tiles
    aliases: ["dated-snapshot-name", ...]                   other names of the same model
    context_window_tokens: N                                OpenAI: the most input a call may
                                                            hold; more is refused (400
                                                            context_length_exceeded) unless
                                                            truncated; none: no limit
    web_search_content_tokens: N                            OpenAI: the web search tool bills
                                                            this fixed block of input a search
                                                            instead of the content's own tokens
    embedding: {"dimensions": N, "dimensions_settable": B, "input_tokens_max": N}
                                                            an embedding model (served by the
                                                            embeddings routes only,
                                                            infra/stub_embeddings.py): its
                                                            vectors' length, whether
                                                            `dimensions` may shorten them, the
                                                            most tokens one input may hold

Besides "models", a table may give "openrouter", the fees OpenRouter adds to a model's (billed
when the stub serves OpenRouter's fields, infra/stub_openai.py); a caller's replaces the default:
    web_plugin_usd_per_1k_results                           the web plugin's fee per 1,000 results
    web_plugin_results_default                              results a web plugin without
                                                            `max_results` fetches

and "openai_tools", the fees of OpenAI's hosted tools on Responses (the default table's unless a
caller's gives its own):
    web_search_usd_per_1k_calls                             `web_search`, and `web_search_preview`
                                                            on a reasoning model
    web_search_preview_usd_per_1k_calls                     `web_search_preview` on a model that
                                                            does not reason

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
# The rates of a call billed at Anthropic's long-context prices (the `long_context` entry).
TIER_LONG_CONTEXT = "long_context"
# Chat audio models do not document their audio token rate; the Realtime API's is 1 token per
# 100 ms of user audio (https://developers.openai.com/api/docs/guides/realtime-costs).
AUDIO_INPUT_TOKENS_PER_S_DEFAULT = 10
# Anthropic's image rule (https://platform.claude.com/docs/en/build-with-claude/vision,
# "evaluate image size" and "calculate image costs"): tokens = width x height / 750, after an
# image whose long edge is above 1,568 px, or whose tokens are above ~1,600, is scaled down with
# its aspect ratio kept. "~1,600" is not exact: the docs' table of the largest sizes that are
# not resized reaches 784 x 1568 px (1,640 tokens), so that area is the cap here; the witness
# bills the larger reading.
AREA_PIXELS_PER_TOKEN = 750
AREA_LONG_EDGE_PX_MAX = 1_568
AREA_PIXELS_MAX = 784 * 1_568

RATE_FIELDS = ("input_usd_per_mtok", "output_usd_per_mtok", "cached_input_usd_per_mtok",
               "cache_write_usd_per_mtok", "cache_write_1h_usd_per_mtok",
               "audio_input_usd_per_mtok", "audio_output_usd_per_mtok")
MODEL_FIELDS = frozenset({*RATE_FIELDS, "request_usd", "service_tiers", "reasoning", "image",
                          "audio_input_tokens_per_s", "web_search_usd_per_1k", "gemini",
                          "web_search_usd_per_call", "long_context", "anthropic", "aliases",
                          "context_window_tokens", "web_search_content_tokens", "embedding"})
OPENAI_TOOLS_FIELDS = frozenset({"web_search_usd_per_1k_calls",
                                 "web_search_preview_usd_per_1k_calls"})
OPENROUTER_FIELDS = frozenset({"web_plugin_usd_per_1k_results", "web_plugin_results_default"})
MESSAGES_FIELDS = frozenset({"context_window_tokens", "output_tokens_max", "cache_tokens_min",
                             "tool_prompt_tokens", "keeps_thinking"})
LONG_CONTEXT_FIELDS = frozenset({"above_input_tokens", "beta", "context_window_tokens"})
# OpenAI's long context needs no beta: a call above the threshold is billed at its rates.
OPENAI_LONG_CONTEXT_FIELDS = LONG_CONTEXT_FIELDS - {"beta"}
EMBEDDING_FIELDS = frozenset({"dimensions", "dimensions_settable", "input_tokens_max"})


@dataclass(frozen=True)
class TierRates:
    """Micro-dollars per token of one service tier; None where the model does not serve it."""

    input: Fraction
    output: Fraction
    cached_input: Fraction
    cache_write: Fraction | None
    cache_write_1h: Fraction | None
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
class AreaRule:
    """Anthropic's rule: an image costs its area over `pixels_per_token`, once scaled down (if
    needed) to a long edge of `long_edge_px_max` and an area of `pixels_max`."""

    pixels_per_token: int = AREA_PIXELS_PER_TOKEN
    long_edge_px_max: int = AREA_LONG_EDGE_PX_MAX
    pixels_max: int = AREA_PIXELS_MAX


ImageRule = TileRule | PatchRule | AreaRule


@dataclass(frozen=True)
class LongContext:
    """Long-context prices: a call (Anthropic's: sent with `beta`) whose input is above
    `above_input_tokens` is billed whole at `rates`, within a window of `context_window_tokens`.
    OpenAI's (`beta` None) need no beta."""

    above_input_tokens: int
    beta: str | None
    context_window_tokens: int
    rates: TierRates


@dataclass(frozen=True)
class GeminiModel:
    """What Google documents of a Gemini model besides its rates. `thinking`: how a call sets
    its thinking (`budget`: thinkingConfig.thinkingBudget within [min, max], Gemini 2.5;
    `level`: thinkingLevel, Gemini 3; `none`: it does not think). Grounding with Google Search
    costs `grounding_micros` a grounded prompt (`grounding_per` "prompt", Gemini 2.5) or a
    search query ("query", Gemini 3)."""

    output_tokens_max: int
    thinking: str
    thinking_budget_min: int
    thinking_budget_max: int
    thinks_by_default: bool
    grounding_micros: Fraction
    grounding_per: str
    # Tokens of an image or a PDF page by mediaResolution (low, medium, high; Gemini 3); None:
    # 258 a 768 px tile (Gemini 2).
    media_tokens: Mapping[str, int] | None = None


@dataclass(frozen=True)
class MessagesModel:
    """What Anthropic documents of a model besides its rates, as the Messages API needs it.

    `tool_prompt_tokens_auto` / `_any`: the tool-use system prompt Anthropic adds to the input of
    a call with tools, by `tool_choice` (auto or none / any or tool). `cache_tokens_min`: the
    shortest prefix the prompt cache holds. `keeps_thinking`: thinking blocks of earlier turns
    stay in the context (and are billed as input) instead of being dropped."""

    context_window_tokens: int
    output_tokens_max: int
    cache_tokens_min: int
    tool_prompt_tokens_auto: int
    tool_prompt_tokens_any: int
    keeps_thinking: bool


@dataclass(frozen=True)
class EmbeddingModel:
    """An embedding model: vectors of `dimensions` floats (fewer when `dimensions_settable` and
    a call asks), and at most `input_tokens_max` tokens an input."""

    dimensions: int
    dimensions_settable: bool
    input_tokens_max: int


@dataclass(frozen=True)
class ModelPrices:
    name: str
    standard: TierRates
    tiers: Mapping[str, TierRates]
    request_micros: Fraction
    reasoning: bool
    image: ImageRule | None
    audio_input_tokens_per_s: int
    web_search_micros: Fraction | None = None  # a fee per search
    web_search_call_micros: Fraction | None = None  # a search model's fee per call
    long_context: LongContext | None = None
    messages: MessagesModel | None = None  # None: not an Anthropic model
    gemini: GeminiModel | None = None  # None: not served by the Gemini API
    context_window_tokens: int | None = None  # OpenAI's input limit; None: none
    web_search_content_tokens: int | None = None  # a fixed block a search, instead of its own
    embedding: EmbeddingModel | None = None  # None: not an embedding model

    def rates(self, tier: str) -> TierRates:
        if tier == TIER_STANDARD:
            return self.standard
        if tier == TIER_LONG_CONTEXT and self.long_context is not None:
            return self.long_context.rates
        return self.tiers[tier]


@dataclass(frozen=True)
class OpenRouterPrices:
    """What OpenRouter bills on top of a model's own prices: its web plugin, per result."""

    web_result_micros: Fraction
    web_results_default: int


@dataclass(frozen=True)
class OpenAITools:
    """The fees of OpenAI's hosted tools on Responses, per call."""

    web_search_call_micros: Fraction
    web_search_preview_call_micros: Fraction  # `web_search_preview` on a non-reasoning model


class StubPrices:
    """Model prices by name (case-insensitive); a model not in the table is not served.
    `openrouter`: OpenRouter's own fees, None when no table gives them; `openai_tools`: the fees
    of OpenAI's hosted tools, None when no table gives them (the tools are then refused)."""

    def __init__(self, models: Mapping[str, ModelPrices],
                 openrouter: OpenRouterPrices | None = None,
                 openai_tools: OpenAITools | None = None) -> None:
        self._models = {name.lower(): prices for name, prices in models.items()}
        self.openrouter = openrouter
        self.openai_tools = openai_tools

    @classmethod
    def load(cls, table: str | Path | Mapping[str, Any] | None = None) -> StubPrices:
        """The default table, under `table` (a JSON file's path or the parsed document)."""
        default = json.loads(DEFAULT_TABLE_PATH.read_text())
        models = _models_from_json(default)
        openrouter = _openrouter(default.get("openrouter"))
        tools = _openai_tools(default.get("openai_tools"))
        if table is not None:
            doc = table if isinstance(table, Mapping) else json.loads(Path(table).read_text())
            models |= _models_from_json(doc)
            openrouter = _openrouter(doc.get("openrouter")) or openrouter
            tools = _openai_tools(doc.get("openai_tools")) or tools
        return cls(models, openrouter, tools)

    def model(self, name: str) -> ModelPrices | None:
        return self._models.get(name.lower())


def cost_micros(prices: ModelPrices, tier: str, usage: Usage, *,
                openrouter: OpenRouterPrices | None = None,
                openai_tools: OpenAITools | None = None) -> int:
    """What a call with `usage` costs at `tier`, rounded up once to whole micro-dollars;
    `openrouter` prices the usage OpenRouter adds (its web plugin's results), `openai_tools`
    the searches of OpenAI's hosted web search tool."""
    rates = prices.rates(tier)
    write_rate = rates.input if rates.cache_write is None else rates.cache_write
    exact = (usage.text_input_tokens * rates.input
             + usage.cached_input_tokens * rates.cached_input
             + (usage.cache_write_tokens - usage.cache_write_1h_tokens) * write_rate
             + usage.text_output_tokens * rates.output
             + prices.request_micros)
    for count, rate, what in _optional_parts(prices, tier, usage, openrouter, openai_tools):
        if count:
            if rate is None:  # the counting refuses what a model has no rate for before serving
                raise ValueError(f"{prices.name} has no {what} rate")
            exact += count * rate
    return math.ceil(exact)


def unpriced(prices: ModelPrices, tier: str, usage: Usage, *,
             openrouter: OpenRouterPrices | None = None,
             openai_tools: OpenAITools | None = None) -> str | None:
    """The part of `usage` the model has no rate for at `tier` (None: it prices all of it)."""
    return next((what for count, rate, what
                 in _optional_parts(prices, tier, usage, openrouter, openai_tools)
                 if count and rate is None), None)


def _optional_parts(
    prices: ModelPrices, tier: str, usage: Usage, openrouter: OpenRouterPrices | None,
    openai_tools: OpenAITools | None = None,
) -> tuple[tuple[int, Fraction | None, str], ...]:
    """(count, rate, what) of each part of a call that not every model prices."""
    rates = prices.rates(tier)
    tools = openai_tools
    return (
        (usage.web_search_tool_calls, None if tools is None else tools.web_search_call_micros,
         "web search tool call"),
        (usage.web_search_preview_calls,
         None if tools is None else tools.web_search_preview_call_micros,
         "web search preview call"),
        (usage.audio_input_tokens, rates.audio_input, "audio input"),
        (usage.audio_output_tokens, rates.audio_output, "audio output"),
        (usage.cache_write_1h_tokens, rates.cache_write_1h, "1-hour cache write"),
        (usage.web_search_requests, prices.web_search_micros, "web search"),
        (usage.web_search_calls, prices.web_search_call_micros, "web search call"),
        (usage.web_plugin_results, None if openrouter is None else openrouter.web_result_micros,
         "web plugin result"),
    )


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
        cache_write_1h=optional("cache_write_1h_usd_per_mtok"),
        audio_input=optional("audio_input_usd_per_mtok"),
        audio_output=optional("audio_output_usd_per_mtok"),
    )


def _positive(name: str, key: str, value: object) -> int:
    if type(value) is not int or value < 1:
        raise ValueError(f"{name}.{key} must be a positive integer")
    return value


def _messages_model(name: str, doc: object) -> MessagesModel | None:
    if doc is None:
        return None
    if not isinstance(doc, Mapping) or set(doc) != MESSAGES_FIELDS:
        raise ValueError(f"{name}.anthropic must have exactly {sorted(MESSAGES_FIELDS)}")
    tool_prompt = doc["tool_prompt_tokens"]
    if not isinstance(tool_prompt, Mapping) or set(tool_prompt) != {"auto", "any"}:
        raise ValueError(f"{name}.anthropic.tool_prompt_tokens is {{auto, any}}")
    if type(doc["keeps_thinking"]) is not bool:
        raise ValueError(f"{name}.anthropic.keeps_thinking must be a boolean")
    return MessagesModel(
        context_window_tokens=_positive(name, "context_window_tokens",
                                        doc["context_window_tokens"]),
        output_tokens_max=_positive(name, "output_tokens_max", doc["output_tokens_max"]),
        cache_tokens_min=_positive(name, "cache_tokens_min", doc["cache_tokens_min"]),
        tool_prompt_tokens_auto=_positive(name, "tool_prompt_tokens.auto", tool_prompt["auto"]),
        tool_prompt_tokens_any=_positive(name, "tool_prompt_tokens.any", tool_prompt["any"]),
        keeps_thinking=doc["keeps_thinking"],
    )


GEMINI_FIELDS = frozenset({"output_tokens_max", "thinking", "thinking_budget_min",
                           "thinking_budget_max", "thinks_by_default", "grounding_usd_per_1k",
                           "grounding_per"})
GEMINI_THINKING = ("budget", "level", "none")
GEMINI_GROUNDING_PER = ("prompt", "query")
GEMINI_MEDIA_RESOLUTIONS = ("low", "medium", "high")


def _gemini_model(name: str, doc: object) -> GeminiModel | None:
    if doc is None:
        return None
    if not isinstance(doc, Mapping) or set(doc) - {"media_tokens"} != GEMINI_FIELDS:
        raise ValueError(f"{name}.gemini must have exactly {sorted(GEMINI_FIELDS)} and may "
                         "have media_tokens")
    media = doc.get("media_tokens")
    if media is not None and (not isinstance(media, Mapping) or set(media) != set(
            GEMINI_MEDIA_RESOLUTIONS) or any(type(v) is not int or v < 1
                                             for v in media.values())):
        raise ValueError(f"{name}.gemini.media_tokens gives tokens for "
                         f"{', '.join(GEMINI_MEDIA_RESOLUTIONS)}")
    if doc["thinking"] not in GEMINI_THINKING or doc["grounding_per"] not in GEMINI_GROUNDING_PER \
            or type(doc["thinks_by_default"]) is not bool:
        raise ValueError(f"{name}.gemini: thinking is one of {GEMINI_THINKING}, grounding_per "
                         f"one of {GEMINI_GROUNDING_PER}, thinks_by_default a boolean")
    budget_min, budget_max = doc["thinking_budget_min"], doc["thinking_budget_max"]
    if type(budget_min) is not int or type(budget_max) is not int or not 0 <= budget_min <= \
            budget_max:
        raise ValueError(f"{name}.gemini: need 0 <= thinking_budget_min <= thinking_budget_max")
    return GeminiModel(
        output_tokens_max=_positive(name, "gemini.output_tokens_max", doc["output_tokens_max"]),
        thinking=str(doc["thinking"]), thinking_budget_min=budget_min,
        thinking_budget_max=budget_max, thinks_by_default=doc["thinks_by_default"],
        grounding_micros=_rate(name, "gemini.grounding_usd_per_1k", doc["grounding_usd_per_1k"])
        * MICROS_PER_USD / 1_000,
        grounding_per=str(doc["grounding_per"]),
        media_tokens=None if media is None else dict(media),
    )


def _long_context(name: str, doc: object, *, anthropic: bool = True) -> LongContext | None:
    if doc is None:
        return None
    needed = LONG_CONTEXT_FIELDS if anthropic else OPENAI_LONG_CONTEXT_FIELDS
    if not isinstance(doc, Mapping) or not set(doc) >= needed:
        raise ValueError(f"{name}.long_context needs {sorted(needed)} and rates")
    if anthropic and (not isinstance(doc["beta"], str) or not doc["beta"]):
        raise ValueError(f"{name}.long_context.beta must name the beta flag")
    if not anthropic and "beta" in doc:
        raise ValueError(f"{name}.long_context: an OpenAI model's long context takes no beta")
    return LongContext(
        above_input_tokens=_positive(name, "long_context.above_input_tokens",
                                     doc["above_input_tokens"]),
        beta=doc["beta"] if anthropic else None,
        context_window_tokens=_positive(name, "long_context.context_window_tokens",
                                        doc["context_window_tokens"]),
        rates=_tier(f"{name}.long_context",
                    {k: v for k, v in doc.items() if k not in LONG_CONTEXT_FIELDS}),
    )


def _image_rule(name: str, doc: object) -> ImageRule | None:
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
    area_keys = {"pixels_per_token", "long_edge_px_max", "pixels_max"}
    if doc.get("rule") == "area" and set(doc) <= {"rule", *area_keys}:
        given = {k: doc[k] for k in area_keys if k in doc}
        if all(type(v) is int and v > 0 for v in given.values()):
            return AreaRule(**given)
    raise ValueError(f"{name}.image must be a tile rule (base_tokens, tile_tokens), a patch "
                     "rule (multiplier) or an area rule")


def _embedding(name: str, doc: object) -> EmbeddingModel | None:
    if doc is None:
        return None
    if not isinstance(doc, Mapping) or set(doc) != EMBEDDING_FIELDS:
        raise ValueError(f"{name}.embedding must have exactly {sorted(EMBEDDING_FIELDS)}")
    if type(doc["dimensions_settable"]) is not bool:
        raise ValueError(f"{name}.embedding.dimensions_settable must be a boolean")
    return EmbeddingModel(_positive(name, "embedding.dimensions", doc["dimensions"]),
                          doc["dimensions_settable"],
                          _positive(name, "embedding.input_tokens_max", doc["input_tokens_max"]))


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
    standard = _tier(name, {k: v for k, v in entry.items() if k in RATE_FIELDS})
    messages = _messages_model(name, entry.get("anthropic"))
    if messages is None and "web_search_usd_per_1k" in entry:
        raise ValueError(f"{name}: web_search_usd_per_1k is Anthropic's")
    if messages is not None and "web_search_usd_per_call" in entry:
        raise ValueError(f"{name}: web_search_usd_per_call is for OpenAI's search models")
    return ModelPrices(
        name=name,
        standard=standard,
        tiers={tier: _tier(f"{name}.service_tiers.{tier}", rates)
               for tier, rates in tiers_doc.items()},
        request_micros=(_rate(name, "request_usd", entry["request_usd"]) * MICROS_PER_USD
                        if "request_usd" in entry else Fraction(0)),
        reasoning=reasoning,
        image=_image_rule(name, entry.get("image")),
        audio_input_tokens_per_s=per_s,
        web_search_micros=(
            _rate(name, "web_search_usd_per_1k", entry["web_search_usd_per_1k"])
            * MICROS_PER_USD / 1_000 if "web_search_usd_per_1k" in entry else None),
        web_search_call_micros=(
            _rate(name, "web_search_usd_per_call", entry["web_search_usd_per_call"])
            * MICROS_PER_USD if "web_search_usd_per_call" in entry else None),
        long_context=_long_context(name, entry.get("long_context"),
                                   anthropic=messages is not None),
        messages=messages,
        gemini=_gemini_model(name, entry.get("gemini")),
        context_window_tokens=(_positive(name, "context_window_tokens",
                                         entry["context_window_tokens"])
                               if "context_window_tokens" in entry else None),
        web_search_content_tokens=(_positive(name, "web_search_content_tokens",
                                             entry["web_search_content_tokens"])
                                   if "web_search_content_tokens" in entry else None),
        embedding=_embedding(name, entry.get("embedding")),
    )


def _models_from_json(doc: object) -> dict[str, ModelPrices]:
    """Each model by its name and by each of its aliases (all lower-case)."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("models"), Mapping):
        raise ValueError('a stub price table is {"models": {name: {...}}}')
    models: dict[str, ModelPrices] = {}
    for name, entry in doc["models"].items():
        model = _model(str(name), entry)
        aliases = entry.get("aliases", [])
        if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
            raise ValueError(f"{name}.aliases must be a list of names")
        for key in (str(name), *aliases):
            if key.lower() in models:
                raise ValueError(f"the model name {key!r} is given twice")
            models[key.lower()] = model
    return models


def _openai_tools(doc: object) -> OpenAITools | None:
    if doc is None:
        return None
    if not isinstance(doc, Mapping) or set(doc) != OPENAI_TOOLS_FIELDS:
        raise ValueError(f"openai_tools must have exactly {sorted(OPENAI_TOOLS_FIELDS)}")
    return OpenAITools(*(_rate("openai_tools", key, doc[key]) * MICROS_PER_USD / 1_000
                         for key in ("web_search_usd_per_1k_calls",
                                     "web_search_preview_usd_per_1k_calls")))


def _openrouter(doc: object) -> OpenRouterPrices | None:
    if doc is None:
        return None
    if not isinstance(doc, Mapping) or set(doc) != OPENROUTER_FIELDS:
        raise ValueError(f"openrouter must have exactly {sorted(OPENROUTER_FIELDS)}")
    return OpenRouterPrices(
        web_result_micros=_rate("openrouter", "web_plugin_usd_per_1k_results",
                                doc["web_plugin_usd_per_1k_results"]) * MICROS_PER_USD / 1_000,
        web_results_default=_positive("openrouter", "web_plugin_results_default",
                                      doc["web_plugin_results_default"]),
    )
