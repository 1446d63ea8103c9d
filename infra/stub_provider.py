"""A stub OpenAI-compatible and Anthropic provider that keeps its own bill: the witness of spend.

The ceiling is proved against what a provider bills, never against what the service says it
spent. This stub counts the tokens of every call it serves and prices them from its own table
(infra/stub_prices.py), sharing nothing with the service it judges: no `core`, no genai-prices.
It sees every way a gateway could hold less than a provider charges: images, audio and files
counted as OpenAI documents them, prompt-cache reads and writes, reasoning tokens, `n > 1`,
priority service tiers, per-request fees, search models' per-call search fees, OpenRouter's web
plugin and fallback models, and calls billed and then failed or cut off.

    python -m infra.stub_provider --port 8900 --seed 7 [--prices-file table.json]

Routes:
  POST /v1/chat/completions   streaming (SSE chunks, then `data: [DONE]`) and not; `n` choices.
  POST /v1/responses          streaming (`response.created` ... `response.completed`) and not.
  POST /v1/messages           Anthropic's Messages API, and /v1/messages/count_tokens: see
                              infra/stub_anthropic.py. One app serves both providers so that one
                              bill, one /control and one process judge every gateway route.
  GET  /billing               the bill: tallies in total and per model, and a `log` of the most
                              recent requests (`?log=0` leaves the log out).
  POST /billing/reset         start a new bill (and empty the prompt caches and stored responses).
  GET, POST /control          faults and settings for the next calls (below).
  GET  /health/live           200 while it answers.

Input is counted by infra/stub_input.py (text, images, audio, files, tools). Output is at most
the cap (`max_completion_tokens`, `max_tokens`, `max_output_tokens`; 4,096 when none is sent),
drawn at random with mean `--output-tokens-mean` after a latency in [`--latency-ms-min`,
`--latency-ms-max`], from one random.Random(seed): calls made one after another are
reproducible. A reasoning model spends part of each answer on reasoning tokens (within the cap,
billed as output): a share set by the reasoning effort. Each of `n` choices is its own draw.

Prompt cache: OpenAI caches prompt prefixes of at least 1,024 tokens, and a hit is reported in
128-token steps (https://developers.openai.com/api/docs/guides/prompt-caching). The stub caches
every prefix of a billed call that ends at a message boundary; a later call on the same model
that starts with one reads it at the cached-input rate. A model with a cache-write rate in the
table is billed that rate for the cached tokens a call wrote, and reports them.

Search models: a model whose table entry has `web_search_usd_per_call` (OpenAI's chat search
models, gpt-4o-search-preview and the like) searches before every answer, on either route, and
each call it serves is billed that fee once on top of its tokens: `web_search_calls` in the bill
(1 on the call's usage, summed in the tallies). The search content it reads is not billed, as
OpenAI documents for these models. Chat's `web_search_options` (`search_context_size`,
`user_location`) is taken by a search model and changes nothing billed; other models refuse it.

Upstream fields: the /control setting `upstream_fields` says whose request fields the OpenAI
routes bill. `openai` (the default): OpenAI's alone; OpenRouter's `plugins` and `models` are
ignored, as any field the stub does not read. `openrouter`: as OpenRouter bills them
(https://openrouter.ai/docs/features/web-search, .../guides/routing/model-fallbacks):
  plugins: [{"id": "web", "max_results": N, "engine": "exa"}]
      fetches N web results (the table's `openrouter.web_plugin_results_default` when absent),
      billed at the table's `openrouter.web_plugin_usd_per_1k_results`: `web_plugin_results`
      in the bill. Another plugin, or the `native` engine (billed at the model provider's own
      search price, which the table does not hold), is refused.
  models: [name, ...]
      the fallbacks OpenRouter may serve the call with, billed at the model that served it.
      The stub bills the worst: the call at whichever of the requested model and the listed
      models the table prices for all of the call makes it dearest (a search model with its
      per-call fee), and answers under that model's name. The bill logs it as the call's
      `model` (and tallies it there), the requested one as `model_requested`.

When a call is billed: in full, once its answer is decided, before the first byte is sent,
whether or not the client is still there to read it. A call the stub refuses (bad request,
unknown model, wrong key, a fault that fails before serving) is not billed. Every request is
counted in `requests` and logged all the same.

Faults, per call by header, or for the next `calls` calls (all, when absent) by POST /control:
  X-Stub-Fail-Status: S          fail_status: S           answer S (400-599), bill nothing
  X-Stub-Hang: 1                 hang: true               never answer, bill nothing
  X-Stub-Fail-After-Billing: S   fail_after_billing: S    bill in full, then answer S
  X-Stub-Hang-After-Billing: 1   hang_after_billing: true bill in full, then never answer
  X-Stub-Break-After-Events: K   break_after_events: K    bill in full, send K stream events
                                                          (a non-stream: half its body), then
                                                          drop the connection
  X-Stub-Continuous-Usage: 1     continuous_usage: true   every chat chunk carries the usage so
                                                          far (vLLM's continuous_usage_stats;
                                                          also by stream_options)
  X-Stub-Cached-Tokens: N        cached_tokens: N         report and bill N prompt tokens cached
Per call only: `X-Stub-Output-Tokens: N` answers exactly min(N, cap) tokens a choice;
`X-Stub-Reasoning-Tokens: N` makes N of them reasoning. Headers win over /control, whose fault
set each POST replaces (`{}` clears it). Settings a POST gives replace theirs, and stay until
set again: `images` {url: [width, height]} for http(s) images the stub cannot fetch; `files`
{file id, file URL or item id: {"bytes": N, "pages": P, "image": [w, h]}}; `prompt_cache`
(true by default); `default_service_tier`, what `auto` is served at (`default`);
`upstream_fields` (`openai`; above); `answer_padding_bytes` (0): every answer that is not
streamed (200, on either provider's routes) carries that many bytes of whitespace after its
opening brace, still JSON, sent as they are made (chunked, with no length): an answer as large as
a test needs, at no memory to the stub. The Messages
API adds `X-Stub-Web-Searches` / `web_searches` and the settings `web_search_result_tokens` and
`clock_offset_s` (infra/stub_anthropic.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from enum import StrEnum
from fractions import Fraction
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from infra.processes import free_port, tls_context, wait_ready
from infra.processes import stop as stop_process
from infra.stub_anthropic import (
    WEB_SEARCH_RESULT_TOKENS_DEFAULT,
    WEB_SEARCH_RESULT_TOKENS_MIN,
    MessagesApi,
)
from infra.stub_bill import Bill, CallRecord, Tally, Usage
from infra.stub_faults import (
    CONTROL_SETTINGS,
    FAULT_HEADERS,
    Fault,
    count,
    fault_from,
    hang,
    registry_files,
    registry_images,
    sent,
)
from infra.stub_input import (
    InputError,
    Prompt,
    Registry,
    chat_prompt,
    responses_prompt,
)
from infra.stub_prices import TIER_STANDARD, ModelPrices, StubPrices, cost_micros, unpriced
from infra.stub_wire import (
    WORDS,
    Choice,
    Served,
    chat_body,
    chat_events,
    responses_body,
    responses_events,
)

__all__ = ["Bill", "CallRecord", "StubProvider", "StubProviderApp", "Tally", "Usage",
           "fetch_bill", "reset_bill"]

# OpenAI answers up to the model's output limit when no cap is sent; the stub stops here.
OUTPUT_TOKENS_UNCAPPED_MAX = 4_096
# OpenAI's limit on choices a chat call may ask for.
CHOICES_MAX = 128
# Prompt cache (https://developers.openai.com/api/docs/guides/prompt-caching): prefixes from
# 1,024 tokens, hits reported in 128-token steps.
CACHE_TOKENS_MIN = 1_024
CACHE_TOKENS_STEP = 128
# The cache and the stored responses are bounded: a long load run must not grow the stub
# without end. The oldest entries go first.
CACHE_PREFIXES_MAX = 10_000
RESPONSES_STORED_MAX = 10_000
# The share of an answer a reasoning model spends reasoning, by requested effort (the stub's own
# choice: providers document no share, only that reasoning tokens count as output).
REASONING_SHARE = {"minimal": Fraction(0), "low": Fraction(1, 4), "medium": Fraction(1, 2),
                   "high": Fraction(3, 4)}
REASONING_EFFORT_DEFAULT = "medium"
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0
# A stub in a process of its own imports its dependencies first: seconds on a busy machine.
PROCESS_START_TIMEOUT_S = 30.0
# Idle keep-alive connections are kept this long (uvicorn's default is 5 s): a client reusing a
# pooled connection at the moment the server closes it gets a spurious read error.
KEEP_ALIVE_S = 120
# Calls still open at shutdown (a hung one) are cut after this long.
GRACEFUL_SHUTDOWN_S = 1
BILL_FETCH_TIMEOUT_S = 10.0
# The status logged for a call that was never answered (it hung until the client left).
STATUS_NO_ANSWER = 0
# Whose request fields the OpenAI routes bill (the /control setting `upstream_fields`): OpenAI's
# alone, or OpenRouter's too (its web plugin and fallback models), the first by default.
UPSTREAM_OPENAI = "openai"
UPSTREAM_OPENROUTER = "openrouter"
UPSTREAM_FIELDS = (UPSTREAM_OPENAI, UPSTREAM_OPENROUTER)
PROVIDER_SETTINGS = CONTROL_SETTINGS | {"upstream_fields", "answer_padding_bytes"}
# The setting `answer_padding_bytes` pads answers in pieces of this size, made as they are sent.
PADDING_PIECE_BYTES = 1024 * 1024
# What OpenAI's chat search models take in `web_search_options`
# (https://developers.openai.com/api/docs/guides/tools-web-search).
WEB_SEARCH_OPTIONS = frozenset({"search_context_size", "user_location"})
SEARCH_CONTEXT_SIZES = ("low", "medium", "high")
# OpenRouter's web plugin engines the stub prices: Exa's results, at the table's rate. "native"
# search is billed at the model provider's own search price, which the table does not hold.
WEB_PLUGIN_ENGINES = ("exa",)


class Api(StrEnum):
    CHAT = "chat.completions"
    RESPONSES = "responses"


@dataclass(frozen=True)
class Decided:
    """A call decided and not yet billed: the answer, the model's prices, the counted input,
    and the model it is billed at (the requested one, or a dearer fallback of OpenRouter's)."""

    served: Served
    prices: ModelPrices
    prompt: Prompt
    billed: ModelPrices
    model_requested: str


class ProviderError(Exception):
    """An answer in OpenAI's error shape."""

    def __init__(self, status: int, message: str, code: str, error_type: str,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.error_type = status, message, code, error_type
        self.param = param

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.error_type, "param": self.param,
                          "code": self.code}}
        return JSONResponse(body, status_code=self.status)


