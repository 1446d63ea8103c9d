"""Rates and usage: what a model costs per unit, and what a call was billed for.

Rates are US dollars per million tokens, which is exactly micro-dollars per token, so a cost is
an exact Decimal of micro-dollars that is rounded up once, at the end.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from functools import cached_property
from typing import Any

from core.content import ImageBound
from core.errors import InvalidRequest
from core.limits import TOKENS_MAX

# Service tiers, as OpenAI names them: `default` is the standard rates; `auto` (and a request
# that names none) lets the provider pick, which a project's settings can make a dearer tier.
TIER_DEFAULT = "default"
TIER_AUTO = "auto"
SERVICE_TIER_LEN_MAX = 64
# Model families that search the web whatever the request's tools say, matched by family (any
# snapshot date, any upstream's prefix such as `openai/`), never by a list of names: no price
# table says which models do this (genai-prices prices the search models by their tokens
# alone). OpenAI's chat search models ("-search-preview", "-search-api") "always retrieve
# information from the web before responding": each call is held and charged one search's fee,
# which no usage reports, and refused (model_unbounded) where no fee for a search is known. Deep
# research models ("-deep-research") run as many searches as they choose: held at the bound the
# request gives (max_tool_calls), or the prices file's `web_searches_max`, else refused.
SEARCH_EVERY_CALL_FAMILY = re.compile(r"-search-(?:preview|api)(?:-|$)")
SEARCH_ON_ITS_OWN_FAMILY = re.compile(r"-deep-research(?:-|$)")

ZERO = Decimal(0)

# A rate by input size: (input_tokens_from, rate), the first from 0. A call with more input
# tokens than a tier's start pays that tier's rate on all its tokens (the providers' "cliff").
Tiers = tuple[tuple[int, Decimal], ...]


def peak(tiers: Tiers, input_tokens_max: int) -> Decimal:
    """The dearest rate of `tiers` that a call of at most `input_tokens_max` input tokens can
    reach."""
    if len(tiers) == 1:
        return tiers[0][1]
    return max(rate for start, rate in tiers if start == 0 or input_tokens_max > start)


def max_tiers(*schedules: Tiers | None) -> Tiers | None:
    """One schedule at least as dear as each of `schedules` at every input size."""
    given = [s for s in schedules if s is not None]
    if len(given) <= 1:
        return given[0] if given else None
    starts = sorted({start for schedule in given for start, _ in schedule})
    return tuple((start, max(Rates.at(s, start + 1) for s in given)) for start in starts)



@dataclass(frozen=True)
class Rates:
    """One model's rates: USD per million tokens (= micro-dollars per token), tier-aware.

    `cached_input` is a cache read, `cache_write` a (5-minute) cache write, `cache_write_1h` a
    1-hour one; the audio rates price audio tokens. A missing rate is billed as its plainer kind
    (a cache read or write as input, a 1-hour write as a 5-minute one, a cached audio read as
    audio), except audio and output, which a model without them cannot be priced for.
    `request_micros` is a fee per request, `web_search_micros` one per server-side web search
    (None: the model's searches have no known price), and `web_searches_per_call` the searches
    the model runs on every call, whatever the request says (a search model's); together they
    are `call_fee_micros`, held and charged on every call. `service_tiers` are the model's other
    tiers' rates (each a complete Rates); the fields here are its default tier's.
    `image_tokens_max` and `audio_input_tokens_per_s` bound what its images and audio are billed
    as (core/content.py); `web_search_result_tokens_max` what one search's results are billed as
    input (only a prices file gives it: no provider documents a size).
    """

    input: Tiers
    output: Tiers | None
    cached_input: Tiers | None = None
    cache_write: Tiers | None = None
    cache_write_1h: Tiers | None = None
    input_audio: Tiers | None = None
    cached_input_audio: Tiers | None = None
    output_audio: Tiers | None = None
    request_micros: Decimal = ZERO
    web_search_micros: Decimal | None = None
    web_searches_per_call: int = 0
    service_tiers: Mapping[str, Rates] = field(default_factory=dict, hash=False)
    image_tokens_max: ImageBound | None = None
    audio_input_tokens_per_s: int | None = None
    web_search_result_tokens_max: int | None = None
    # The most a call may read (genai-prices' context_window, or the prices file's): what holds
    # input the request only refers to. None: not known, and such input is refused.
    context_window_tokens: int | None = None
    # A model that searches as it chooses (SEARCH_ON_ITS_OWN_FAMILY), and the most searches the
    # prices file says one of its calls can run (None: the request must bound them).
    searches_on_its_own: bool = False
    web_searches_max: int | None = None
    # The most output tokens one call writes (bundled for Claude models, core/content.py; or
    # the prices file's): the most one thinking block sent back carries.
    output_tokens_max: int | None = None

    @staticmethod
    def at(tiers: Tiers, input_tokens: int) -> Decimal:
        rate = tiers[0][1]
        for start, tier_rate in tiers:
            if input_tokens > start:
                rate = tier_rate
        return rate

    def at_tier(self, tier: str | None) -> tuple[Rates, ...] | None:
        """The rates a call at service `tier` may be billed at; None for a tier it has none for.

        `auto` may be served at any of the model's tiers: a project's settings can make it a
        dearer one (OpenAI's priority), and the gateway cannot see them."""
        if tier is None or tier == TIER_DEFAULT:
            return (self,)
        if tier == TIER_AUTO:
            return (self, *self.service_tiers.values())
        found = self.service_tiers.get(tier)
        return None if found is None else (found,)

    @cached_property
    def call_fee_micros(self) -> Decimal:
        """What every call is billed besides its tokens: the fee per request, and the searches
        a search model runs on every call (PriceTable.rates refuses such a model when the fee of
        a search is not known)."""
        searches = ZERO
        if self.web_searches_per_call and self.web_search_micros is not None:
            searches = self.web_searches_per_call * self.web_search_micros
        return self.request_micros + searches

    @cached_property
    def flat_worst(self) -> tuple[Decimal, Decimal] | None:
        """(text input, output) rates of the worst case when neither depends on the input's
        size: the reserve path's common case, worked out once per model, not per call."""
        schedules = (self.input, self.cached_input, self.cache_write, self.cache_write_1h,
                     self.output, self.output_audio)
        if (self.output is None and self.output_audio is None) or any(
                t is not None and len(t) > 1 for t in schedules):
            return None
        return (max(t[0][1] for t in schedules[:4] if t is not None),
                max(t[0][1] for t in schedules[4:] if t is not None))

    def worst_case_exact(self, text_tokens: int, audio_tokens: int, input_tokens_max: int,
                         output_tokens: int, *, cache_1h: bool = True,
                         any_modality: bool = False) -> Decimal:
        """Every input token at the dearest input-side rate it can reach (input, a cache read
        or either cache write; a 1-hour write only with `cache_1h`; with `any_modality`, input
        the request only refers to, of a kind it cannot show, the audio rates too), audio at
        the dearest of those and the audio rates, every output token at the dearest
        output-side rate, plus the fee. The caller checks that the rates it needs exist."""
        text_rate = max(peak(t, input_tokens_max) for t in (
            self.input, self.cached_input, self.cache_write,
            self.cache_write_1h if cache_1h else None,
            *((self.input_audio, self.cached_input_audio) if any_modality else ()))
            if t is not None)
        exact = text_tokens * text_rate + self.call_fee_micros
        if audio_tokens:
            exact += audio_tokens * max(text_rate, *(peak(t, input_tokens_max) for t in (
                self.input_audio, self.cached_input_audio) if t is not None))
        if not output_tokens:
            return exact  # a call that writes nothing (an embedding) may have no output rate
        output_rate = max(peak(t, input_tokens_max) for t in (
            self.output, self.output_audio) if t is not None)
        return exact + output_tokens * output_rate

    def cost_exact(self, usage: Usage) -> Decimal:
        """What `usage` costs at these rates. The caller checks that the rates it needs exist."""
        total, at = usage.input_tokens, Rates.at
        input_rate = at(self.input, total)
        read_rate = input_rate if self.cached_input is None else at(self.cached_input, total)
        write_rate = input_rate if self.cache_write is None else at(self.cache_write, total)
        write_1h_rate = write_rate if self.cache_write_1h is None else at(
            self.cache_write_1h, total)
        audio = usage.input_audio_tokens
        audio_rate = audio_read_rate = ZERO
        if self.input_audio is not None:
            audio_rate = at(self.input_audio, total)
            audio_read_rate = audio_rate if self.cached_input_audio is None else at(
                self.cached_input_audio, total)
        reads = usage.cached_input_tokens
        text = total - audio - usage.cache_write_tokens - usage.cache_write_1h_tokens

        # A usage says how many input tokens were cache reads, not whether they were text or
        # audio: of the two extreme splits, the one that costs more (the cost is linear in it).
        def input_cost(text_reads: int) -> Decimal:
            audio_reads = reads - text_reads
            return ((text - text_reads) * input_rate + text_reads * read_rate
                    + (audio - audio_reads) * audio_rate + audio_reads * audio_read_rate)

        exact = max(input_cost(max(0, reads - audio)), input_cost(min(reads, text)))
        exact += (usage.cache_write_tokens * write_rate
                  + usage.cache_write_1h_tokens * write_1h_rate + self.request_micros)
        # A search model's searches are billed whether or not its usage reports them.
        searches = max(usage.web_search_requests, self.web_searches_per_call)
        if searches and self.web_search_micros is not None:
            exact += searches * self.web_search_micros
        output_text = usage.output_tokens - usage.output_audio_tokens
        if output_text and self.output is not None:
            exact += output_text * at(self.output, total)
        if usage.output_audio_tokens and self.output_audio is not None:
            exact += usage.output_audio_tokens * at(self.output_audio, total)
        return exact


@dataclass(frozen=True)
class Usage:
    """What a call was billed for, as its provider reported it.

    `input_tokens` counts every input token (cache reads and writes and audio included), and
    `output_tokens` every output token (reasoning and audio included); the other counts are
    parts of those. `web_search_requests` counts server-side web searches, billed a fee each
    (their results are input tokens). `service_tier` is the tier the answer says it was served
    at: None for the default tier, `auto` for an answer that does not say (priced at the dearest
    tier the call could have been served at).
    """

    input_tokens: int
    output_tokens: int
    cached_input_tokens: int = 0
    cache_write_tokens: int = 0
    cache_write_1h_tokens: int = 0
    input_audio_tokens: int = 0
    output_audio_tokens: int = 0
    service_tier: str | None = None
    web_search_requests: int = 0

    def __post_init__(self) -> None:
        for name in ("input_tokens", "output_tokens", "cached_input_tokens",
                     "cache_write_tokens", "cache_write_1h_tokens", "input_audio_tokens",
                     "output_audio_tokens", "web_search_requests"):
            check_tokens(getattr(self, name), name, minimum=0)
        writes = self.cache_write_tokens + self.cache_write_1h_tokens
        if self.cached_input_tokens + writes > self.input_tokens:
            raise InvalidRequest(
                "cached_input_tokens and cache writes cannot exceed input_tokens",
                field="cached_input_tokens",
            )
        if self.input_audio_tokens + writes > self.input_tokens:
            raise InvalidRequest(
                "input_audio_tokens and cache writes cannot exceed input_tokens",
                field="input_audio_tokens",
            )
        if self.output_audio_tokens > self.output_tokens:
            raise InvalidRequest("output_audio_tokens cannot exceed output_tokens",
                                 field="output_audio_tokens")
        check_service_tier(self.service_tier)


def check_tokens(value: object, field: str, *, minimum: int) -> int:
    if type(value) is not int or not minimum <= value <= TOKENS_MAX:
        raise InvalidRequest(
            f"{field} must be an integer from {minimum} to {TOKENS_MAX}", field=field
        )
    return value


def check_service_tier(tier: object) -> str | None:
    if tier is not None and (not isinstance(tier, str)
                             or not 0 < len(tier) <= SERVICE_TIER_LEN_MAX):
        raise InvalidRequest(
            f"service_tier must be a name of 1 to {SERVICE_TIER_LEN_MAX} characters",
            field="service_tier",
        )
    return tier


def _search_family(model: str) -> dict[str, Any]:
    """What a model's family says of its searches (SEARCH_EVERY_CALL_FAMILY,
    SEARCH_ON_ITS_OWN_FAMILY), as Rates fields."""
    name = model.lower()
    return {"web_searches_per_call": 1 if SEARCH_EVERY_CALL_FAMILY.search(name) else 0,
            "searches_on_its_own": SEARCH_ON_ITS_OWN_FAMILY.search(name) is not None}
