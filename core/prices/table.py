"""The price table: a model's rates by name, what a call may cost and what it cost.

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
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from importlib.metadata import version as package_version
from typing import Any

from core.content import NO_MEDIA, Media
from core.errors import InputUnbounded, InvalidRequest, ModelUnbounded, ModelUnpriced
from core.limits import AMOUNT_MICROS_MAX, CHOICES_MAX, MODEL_NAME_LEN_MAX
from core.money import charge_micros
from core.prices.bundled import (
    BUNDLED_WINDOW_S,
    _bundled_rates,
    bundled_model_id,
    bundled_provider,
)
from core.prices.prices_file import load_prices_file
from core.prices.rates import (
    TIER_AUTO,
    ZERO,
    Rates,
    Tiers,
    Usage,
    check_service_tier,
    check_tokens,
)

LOG = logging.getLogger(__name__)

# Rates (and misses) cached per process; bounded because model names come from callers.
RATES_CACHE_MAX = 4_096
# The prices file is stat'ed at most this often, on the lookup path: a change is in force
# within about a second, and a reserve does not pay a system call.
PRICES_FILE_CHECK_S = 1.0


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
        # By (provider, model name): the priced model's one name (model_name), None for none.
        self._names: dict[tuple[str | None, str], str | None] = {}
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
        self._names.clear()  # a name the file adds, drops or re-prices may name another model
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

    def provider_of(self, model: str) -> str | None:
        """The genai-prices provider whose bundled entry prices `model` when no provider is
        named (a sidecar's call), or None where only the prices file names it."""
        return bundled_provider(model)

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
        # 0 only for a model that writes nothing (an embedding model: no output rate), below.
        check_tokens(output_tokens_max, "max_output_tokens", minimum=0)
        if type(choices) is not int or not 1 <= choices <= CHOICES_MAX:
            raise InvalidRequest(f"n must be an integer from 1 to {CHOICES_MAX}", field="n")
        r = self.rates(model, provider)
        if not output_tokens_max and (r.output is not None or r.output_audio is not None):
            check_tokens(output_tokens_max, "max_output_tokens", minimum=1)
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
            if output_tokens_max and tier.output is None and tier.output_audio is None:
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
                cache_1h=media.cache_1h, any_modality=bool(referred)))
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
        (`media.web_searches`), or for a model that searches as it chooses (or a search tool
        the request gives no bound: `web_search_field` with no searches), the prices file's."""
        if media.web_search_field and not media.web_searches:
            if rates.web_searches_max is None:
                raise ModelUnbounded(
                    f"{media.web_search_field} lets model {model!r} run as many web searches as "
                    "it chooses, each billed a fee, and nothing in the request bounds how many: "
                    "set web_searches_max for it in the prices file", model=model,
                    component="web_search", field=media.web_search_field)
            return rates.web_searches_max * media.web_search_runs
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

    def model_name(self, model: str, provider: str | None = None) -> str | None:
        """The priced model's one name for `model`: what budgets name it by (models.allow,
        per_model), so that one model is one name, one price, one counter. The bundled table's
        entry that names it, whichever provider's (a dated snapshot or alias of it: 'gpt-5-2025-
        08-07' is 'gpt-5', 'claude-haiku-4-5-20251001' is 'claude-haiku-4-5'), whatever the
        prices file says of the name: a prices file entry for a dated name would otherwise be a
        model of its own, beside the family a budget limits. Else `provider`'s entry of it, else
        the prices file's name. A snapshot dated with '@' (Vertex's claude-sonnet-4-5@20250929)
        is the one dated with '-'. Lower case, as the table looks names up; None for a name no
        table knows. Cached per process, as rates are."""
        if not isinstance(model, str) or not 0 < len(model) <= MODEL_NAME_LEN_MAX:
            return None
        # Looked up in lower case, as genai-prices looks names up.
        key = model.lower()
        if (provider, key) in self._names:
            return self._names[(provider, key)]
        found = None
        for name in dict.fromkeys((key, key.replace("@", "-"))):
            found = bundled_model_id(name) or (
                bundled_model_id(name, provider) if provider else None)
            if found is not None:
                break
        if found is None and key in self._overrides:
            found = key
        if provider is not None and "/" in key and found in (key, None):
            found = self._as_vendors(key, provider) or found
        if len(self._names) < RATES_CACHE_MAX:
            self._names[(provider, key)] = found
        return found

    def _as_vendors(self, key: str, provider: str) -> str | None:
        """A router's name of a vendor's model (OpenRouter's 'openai/gpt-5') as the vendor's
        model's one name ('gpt-5'), where `provider`'s table prices it at that model's token
        rates: one model, one counter, whoever routes it. A router's entry priced otherwise is a
        model of its own, as the router bills it."""
        base = bundled_model_id(key.partition("/")[2])
        if base is None:
            return None
        try:
            routed, own = self.rates(key, provider), self.rates(base)
        except (ModelUnpriced, ModelUnbounded):
            return None
        return base if _token_rates(routed) == _token_rates(own) else None

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


def _token_rates(rates: Rates) -> tuple[Tiers | None, ...]:
    """What a model's text tokens cost: two entries that agree on these price one model."""
    return rates.input, rates.output, rates.cached_input, rates.cache_write