def invalid(message: str, param: str | None = None) -> ProviderError:
    return ProviderError(400, message, "invalid_request", "invalid_request_error", param)


def _cache_step(tokens: int) -> int:
    """Cached tokens as OpenAI reports them: 0 below 1,024, else down to a 128-token step."""
    if tokens < CACHE_TOKENS_MIN:
        return 0
    return CACHE_TOKENS_MIN + (tokens - CACHE_TOKENS_MIN) // CACHE_TOKENS_STEP * CACHE_TOKENS_STEP


def _output_cap(api: Api, body: dict[str, Any], model: ModelPrices) -> int:
    fields_ = ("max_output_tokens",) if api is Api.RESPONSES else (
        "max_completion_tokens", "max_tokens")
    if api is Api.CHAT and model.reasoning and body.get("max_tokens") is not None:
        # As OpenAI answers a reasoning model: its cap must cover the hidden tokens too.
        raise invalid("max_tokens is not supported with this model: use max_completion_tokens",
                      "max_tokens")
    caps = [body[f] for f in fields_ if body.get(f) is not None]
    if not caps:
        return OUTPUT_TOKENS_UNCAPPED_MAX
    cap = caps[0]
    if type(cap) is not int or cap < 1:
        raise invalid(f"{fields_[0]} must be a positive integer", fields_[0])
    return cap


