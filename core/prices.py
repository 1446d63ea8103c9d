"""Model prices: the genai-prices bundled snapshot, under an overrides file for private models.

Rates are US dollars per million tokens, which is exactly micro-dollars per token, so a cost is
an exact Decimal of micro-dollars that is rounded up once, at the end.

A call is priced with every rate a provider bills an LLM call by: input, output, cache reads,
cache writes (5-minute and 1-hour), audio in and out, a fee per request, a fee per server-side
web search (Anthropic's), and service tiers (OpenAI's `priority`). What a call may cost
(worst_case_micros) holds each token at the dearest rate it can be billed at; what it cost
(cost_micros) prices what the provider reports, and a usage that cannot be priced (audio for a
model with no audio rate, a tier with no known rates, searches with no known fee) raises: it is
never priced low.

Freshness, without a cost on every call:
- CEILING_PRICES_FILE is checked (one stat) at most once a second on the lookup path, and read
  again when it changed; a file that does not parse leaves the last good one in force.
- genai-prices' prices depend on the date (a price that starts on a day, peak hours). Bundled
  rates are resolved once per window of BUNDLED_WINDOW_S, as the dearest of the prices in force
  at the window's start and at its end plus the longest lease (a call reserved in the window is
  billed by then), counting every time-of-day price in; the window is part of the version every
  reservation records.

genai-prices is imported on the first lookup that the overrides do not answer, not at import
time: its import is a large share of a cold start (bench/http.py prints the import tree), which
a serverless instance should not pay before it can answer /health.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal, InvalidOperation
from functools import cached_property
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

from core.content import (
    NO_MEDIA,
    ImageBound,
    Media,
    audio_input_tokens_per_s,
    image_bound,
    output_tokens_max,
)
from core.errors import InputUnbounded, InvalidRequest, ModelUnbounded, ModelUnpriced
from core.limits import AMOUNT_MICROS_MAX, CHOICES_MAX, RESERVATION_TTL_MS_MAX, TOKENS_MAX
from core.money import MICROS_PER_USD, charge_micros

LOG = logging.getLogger(__name__)

# Model names are looked up case-insensitively, as genai-prices does.
MODEL_NAME_LEN_MAX = 200
# Rates (and misses) cached per process; bounded because model names come from callers.
RATES_CACHE_MAX = 4_096
# The prices file is stat'ed at most this often, on the lookup path: a change is in force
# within about a second, and a reserve does not pay a system call.
PRICES_FILE_CHECK_S = 1.0
# Bundled rates are resolved once per window this long. Dated prices start on UTC days, so an
# hour keeps them current without a genai-prices lookup per call.
BUNDLED_WINDOW_S = 3_600
# Service tiers, as OpenAI names them: `default` is the standard rates; `auto` (and a request
# that names none) lets the provider pick, which a project's settings can make a dearer tier.
TIER_DEFAULT = "default"
TIER_AUTO = "auto"
SERVICE_TIER_LEN_MAX = 64
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
# What may follow a model family's name in the name of one of its dated snapshots: nothing, or
# a date as providers write them (`-20251001`, `-2024-08-06`).
_SNAPSHOT_SUFFIX = re.compile(r"(-\d{8}|-\d{4}-\d{2}-\d{2})?")

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
                         output_tokens: int, *, cache_1h: bool = True) -> Decimal:
        """Every input token at the dearest input-side rate it can reach (input, a cache read
        or either cache write; a 1-hour write only with `cache_1h`), audio at the dearest of
        those and the audio rates, every output token at the dearest output-side rate, plus the
        fee. The caller checks that the rates it needs exist."""
        text_rate = max(peak(t, input_tokens_max) for t in (
            self.input, self.cached_input, self.cache_write,
            self.cache_write_1h if cache_1h else None) if t is not None)
        exact = text_tokens * text_rate + self.call_fee_micros
        if audio_tokens:
            exact += audio_tokens * max(text_rate, *(peak(t, input_tokens_max) for t in (
                self.input_audio, self.cached_input_audio) if t is not None))
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


def _signature(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size, st.st_ino


class PriceTable:
    """Prices for models by name. An unpriced model raises ModelUnpriced; it is never free.

    `version` names the prices in force: the genai-prices release, the window its bundled rates
    were resolved for, and a digest of the prices file."""

    def __init__(
        self,
        overrides: Mapping[str, Rates] | None = None,
        overrides_digest: str = "",
        *,
        path: str | None = None,
        monotonic_s: Callable[[], float] = time.monotonic,
        now_s: Callable[[], float] = time.time,
    ) -> None:
        self._overrides = {k.lower(): v for k, v in (overrides or {}).items()}
        self._digest = overrides_digest
        self._path = path
        self._file_signature: tuple[int, int, int] | None = None
        self._failed_signature: tuple[int, int, int] | None = None
        self._monotonic_s, self._now_s = monotonic_s, now_s
        self._next_check_s = monotonic_s() + PRICES_FILE_CHECK_S
        self._window = self._window_now()
        # By (provider, model name); a str: why the model has no price.
        self._bundled: dict[tuple[str | None, str], Rates | str] = {}
        self._windows_filled: set[str] = set()  # prices file entries given a bundled window
        self._package = package_version("genai-prices")
        self.version = self._version()

    @classmethod
    def from_file(cls, path: str | None, **kwargs: Any) -> PriceTable:
        """The bundled table, under the overrides in `path` (CEILING_PRICES_FILE) if given;
        InvalidRequest if that file is not valid, so a service never starts on a bad one."""
        if not path:
            return cls(**kwargs)
        signature = _signature(path)  # before the read: a write after it is read again
        overrides, digest = load_prices_file(path)
        table = cls(overrides, digest, path=path, **kwargs)
        table._file_signature = signature
        return table

    # -- freshness --------------------------------------------------------------------------

    def _window_now(self) -> int:
        return int(self._now_s() // BUNDLED_WINDOW_S)

    def _version(self) -> str:
        start = datetime.fromtimestamp(self._window * BUNDLED_WINDOW_S, UTC)
        suffix = f"+overrides.{self._digest}" if self._digest else ""
        return f"genai-prices-{self._package}@{start:%Y-%m-%dT%H:%M}Z{suffix}"

    def refresh(self) -> None:
        """Read the prices file again if it changed, and move bundled rates to the current
        window; does nothing (one clock read) if it did so less than a second ago."""
        now_s = self._monotonic_s()
        if now_s < self._next_check_s:
            return
        self._next_check_s = now_s + PRICES_FILE_CHECK_S
        changed = self._reload(self._path) if self._path else False
        window = self._window_now()
        if window != self._window:
            self._window = window
            self._bundled.clear()
            changed = True
        if changed:
            self.version = self._version()

    def _reload(self, path: str) -> bool:
        try:
            signature = _signature(path)
        except OSError as exc:
            self._failed(None, f"cannot be read ({exc})")
            return False
        if signature == self._file_signature:
            return False
        try:
            overrides, digest = load_prices_file(path)
        except (OSError, InvalidRequest) as exc:
            self._failed(signature, str(exc))
            return False
        self._overrides = {k.lower(): v for k, v in overrides.items()}
        self._windows_filled = set()
        self._digest, self._file_signature = digest, signature
        LOG.info("prices file %s read again: %d models, digest %s", path, len(overrides),
                 digest)
        return True

    def _failed(self, signature: tuple[int, int, int] | None, why: str) -> None:
        if signature != self._failed_signature or signature is None:
            LOG.warning("prices file %s %s; the prices read before stay in force", self._path, why)
        self._failed_signature = signature

    # -- lookups ----------------------------------------------------------------------------

    def rates(self, model: str, provider: str | None = None) -> Rates:
        """A model's rates: the prices file's, else the bundled table's, from `provider`'s
        entry where it names the model (the provider the call is billed by: genai-prices
        prices one name differently by provider), else the entry any provider gives."""
        if not isinstance(model, str) or not 0 < len(model) <= MODEL_NAME_LEN_MAX:
            raise InvalidRequest("model must be a name of 1 to 200 characters", field="model")
        if self._monotonic_s() >= self._next_check_s:
            self.refresh()
        key = model.lower()
        found: Rates | str | None = self._overrides.get(key)
        if isinstance(found, Rates) and found.context_window_tokens is None and (
                key not in self._windows_filled):
            found = self._with_bundled_window(key, found)
        found = found or self._bundled.get((provider, key))
        if found is None:
            try:
                found = _bundled_rates(key, self._window, provider)
            except ModelUnpriced as exc:
                found = exc.message
            if len(self._bundled) < RATES_CACHE_MAX:
                self._bundled[(provider, key)] = found
        if isinstance(found, str):
            raise ModelUnpriced(found, model=model)
        if found.web_searches_per_call and any(
                r.web_search_micros is None for r in (found, *found.service_tiers.values())):
            raise ModelUnbounded(
                f"model {model!r} runs {found.web_searches_per_call} web search(es) on every "
                "call, and no fee for a search is known for it: set usd_per_web_search for it "
                "in the prices file", model=model, component="web_search")
        return found

    def _with_bundled_window(self, key: str, rates: Rates) -> Rates:
        """A prices file entry that names no context window takes the bundled table's for the
        same name, if it has one (looked up once per entry)."""
        bundled = self._bundled.get((None, key))
        if bundled is None:
            try:
                bundled = _bundled_rates(key, self._window)
            except ModelUnpriced as exc:
                bundled = exc.message
            if len(self._bundled) < RATES_CACHE_MAX:
                self._bundled[(None, key)] = bundled
        self._windows_filled.add(key)
        if isinstance(bundled, Rates) and bundled.context_window_tokens is not None:
            rates = replace(rates, context_window_tokens=bundled.context_window_tokens)
            self._overrides[key] = rates
        return rates

    def _tiers(self, model: str, rates: Rates, tier: str | None) -> tuple[Rates, ...]:
        found = rates.at_tier(check_service_tier(tier))
        if found is None:
            raise ModelUnpriced(f"model {model!r} has no known rates at service tier {tier!r}",
                                model=model, field="service_tier")
        return found

    def worst_case_micros(
        self, model: str, input_tokens: int, output_tokens_max: int, choices: int = 1, *,
        media: Media = NO_MEDIA, service_tier: str | None = None, provider: str | None = None,
    ) -> int:
        """The most a call may be billed: `input_tokens` of text and `media`, at the requested
        service tier's rates (`auto`: the dearest tier), and the output cap times choices, as
        `provider` prices the model (rates).

        A call that may run server-side web searches (Anthropic's, at most `media.web_searches`)
        is billed each search's fee, and its results as input in every sampling step of the
        call that follows it. How much of the rest of the context each step bills again is not
        documented, so each of the searches + 1 steps is held as if it billed all of it: the
        prompt, every search's results and the output so far."""
        check_tokens(input_tokens, "input_tokens", minimum=0)
        check_tokens(output_tokens_max, "max_output_tokens", minimum=1)
        if type(choices) is not int or not 1 <= choices <= CHOICES_MAX:
            raise InvalidRequest(f"n must be an integer from 1 to {CHOICES_MAX}", field="n")
        r = self.rates(model, provider)
        candidates = self._tiers(model, r, service_tier)
        searches = self._searches(model, r, media)
        if media is NO_MEDIA and not searches:
            # Text only, at rates that do not depend on its size: each tier's worst case from
            # the two rates worked out once per tier (Rates.flat_worst), the dearest tier's.
            flats = [(c.flat_worst, c.call_fee_micros) for c in candidates]
            if all(flat is not None for flat, _ in flats):
                return _bounded(charge_micros(max(
                    input_tokens * flat[0] + output_tokens_max * choices * flat[1] + fee
                    for flat, fee in flats if flat is not None)))
        text_tokens = input_tokens + self._image_tokens(model, r, media)
        audio_tokens = self._audio_tokens(model, r, media)
        window = media.window_tokens or r.context_window_tokens
        if media.thinking_blocks:
            text_tokens += self._thinking_tokens(model, r, media, window, text_tokens)
        referred = media.referred_field or media.compaction_field
        if referred:
            if window is None:
                raise InputUnbounded(
                    f"{referred} is input the request only refers to, of a size it cannot "
                    f"show, and no context window is known for model {model!r} to hold it at: "
                    "set context_window_tokens for it in the prices file",
                    field=referred, model=model)
            # The model reads at most its window: the body and all it refers to together.
            text_tokens = max(text_tokens, window)
            if media.compaction_field:
                # The compacting step reads at most the window and writes at most the output
                # cap; the answer's step reads the window again.
                text_tokens += window
                output_tokens_max *= 2
        if searches:
            steps = searches + 1
            text_tokens = steps * self._step_tokens(model, r, media, searches, window,
                                                    text_tokens, output_tokens_max * choices)
            audio_tokens *= steps
        total = check_tokens(text_tokens + audio_tokens, "input_tokens", minimum=0)
        exact = ZERO
        for tier in candidates:
            if tier.output is None and tier.output_audio is None:
                raise ModelUnpriced(f"model {model!r} has no output price", model=model)
            if audio_tokens and tier.input_audio is None:
                raise ModelUnpriced(f"model {model!r} has no audio input price", model=model,
                                    field=media.audio_field)
            fees = ZERO
            if searches:
                if tier.web_search_micros is None:
                    raise ModelUnpriced(
                        f"model {model!r} has no web search price: set usd_per_web_search for "
                        "it in the prices file", model=model, field=media.web_search_field)
                fees = searches * tier.web_search_micros
            exact = max(exact, fees + tier.worst_case_exact(
                text_tokens, audio_tokens, total, output_tokens_max * choices,
                cache_1h=media.cache_1h))
        return _bounded(charge_micros(exact))

    @staticmethod
    def _thinking_tokens(model: str, rates: Rates, media: Media, window: int | None,
                         text_tokens: int) -> int:
        """What the thinking blocks sent back may be billed as: each at most what one call of
        the model writes, and with the rest of the input at most the context window."""
        bounds = [b for b in (
            None if rates.output_tokens_max is None else
            media.thinking_blocks * rates.output_tokens_max,
            None if window is None else max(window - text_tokens, 0)) if b is not None]
        if not bounds:
            raise InputUnbounded(
                f"{media.thinking_field} is thinking sent back, billed as the thinking its "
                "signature carries, of a size the request cannot show, and neither the most "
                f"output nor the context window of model {model!r} is known: set "
                "output_tokens_max or context_window_tokens for it in the prices file",
                field=media.thinking_field, model=model)
        return min(bounds)

    @staticmethod
    def _searches(model: str, rates: Rates, media: Media) -> int:
        """The web searches a call may run beyond a search model's own: the request's bound
        (`media.web_searches`), or for a model that searches as it chooses, the prices file's."""
        if not rates.searches_on_its_own or media.web_searches:
            return media.web_searches
        if rates.web_searches_max is None:
            raise ModelUnbounded(
                f"model {model!r} runs web searches as it chooses, and nothing bounds how many: "
                "send max_tool_calls with the request (Responses), or set web_searches_max for "
                "it in the prices file", model=model, component="web_search")
        return rates.web_searches_max

    @staticmethod
    def _step_tokens(model: str, rates: Rates, media: Media, searches: int, window: int | None,
                     text_tokens: int, output_tokens: int) -> int:
        """The most one sampling step of a call that searches may read: the prompt, every
        search's results and the output so far (where a prices file bounds one search's
        results), and never more than the model's context window."""
        bound = None
        if rates.web_search_result_tokens_max is not None:
            bound = text_tokens + searches * rates.web_search_result_tokens_max + output_tokens
        if window is not None:
            bound = max(text_tokens, window) if bound is None else min(
                bound, max(text_tokens, window))
        if bound is None:
            field = media.web_search_field or "the model's searches"
            raise InputUnbounded(
                f"{field} runs web searches, whose results are input of a size no provider "
                f"documents, and no context window is known for model {model!r}: set "
                "context_window_tokens (or web_search_result_tokens_max, the most one search's "
                "results may be billed as) for it in the prices file",
                field=media.web_search_field, model=model)
        return bound

    @staticmethod
    def _image_tokens(model: str, rates: Rates, media: Media) -> int:
        if not (media.images_low or media.images_high):
            return 0
        bound = rates.image_tokens_max
        if bound is None:
            raise InputUnbounded(
                f"{media.image_field} is an image, and no per-image token bound is known for "
                f"model {model!r}: set image_input_tokens_max for it in the prices file",
                field=media.image_field, model=model)
        return media.images_low * bound.low_tokens + media.images_high * bound.high_tokens

    @staticmethod
    def _audio_tokens(model: str, rates: Rates, media: Media) -> int:
        if not media.audio_ms:
            return 0
        per_s = rates.audio_input_tokens_per_s
        if per_s is None:
            raise InputUnbounded(
                f"{media.audio_field} is audio, and how model {model!r} tokenizes audio is not "
                "known: set audio_input_tokens_per_s for it in the prices file",
                field=media.audio_field, model=model)
        return -(-media.audio_ms * per_s // 1_000)

    def cost_micros(self, model: str, usage: Usage, provider: str | None = None) -> int:
        """What `usage` cost, at the tier the answer named (`auto`: the dearest it could be)."""
        r = self.rates(model, provider)
        tier = usage.service_tier
        if not r.service_tiers and tier != TIER_AUTO:
            tier = None  # a model with one set of rates is billed at them, whatever the tier
        exact = ZERO
        for rates in self._tiers(model, r, tier):
            if usage.output_tokens > usage.output_audio_tokens and rates.output is None:
                raise ModelUnpriced(f"model {model!r} has no output price", model=model)
            if usage.input_audio_tokens and rates.input_audio is None:
                raise ModelUnpriced(f"model {model!r} has no audio input price", model=model,
                                    field="input_audio_tokens")
            if usage.output_audio_tokens and rates.output_audio is None:
                raise ModelUnpriced(f"model {model!r} has no audio output price", model=model,
                                    field="output_audio_tokens")
            if usage.web_search_requests and rates.web_search_micros is None:
                raise ModelUnpriced(f"model {model!r} has no web search price", model=model,
                                    field="web_search_requests")
            exact = max(exact, rates.cost_exact(usage))
        return _bounded(charge_micros(exact))


def _bounded(micros: int) -> int:
    if micros > AMOUNT_MICROS_MAX:
        raise InvalidRequest(f"cost {micros} micro-dollars is above the per-call limit")
    return micros


# -- the prices file ------------------------------------------------------------------------------

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


def _search_family(model: str) -> dict[str, Any]:
    """What a model's family says of its searches (SEARCH_EVERY_CALL_FAMILY,
    SEARCH_ON_ITS_OWN_FAMILY), as Rates fields."""
    name = model.lower()
    return {"web_searches_per_call": 1 if SEARCH_EVERY_CALL_FAMILY.search(name) else 0,
            "searches_on_its_own": SEARCH_ON_ITS_OWN_FAMILY.search(name) is not None}


# -- the bundled table (genai-prices) -------------------------------------------------------------

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


def _bundled_rates(model: str, window: int, provider: str | None = None) -> Rates:
    info = _model_info(model, provider)
    extra = _search_family(model)
    context_window = getattr(info, "context_window", None)
    extra["context_window_tokens"] = context_window if (
        type(context_window) is int and context_window > 0) else None
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
                            output_tokens_max=output_tokens_max(model),
                            audio_input_tokens_per_s=audio_input_tokens_per_s(model))