def _reasoning_share(api: Api, body: dict[str, Any], model: ModelPrices) -> Fraction:
    if api is Api.CHAT:
        effort = body.get("reasoning_effort")
    else:
        reasoning = body.get("reasoning")
        effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
        if reasoning is not None and not isinstance(reasoning, dict):
            raise invalid("reasoning must be an object", "reasoning")
    if effort is None:
        return REASONING_SHARE[REASONING_EFFORT_DEFAULT] if model.reasoning else Fraction(0)
    if not model.reasoning:
        raise invalid(f"reasoning effort is not supported with {model.name}", "reasoning_effort")
    if effort not in REASONING_SHARE:
        raise invalid(f"reasoning effort must be one of {', '.join(REASONING_SHARE)}",
                      "reasoning_effort")
    return REASONING_SHARE[str(effort)]


def _function_name(spec: object) -> str | None:
    """The function a tool or tool choice names: `name` (Responses) or `function.name` (chat)."""
    if not isinstance(spec, dict):
        return None
    function = spec.get("function")
    name = spec.get("name") or (function.get("name") if isinstance(function, dict) else None)
    return name if isinstance(name, str) else None


def _forced_tool(body: dict[str, Any]) -> str | None:
    """The function a call must answer with: `tool_choice` "required" or a named function."""
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        return _function_name(choice)
    tools = body.get("tools")
    if choice == "required" and isinstance(tools, list) and tools:
        return _function_name(tools[0])
    return None


def _web_search_options(options: object, prices: ModelPrices) -> None:
    """Chat's `web_search_options`: taken by a search model (whose fee is per call, whatever
    they say), refused by any other."""
    if options is None:
        return
    if prices.web_search_call_micros is None:
        raise InputError(f"web_search_options is for search models; {prices.name} is not one",
                         "web_search_options")
    if not isinstance(options, dict) or set(options) - WEB_SEARCH_OPTIONS:
        raise InputError(f"web_search_options is an object of {sorted(WEB_SEARCH_OPTIONS)}",
                         "web_search_options")
    size = options.get("search_context_size")
    location = options.get("user_location")
    if (size is not None and size not in SEARCH_CONTEXT_SIZES) or not isinstance(
            location, dict | None):
        raise InputError("web_search_options: search_context_size is one of "
                         f"{', '.join(SEARCH_CONTEXT_SIZES)}, user_location an object",
                         "web_search_options")


def _fallback_models(doc: object) -> tuple[str, ...]:
    """OpenRouter's `models`: the models a call may fall back to, in order."""
    if doc is None:
        return ()
    if not isinstance(doc, list) or not all(isinstance(m, str) for m in doc):
        raise invalid("models must be a list of model names", "models")
    return tuple(doc)


def _header_count(raw: str | None, what: str, minimum: int) -> int | None:
    if raw is None:
        return None
    try:
        return count(raw, what, minimum)
    except ValueError as exc:
        raise invalid(str(exc)) from exc


class StubProviderApp:
    """The provider's state (prices, random draws, bill, faults, caches) and its routes."""

    def __init__(
        self,
        *,
        seed: int,
        latency_ms_min: int,
        latency_ms_max: int,
        output_tokens_mean: int,
        prices: StubPrices,
        api_key: str | None = None,
    ) -> None:
        if not 0 <= latency_ms_min <= latency_ms_max or output_tokens_mean < 1:
            raise ValueError("need 0 <= latency_ms_min <= latency_ms_max and a positive mean")
        self.rng = random.Random(seed)
        self.latency_ms_min, self.latency_ms_max = latency_ms_min, latency_ms_max
        self.output_tokens_mean = output_tokens_mean
        self.prices = prices
        self.api_key = api_key
        self.bill = Bill()
        self.fault = Fault()
        self.registry = Registry()
        self.prompt_cache_on = True
        self.default_service_tier = TIER_STANDARD
        self.upstream_fields = UPSTREAM_OPENAI
        self.answer_padding_bytes = 0
        self.web_search_result_tokens = WEB_SEARCH_RESULT_TOKENS_DEFAULT
        # Added to the clock the prompt caches expire by, so a test can pass 5 minutes at once.
        self.clock_offset_s = 0.0
        self.cache: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        self.stored: OrderedDict[str, int] = OrderedDict()  # response id -> context tokens
        self.messages = MessagesApi(self)
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/messages", self.messages_create, methods=["POST"]),
            Route("/v1/messages/count_tokens", self.messages.count_tokens, methods=["POST"]),
            Route("/billing", self.get_billing, methods=["GET"]),
            Route("/billing/reset", self.reset_billing, methods=["POST"]),
            Route("/control", self.control, methods=["GET", "POST"]),
            Route("/health/live", self.live, methods=["GET"]),
        ])

    # -- routes ------------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        return self._padded(await self._call(Api.CHAT, request))

    async def responses(self, request: Request) -> Response:
        return self._padded(await self._call(Api.RESPONSES, request))

    async def messages_create(self, request: Request) -> Response:
        return self._padded(await self.messages.create(request))

    async def get_billing(self, request: Request) -> Response:
        return JSONResponse(self.bill.to_json(with_log=request.query_params.get("log") != "0"))

    async def reset_billing(self, request: Request) -> Response:
        self.bill = Bill()
        self.cache.clear()
        self.stored.clear()
        self.messages.reset()
        return JSONResponse(self.bill.to_json())

    async def control(self, request: Request) -> Response:
        if request.method == "POST":
            try:
                doc = await request.json()
                if not isinstance(doc, dict):
                    raise ValueError("the control body is an object")
                unknown = set(doc) - PROVIDER_SETTINGS - {*FAULT_HEADERS.values(), "calls"}
                if unknown:
                    raise ValueError(f"unknown control fields {sorted(unknown)}")
                self._apply_settings(doc)
            except (ValueError, TypeError) as exc:
                return invalid(f"control body: {exc}").response()
        return JSONResponse({**self.fault.to_json(), "prompt_cache": self.prompt_cache_on,
                             "default_service_tier": self.default_service_tier,
                             "upstream_fields": self.upstream_fields,
                             "answer_padding_bytes": self.answer_padding_bytes,
                             "web_search_result_tokens": self.web_search_result_tokens,
                             "clock_offset_s": self.clock_offset_s,
                             "images": {u: list(s) for u, s in self.registry.images.items()},
                             "files": sorted(self.registry.files)})

    def _apply_settings(self, doc: dict[str, Any]) -> None:
        fault = fault_from({k: v for k, v in doc.items() if k not in PROVIDER_SETTINGS})
        images = registry_images(doc["images"]) if "images" in doc else None
        files = registry_files(doc["files"]) if "files" in doc else None
        prompt_cache = doc.get("prompt_cache", self.prompt_cache_on)
        tier = doc.get("default_service_tier", self.default_service_tier)
        if type(prompt_cache) is not bool or not isinstance(tier, str):
            raise ValueError("prompt_cache is a boolean, default_service_tier a string")
        upstream = doc.get("upstream_fields", self.upstream_fields)
        if upstream not in UPSTREAM_FIELDS:
            raise ValueError(f"upstream_fields is one of {', '.join(UPSTREAM_FIELDS)}")
        search_tokens = count(doc.get("web_search_result_tokens", self.web_search_result_tokens),
                              "web_search_result_tokens", WEB_SEARCH_RESULT_TOKENS_MIN)
        padding = count(doc.get("answer_padding_bytes", self.answer_padding_bytes),
                        "answer_padding_bytes", 0)
        offset_s = doc.get("clock_offset_s", self.clock_offset_s)
        if type(offset_s) not in (int, float) or not 0 <= offset_s < math.inf:
            raise ValueError("clock_offset_s is a number of seconds, 0 or more")
        # Validated whole before anything changes: a refused body changes nothing.
        self.fault = fault
        self.registry.images = self.registry.images if images is None else images
        self.registry.files = self.registry.files if files is None else files
        self.prompt_cache_on, self.default_service_tier = prompt_cache, tier
        self.upstream_fields = str(upstream)
        self.answer_padding_bytes = padding
        self.web_search_result_tokens, self.clock_offset_s = search_tokens, float(offset_s)

    async def live(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    def _padded(self, response: Response) -> Response:
        """A whole JSON answer (not a stream, not an error) with `answer_padding_bytes` of
        whitespace after its opening brace, sent as it is made."""
        if (not self.answer_padding_bytes or response.status_code != 200
                or not isinstance(response, JSONResponse)):
            return response
        body = bytes(response.body)
        headers = {k: v for k, v in response.headers.items() if k != "content-length"}
        return StreamingResponse(padded(body, self.answer_padding_bytes), headers=headers)

    # -- shared by both APIs -----------------------------------------------------------------

    def now_s(self) -> float:
        """The clock prompt caches expire by: monotonic, plus what /control skipped ahead."""
        return time.monotonic() + self.clock_offset_s

    def latency_s(self) -> float:
        return self.rng.uniform(self.latency_ms_min, self.latency_ms_max) / 1000

    def draw_output_tokens(self) -> int:
        """One answer's length before any cap: at least 1, exponential around the mean."""
        return 1 + int(self.rng.expovariate(1 / self.output_tokens_mean))

    def take_fault(self, request: Request) -> Fault:
        """The fault for this call: its X-Stub-* headers, else the next of /control's.

        Raises ValueError for a header that does not parse."""
        given = {f: request.headers[h] for h, f in FAULT_HEADERS.items() if h in request.headers}
        if given:
            return fault_from(given)
        if self.fault.active:
            if self.fault.calls_left is not None:
                self.fault.calls_left -= 1
            return replace(self.fault, calls_left=None)
        return Fault()

    # -- one call ----------------------------------------------------------------------------

    async def _call(self, api: Api, request: Request) -> Response:
        self.bill.requests += 1
        model: str | None = None
        stream = False
        fault = Fault()
        try:
            self._authorize(request)
            fault = self._fault_for(request)
            if fault.hang:
                await hang(request)
                self._log(api, model, STATUS_NO_ANSWER, None, stream, fault)
                return Response(status_code=504)  # nobody reads it: the client has gone
            if fault.fail_status is not None:
                raise ProviderError(fault.fail_status, f"stub failure {fault.fail_status} on "
                                    "request", "stub_failure", "server_error")
            body = await self._body(request)
            model = body.get("model") if isinstance(body.get("model"), str) else None
            stream = body.get("stream") is True
            decided = self._serve(api, body, request, fault)
        except ProviderError as exc:
            self._log(api, model, exc.status, None, stream, fault)
            return exc.response()
        await asyncio.sleep(self.latency_s())
        # Billed here, before the first byte, whether or not the client is still there.
        status = fault.fail_after_billing or (STATUS_NO_ANSWER if fault.hang_after_billing
                                              else 200)
        self._charge(api, decided, body, stream, status, fault)
        served = decided.served
        if fault.hang_after_billing:
            await hang(request)
            return Response(status_code=504)
        if fault.fail_after_billing is not None:
            return ProviderError(fault.fail_after_billing, f"stub failure {status} after the "
                                 "call was billed", "stub_failure", "server_error").response()
        if stream:
            events = self._events(api, served, body, fault)
            if fault.break_after_events is not None:
                events = events[:min(fault.break_after_events, len(events) - 1)]
            return StreamingResponse(sent(events, broken=fault.break_after_events is not None),
                                     media_type="text/event-stream")
        doc = chat_body(served) if api is Api.CHAT else responses_body(served, body)
        if fault.break_after_events is not None:
            raw = json.dumps(doc).encode()
            return StreamingResponse(sent([raw[:len(raw) // 2]], broken=True),
                                     media_type="application/json")
        return JSONResponse(doc)

    def _authorize(self, request: Request) -> None:
        if self.api_key is not None and request.headers.get("authorization") != (
            f"Bearer {self.api_key}"
        ):
            raise ProviderError(401, "incorrect API key", "invalid_api_key",
                                "invalid_request_error")

    def _fault_for(self, request: Request) -> Fault:
        try:
            return self.take_fault(request)
        except ValueError as exc:
            raise invalid(f"X-Stub-* header: {exc}") from exc

    async def _body(self, request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ClientDisconnect as exc:  # gone before it finished sending: nothing to serve
            raise ProviderError(499, "the client went away", "client_disconnected",
                                "invalid_request_error") from exc
        except ValueError as exc:
            raise invalid("the body is not JSON") from exc
        if not isinstance(body, dict):
            raise invalid("the body must be a JSON object")
        return body

    def _serve(self, api: Api, body: dict[str, Any], request: Request,
               fault: Fault) -> Decided:
        """Decide the whole answer and its usage, or refuse the request (nothing billed)."""
        name = body.get("model")
        if not isinstance(name, str):
            raise invalid("model is required", "model")
        prices = self.prices.model(name)
        # An unpriced model cannot be billed, so it is not served; nor is Anthropic's model here.
        if prices is None or prices.messages is not None:
            raise ProviderError(404, f"the model {name!r} does not exist", "model_not_found",
                                "invalid_request_error", "model")
        tier = self._tier(body, prices)
        openrouter = self.upstream_fields == UPSTREAM_OPENROUTER
        plugin_results = self._web_plugin_results(body.get("plugins")) if openrouter else 0
        fallbacks = _fallback_models(body.get("models")) if openrouter else ()
        prompt = self._prompt(api, body, prices)
        choices = self._choices(api, body, prices, request)
        audio_output = self._audio_output(api, body, prices)
        rejected = self._rejected_prediction(api, body, len(choices))
        cached, written = self._cached(prices, prompt, fault)
        output_tokens = sum(c.output_tokens for c in choices) + rejected
        usage = Usage(
            input_tokens=prompt.tokens, cached_input_tokens=cached, cache_write_tokens=written,
            audio_input_tokens=prompt.audio_tokens, image_input_tokens=prompt.image_tokens,
            file_input_tokens=prompt.file_tokens, output_tokens=output_tokens,
            reasoning_tokens=sum(c.reasoning_tokens for c in choices),
            audio_output_tokens=sum(len(c.words) for c in choices) if audio_output else 0,
            rejected_prediction_tokens=rejected,
            # A search model searches before every answer: one fee a call, on top of tokens.
            web_search_calls=int(prices.web_search_call_micros is not None),
            web_plugin_results=plugin_results,
        )
        billed_name, billed, tier, usage = self._dearest(name, prices, tier, usage, fallbacks)
        answer_id = ("chatcmpl-" if api is Api.CHAT else "resp_") + secrets.token_hex(12)
        served = Served(answer_id, billed_name, tier, tuple(choices), usage,
                        reports_cache_writes=prices.standard.cache_write is not None,
                        audio_output=audio_output)
        return Decided(served, prices, prompt, billed, name)

    def _web_plugin_results(self, plugins: object) -> int:
        """The web results OpenRouter's `plugins` fetch: a `web` plugin's `max_results`, else the
        table's default. A plugin the stub cannot price is refused, not served free."""
        if plugins is None:
            return 0
        if not isinstance(plugins, list) or not all(
                isinstance(p, dict) and isinstance(p.get("id"), str) for p in plugins):
            raise invalid("plugins must be a list of objects with an id", "plugins")
        ids = [p["id"] for p in plugins]
        if set(ids) - {"web"} or len(ids) != len(set(ids)):
            raise invalid("the stub serves the web plugin only, once", "plugins")
        if not plugins:
            return 0
        [web] = plugins
        rates = self.prices.openrouter
        if rates is None:
            raise invalid("the stub's table prices no web plugin", "plugins")
        if web.get("engine") not in (None, *WEB_PLUGIN_ENGINES):
            raise invalid(f"the web plugin's engine is one of {', '.join(WEB_PLUGIN_ENGINES)}",
                          "plugins")
        results = web.get("max_results", rates.web_results_default)
        if type(results) is not int or results < 1:
            raise invalid("the web plugin's max_results must be a positive integer", "plugins")
        return results

    def _dearest(self, name: str, prices: ModelPrices, tier: str, usage: Usage,
                 fallbacks: tuple[str, ...]) -> tuple[str, ModelPrices, str, Usage]:
        """The model a call is billed at, with its tier and usage: the requested one, or the
        dearest of OpenRouter's fallback `models` that the table prices for the whole call (a
        fallback may serve any call, so the witness bills the worst). Ties keep the earlier."""
        openrouter = self.prices.openrouter
        best = (name, prices, tier, usage)
        best_micros = cost_micros(prices, tier, usage, openrouter=openrouter)
        for other_name in fallbacks:
            other = self.prices.model(other_name)
            if other is None:
                continue
            other_tier = tier if tier == TIER_STANDARD or tier in other.tiers else TIER_STANDARD
            # A search model searches on whichever call it serves; another model never does.
            other_usage = replace(
                usage, web_search_calls=int(other.web_search_call_micros is not None))
            if unpriced(other, other_tier, other_usage, openrouter=openrouter) is not None:
                continue
            micros = cost_micros(other, other_tier, other_usage, openrouter=openrouter)
            if micros > best_micros:
                best, best_micros = (other_name, other, other_tier, other_usage), micros
        return best

    def _tier(self, body: dict[str, Any], prices: ModelPrices) -> str:
        asked = body.get("service_tier")
        if asked in (None, "auto"):
            tier = self.default_service_tier
            # `auto` is served at the project's default tier where the model has it.
            return tier if tier == TIER_STANDARD or tier in prices.tiers else TIER_STANDARD
        if asked == TIER_STANDARD or (isinstance(asked, str) and asked in prices.tiers):
            return str(asked)
        raise invalid(f"service_tier {asked!r} is not available for {prices.name}",
                      "service_tier")

    def _prompt(self, api: Api, body: dict[str, Any], prices: ModelPrices) -> Prompt:
        try:
            if api is Api.CHAT:
                _web_search_options(body.get("web_search_options"), prices)
                return chat_prompt(body, prices, self.registry)
            for unserved in ("conversation", "prompt", "background"):
                if body.get(unserved) not in (None, False):
                    raise InputError(f"{unserved} is not served by the stub", unserved)
            if body.get("n") is not None:
                raise InputError("n is not a Responses parameter", "n")
            previous = body.get("previous_response_id")
            previous_tokens = 0
            if previous is not None:
                if previous not in self.stored:
                    raise InputError(f"previous response {previous!r} not found",
                                     "previous_response_id")
                previous_tokens = self.stored[str(previous)]
            return responses_prompt(body, prices, self.registry, previous_tokens)
        except InputError as exc:
            raise invalid(str(exc), exc.param) from exc

    def _choices(self, api: Api, body: dict[str, Any], prices: ModelPrices,
                 request: Request) -> list[Choice]:
        count = 1 if api is Api.RESPONSES else body.get("n", 1)
        if type(count) is not int or not 1 <= count <= CHOICES_MAX:
            raise invalid(f"n must be an integer from 1 to {CHOICES_MAX}", "n")
        cap = _output_cap(api, body, prices)
        share = _reasoning_share(api, body, prices)
        forced = _header_count(request.headers.get("x-stub-output-tokens"),
                               "X-Stub-Output-Tokens", 1)
        forced_reasoning = _header_count(request.headers.get("x-stub-reasoning-tokens"),
                                         "X-Stub-Reasoning-Tokens", 0)
        if forced_reasoning and not prices.reasoning:
            raise invalid(f"{prices.name} is not a reasoning model")
        tool = _forced_tool(body)
        choices = []
        for index in range(count):
            drawn = forced or self.draw_output_tokens()
            total = min(cap, drawn)
            reasoning = (min(total, forced_reasoning) if forced_reasoning is not None
                         else math.floor(total * share))
            visible = total - reasoning
            words = tuple(WORDS[i % len(WORDS)] for i in range(visible))
            finish = "length" if total == cap else "stop"
            tool_call = None
            if tool is not None:
                tool_call = ("call_" + secrets.token_hex(8), tool,
                             json.dumps({"text": " ".join(words)}))
                finish = "length" if total == cap else "tool_calls"
            choices.append(Choice(index, words, reasoning, finish, tool_call))
        return choices

    def _audio_output(self, api: Api, body: dict[str, Any], prices: ModelPrices) -> bool:
        modalities = body.get("modalities") or []
        if api is Api.RESPONSES or "audio" not in modalities:
            return False
        if prices.standard.audio_output is None:
            raise invalid(f"{prices.name} does not produce audio", "modalities")
        if body.get("stream") is True:
            raise invalid("the stub does not stream audio", "stream")
        return True

    def _rejected_prediction(self, api: Api, body: dict[str, Any], choices: int) -> int:
        """Predicted output the model did not use: billed as output on top of the answer
        (https://developers.openai.com/api/docs/guides/predicted-outputs). The stub uses none."""
        prediction = body.get("prediction")
        if api is Api.RESPONSES or prediction is None:
            return 0
        content = prediction.get("content") if isinstance(prediction, dict) else None
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str) or choices != 1:
            raise invalid("prediction needs content, and n = 1", "prediction")
        return math.ceil(len(content.encode()) / 4)

    def _cached(self, prices: ModelPrices, prompt: Prompt, fault: Fault) -> tuple[int, int]:
        """(cached tokens read, tokens written) for this prompt."""
        cacheable = prompt.tokens - prompt.audio_tokens
        if fault.cached_tokens is not None:
            return min(fault.cached_tokens, cacheable), 0
        if not self.prompt_cache_on:
            return 0, 0
        matched = next((tokens for digest, tokens in reversed(prompt.prefixes)
                        if (prices.name, digest) in self.cache), 0)
        cached = _cache_step(matched)
        written = 0
        if prices.standard.cache_write is not None and prompt.prefixes:
            written = max(0, _cache_step(prompt.prefixes[-1][1]) - cached)
        return cached, written

    def _charge(self, api: Api, decided: Decided, body: dict[str, Any], stream: bool,
                status: int, fault: Fault) -> None:
        served, prices = decided.served, decided.prices
        cost = cost_micros(decided.billed, served.service_tier, served.usage,
                           openrouter=self.prices.openrouter)
        self._log(api, served.model, status, served.usage, stream, fault, cost,
                  served.service_tier, decided.model_requested)
        if self.prompt_cache_on and fault.cached_tokens is None:
            for digest, tokens in decided.prompt.prefixes:
                if tokens >= CACHE_TOKENS_MIN:
                    self.cache[(prices.name, digest)] = None
                    self.cache.move_to_end((prices.name, digest))
            while len(self.cache) > CACHE_PREFIXES_MAX:
                self.cache.popitem(last=False)
        if api is Api.RESPONSES and body.get("store", True) is not False:
            choice = served.choices[0]
            self.stored[served.answer_id] = served.usage.input_tokens + len(choice.words)
            while len(self.stored) > RESPONSES_STORED_MAX:
                self.stored.popitem(last=False)

    def _log(self, api: Api, model: str | None, status: int, usage: Usage | None, stream: bool,
             fault: Fault, cost: int = 0, tier: str | None = None,
             model_requested: str | None = None) -> None:
        self.bill.record(CallRecord(
            api=api.value, model=model, status=status, billed=usage is not None,
            cost_micros=cost, usage=usage, stream=stream, service_tier=tier, fault=fault.name,
            model_requested=None if model_requested == model else model_requested,
        ))

    def _events(self, api: Api, served: Served, body: dict[str, Any],
                fault: Fault) -> list[bytes]:
        if api is Api.RESPONSES:
            return responses_events(served, body)
        options = body.get("stream_options") or {}
        options = options if isinstance(options, dict) else {}
        return chat_events(
            served, include_usage=options.get("include_usage") is True,
            continuous_usage=fault.continuous_usage
            or options.get("continuous_usage_stats") is True,
        )


# -- running it ------------------------------------------------------------------------------


@dataclass
class StubProvider:
    """The stub on a free loopback port, served by uvicorn on a thread of this process.

    A thread, not a process: the harness that starts it is otherwise idle while calls run, and
    stopping it needs no pid. `python -m infra.stub_provider` runs the same app as a process.
    `prices` is a table of the stub's own (a JSON file's path or its parsed document), merged
    over the default table; never the service's CEILING_PRICES_FILE.
    """

    seed: int = 0
    latency_ms_min: int = 20
    latency_ms_max: int = 200
    output_tokens_mean: int = 250
    prices: str | Path | dict[str, Any] | None = None
    api_key: str | None = None
    port: int = field(default_factory=free_port)
    _server: uvicorn.Server | None = field(default=None, init=False, repr=False)
    _thread: threading.Thread | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> StubProviderApp:
        return StubProviderApp(
            seed=self.seed, latency_ms_min=self.latency_ms_min,
            latency_ms_max=self.latency_ms_max, output_tokens_mean=self.output_tokens_mean,
            prices=StubPrices.load(self.prices), api_key=self.api_key,
        )

    def start(self) -> StubProvider:
        self._server = uvicorn.Server(server_config(self.app(), self.port))
        self._thread = threading.Thread(target=self._server.run, name="stub-provider",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the stub provider did not start on port {self.port}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(STOP_TIMEOUT_S)
        self._server = self._thread = None

    def __enter__(self) -> StubProvider:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


@dataclass
class StubProviderProcess(StubProvider):
    """The stub in an OS process of its own, stopped by pid: a drop-in for the thread, for a
    harness whose own event loop is busy (a load generator), which would otherwise share its
    interpreter lock with the stub and add its waits to the latencies it measures."""

    process: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _prices_dir: tempfile.TemporaryDirectory[str] | None = field(default=None, init=False,
                                                                 repr=False)

    def start(self) -> StubProviderProcess:
        argv = [sys.executable, "-m", "infra.stub_provider", "--port", str(self.port),
                "--seed", str(self.seed), "--latency-ms-min", str(self.latency_ms_min),
                "--latency-ms-max", str(self.latency_ms_max),
                "--output-tokens-mean", str(self.output_tokens_mean)]
        if self.api_key is not None:
            argv += ["--api-key", self.api_key]
        if isinstance(self.prices, dict):
            self._prices_dir = tempfile.TemporaryDirectory()
            path = Path(self._prices_dir.name) / "prices.json"
            path.write_text(json.dumps(self.prices))
            argv += ["--prices-file", str(path)]
        elif self.prices is not None:
            argv += ["--prices-file", str(self.prices)]
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        with httpx.Client(timeout=1.0, verify=tls_context()) as client:

            def live() -> bool:
                try:
                    return client.get(f"{self.url}/health/live").status_code == 200
                except httpx.HTTPError:
                    return False

            try:
                wait_ready(self.process, live, timeout_s=PROCESS_START_TIMEOUT_S,
                           what=f"the stub provider on port {self.port}")
            except RuntimeError:
                self.process = None  # wait_ready stopped it
                self._forget_prices()
                raise
        return self

    def stop(self) -> None:
        stop_process(self.process)
        self.process = None
        self._forget_prices()

    def _forget_prices(self) -> None:
        if self._prices_dir is not None:
            self._prices_dir.cleanup()
            self._prices_dir = None


async def padded(body: bytes, padding_bytes: int) -> AsyncIterator[bytes]:
    """`body`, a JSON object, with `padding_bytes` of spaces after its opening brace."""
    yield body[:1]
    piece = b" " * min(padding_bytes, PADDING_PIECE_BYTES)
    left = padding_bytes
    while left > len(piece):
        yield piece
        left -= len(piece)
    yield piece[:left]
    yield body[1:]


def server_config(app: StubProviderApp, port: int) -> uvicorn.Config:
    return uvicorn.Config(
        app.app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
        lifespan="off", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        timeout_keep_alive=KEEP_ALIVE_S,
    )


def fetch_bill(provider_url: str, *, with_log: bool = True) -> Bill:
    response = httpx.get(f"{provider_url}/billing", params={"log": int(with_log)},
                         timeout=BILL_FETCH_TIMEOUT_S, verify=tls_context())
    response.raise_for_status()
    return Bill.from_json(response.json())


def stub_control(provider_url: str, settings: dict[str, Any]) -> None:
    """Faults and settings of the stub's next calls (a fault set replaces the last one)."""
    httpx.post(f"{provider_url}/control", json=settings, timeout=BILL_FETCH_TIMEOUT_S,
               verify=tls_context()).raise_for_status()


def reset_bill(provider_url: str) -> None:
    httpx.post(f"{provider_url}/billing/reset", timeout=BILL_FETCH_TIMEOUT_S,
               verify=tls_context()).raise_for_status()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--latency-ms-min", type=int, default=StubProvider.latency_ms_min)
    parser.add_argument("--latency-ms-max", type=int, default=StubProvider.latency_ms_max)
    parser.add_argument("--output-tokens-mean", type=int, default=StubProvider.output_tokens_mean)
    parser.add_argument("--prices-file", help="the stub's own price table (infra/stub_prices.py "
                        "format), merged over its default table")
    parser.add_argument("--api-key", help="refuse calls without this key (401): a bearer token, "
                        "or Anthropic's x-api-key on /v1/messages")
    args = parser.parse_args()
    stub = StubProvider(seed=args.seed, latency_ms_min=args.latency_ms_min,
                        latency_ms_max=args.latency_ms_max,
                        output_tokens_mean=args.output_tokens_mean, prices=args.prices_file,
                        api_key=args.api_key, port=args.port)
    uvicorn.Server(server_config(stub.app(), args.port)).run()


if __name__ == "__main__":
    main()
