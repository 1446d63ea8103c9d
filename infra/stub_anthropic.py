"""Anthropic's Messages API on the stub provider: the witness for a gateway's POST /v1/messages.

Served by the same app as the OpenAI routes (infra.stub_provider.StubProviderApp), on its
shared state: one bill, one price table, one /control, one registry of images and files. A test
or load run then reads one bill whatever routes it drove, and a gateway's Anthropic and OpenAI
upstreams may be the same stub. What is Anthropic's own lives here: its request checks, its
prompt cache, its answers (infra.stub_anthropic_wire) and its counting
(infra.stub_anthropic_input).

Routes:
  POST /v1/messages               streaming (message_start ... message_stop) and not.
  POST /v1/messages/count_tokens  the input a call would bill, uncached; free, never billed.

Both take the key by `x-api-key` or `Authorization: Bearer` (checked when the stub has one),
require `anthropic-version` (a YYYY-MM-DD date: the SDK sends its own), read `anthropic-beta`
(`context-1m-2025-08-07` opens a long-context model's 1M window at its long-context rates;
`interleaved-thinking-2025-05-14` lets `thinking.budget_tokens` exceed `max_tokens`), refuse a
request body above 32 MB (413) and refuse fields the API does not have (400), and answer every
response with a `request-id` header and errors in Anthropic's shape.

Billing, as Anthropic documents it (https://platform.claude.com/docs/en/about-claude/pricing):
input at the input rate, prompt-cache writes at the 5-minute (1.25x) or 1-hour (2x) write rate,
reads at the read rate (0.1x), output (thinking included) at the output rate, $10 per 1,000 web
searches, and a long-context model's whole call at its long-context rates when sent with the
beta and more than 200K input tokens. Counting: infra.stub_anthropic_input.

Prompt cache (https://platform.claude.com/docs/en/build-with-claude/prompt-caching): each
`cache_control` breakpoint (at most 4; a top-level `cache_control` marks the last cacheable
block) caches the prefix up to it, if it is at least the model's minimum, for 5 minutes or 1
hour from its last use. A call reads the longest cached prefix found at the block boundaries
from each breakpoint back 20 blocks (A), writes at the 1-hour rate up to its last 1-hour
breakpoint after that (B) and at the 5-minute rate from there to its last breakpoint (C): read
A, write 1h B - A, write 5m C - B, the docs' own rule for mixed TTLs. Its clock can be moved on
by /control's `clock_offset_s`, so a test passes 5 minutes without waiting them.

The answer: `max_tokens` caps every output token, thinking included (0 fills the cache and
answers nothing). With `thinking` enabled, half the output is thinking (at most the budget), or
`X-Stub-Reasoning-Tokens: N`; the thinking text shown is a summary of a word every four tokens,
as Claude 4 summarizes what it bills in full. A `tool_choice` of any or tool answers with a call
to the tool, as does `X-Stub-Tool-Call: 1` (the first client tool) under auto; stop sequences
end the text where they appear.

Web search: a call with a `web_search_20250305` tool runs `X-Stub-Web-Searches: N` (or /control's
`web_searches`) searches, one when the tool is forced, none otherwise; at most `max_uses`, the
rest answered with a `max_uses_exceeded` error and not billed. Each search is billed its fee and
its results as input: `web_search_result_tokens` tokens (a /control setting, the stub's own
choice; Anthropic documents no size), which the results' url, title and encrypted content sent
back on a later turn also count to.

Faults (infra.stub_faults) as on the OpenAI routes: fail_status (answer S, bill nothing), hang,
fail_after_billing (bill in full, then answer S; a stream answers 200, message_start and an
`error` event for S, and no message_stop), hang_after_billing, break_after_events (bill in full,
send K events, drop the connection), cached_tokens (read N tokens from the cache instead).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import secrets
from collections import OrderedDict
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from infra.stub_anthropic_input import (
    MessagesPrompt,
    Tools,
    messages_prompt,
    search_result_tokens,
)
from infra.stub_anthropic_wire import (
    Reply,
    Search,
    error_body,
    error_event,
    message_body,
    message_events,
    message_start,
)
from infra.stub_bill import CallRecord, Usage
from infra.stub_faults import Fault, count, hang, sent
from infra.stub_input import InputError
from infra.stub_prices import TIER_LONG_CONTEXT, TIER_STANDARD, ModelPrices, cost_micros
from infra.stub_wire import WORDS

if TYPE_CHECKING:
    from infra.stub_provider import StubProviderApp

API = "messages"
API_COUNT_TOKENS = "messages.count_tokens"
# Anthropic's request size limit for the Messages API (https://platform.claude.com/docs/en/api/
# overview, "request size limits").
REQUEST_BYTES_MAX = 32 * 1024 * 1024
API_VERSION = re.compile(r"\d{4}-\d{2}-\d{2}")
INTERLEAVED_THINKING_BETA = "interleaved-thinking-2025-05-14"
# Extended thinking (https://platform.claude.com/docs/en/build-with-claude/extended-thinking):
# the smallest budget the API takes.
THINKING_BUDGET_TOKENS_MIN = 1_024
# With thinking on, top_p may only be between these (same page); temperature and top_k not set.
THINKING_TOP_P_MIN = 0.95
# The share of an answer spent thinking, within the budget: the stub's own choice, since no
# provider documents one (the OpenAI side's medium effort is the same half).
THINKING_SHARE = Fraction(1, 2)
# The thinking shown is a summary: a word for every this many tokens billed (the stub's own
# ratio; Anthropic documents only that Claude 4 bills the full thinking and shows a summary).
THINKING_TOKENS_PER_SUMMARY_WORD = 4
THINKING_WORDS = ("consider", "the", "budget", "before", "answering")
# The prompt cache looks for hits this many blocks back from each breakpoint (the docs say
# "approximately 20"), and holds at most this many prefixes: a long load run must not grow the
# stub without end.
CACHE_LOOKBACK_BLOCKS = 20
CACHE_PREFIXES_MAX = 10_000
# Input a web search's results add: the stub's own default. A test sets its own by /control.
WEB_SEARCH_RESULT_TOKENS_DEFAULT = 8_000
# Below this the results cannot be laid out to their size (their url and title alone exceed it).
WEB_SEARCH_RESULT_TOKENS_MIN = 64
# Top-level fields of a Messages call the stub serves; the API's others it refuses by name (a
# field it ignored could change what a real call bills), and anything else the API refuses too.
FIELDS = frozenset({"model", "messages", "max_tokens", "system", "metadata", "stop_sequences",
                    "stream", "temperature", "top_p", "top_k", "tools", "tool_choice", "thinking",
                    "service_tier", "cache_control"})
COUNT_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking",
                          "cache_control"})
FIELDS_NOT_SERVED = frozenset({"container", "mcp_servers", "context_management", "output_config",
                               "output_format", "speed", "inference_geo", "diagnostics",
                               "user_profile_id", "workspace_id"})
SERVICE_TIERS = ("auto", "standard_only")
# The status logged for a call that was never answered (it hung until the client left).
STATUS_NO_ANSWER = 0


class MessagesError(Exception):
    """An answer in Anthropic's error shape."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message

    def response(self, request_id: str) -> JSONResponse:
        return JSONResponse(error_body(self.status, self.message, request_id),
                            status_code=self.status, headers={"request-id": request_id})


def invalid(message: str) -> MessagesError:
    return MessagesError(400, message)


@dataclass(frozen=True)
class CacheUse:
    """What a call reads from and writes to the prompt cache; `hit` the boundary it read."""

    read_tokens: int = 0
    write_5m_tokens: int = 0
    write_1h_tokens: int = 0
    hit: int | None = None


class PromptCache:
    """Cached prefixes by (model, digest): when each expires and its TTL."""

    def __init__(self) -> None:
        self.entries: OrderedDict[tuple[str, bytes], tuple[float, int]] = OrderedDict()

    def use(self, model: ModelPrices, prompt: MessagesPrompt, now_s: float) -> CacheUse:
        assert model.messages is not None  # a Messages API model
        tokens = [t for _, t in prompt.boundaries]
        read, hit = 0, None
        for point in prompt.breakpoints:
            for at in range(point.boundary, max(point.boundary - CACHE_LOOKBACK_BLOCKS, 0) - 1,
                            -1):
                entry = self.entries.get((model.name, prompt.boundaries[at][0]))
                if entry is not None and entry[0] > now_s:
                    if tokens[at] > read:
                        read, hit = tokens[at], at
                    break
        written = [p for p in prompt.breakpoints
                   if tokens[p.boundary] >= model.messages.cache_tokens_min
                   and tokens[p.boundary] > read]
        end_1h = max((tokens[p.boundary] for p in written if p.ttl_s > 300), default=read)
        end = max((tokens[p.boundary] for p in written), default=read)
        return CacheUse(read, end - end_1h, end_1h - read, hit)

    def store(self, model: ModelPrices, prompt: MessagesPrompt, use: CacheUse,
              now_s: float) -> None:
        """Refresh the prefix read; cache every breakpoint's prefix that is long enough."""
        assert model.messages is not None  # a Messages API model
        if use.hit is not None:
            key = (model.name, prompt.boundaries[use.hit][0])
            # Another call may have evicted it since this one read it: the read stands.
            entry = self.entries.get(key)
            if entry is not None:
                self.entries[key] = (now_s + entry[1], entry[1])
        for point in prompt.breakpoints:
            digest, tokens = prompt.boundaries[point.boundary]
            if tokens < model.messages.cache_tokens_min:
                continue
            key = (model.name, digest)
            old = self.entries.get(key)
            ttl_s = max(point.ttl_s, old[1] if old is not None and old[0] > now_s else 0)
            self.entries[key] = (now_s + ttl_s, ttl_s)
            self.entries.move_to_end(key)
        while len(self.entries) > CACHE_PREFIXES_MAX:
            self.entries.popitem(last=False)


@dataclass(frozen=True)
class Params:
    max_tokens: int
    thinking_budget: int | None  # None: thinking is off
    stop_sequences: tuple[str, ...]


@dataclass(frozen=True)
class Decided:
    """A call decided and not yet billed."""

    reply: Reply
    prices: ModelPrices
    prompt: MessagesPrompt
    cache: CacheUse
    tier: str
    stream: bool


def _number(body: dict[str, Any], key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if type(value) not in (int, float) or not low <= value <= high:
        raise invalid(f"{key}: must be a number from {low} to {high}")
    return float(value)


def _check_fields(body: dict[str, Any], served: frozenset[str]) -> None:
    for key, value in body.items():
        if key in served:
            continue
        if key in FIELDS_NOT_SERVED:
            if value is not None:
                raise invalid(f"{key}: not served by the stub")
            continue
        raise invalid(f"{key}: Extra inputs are not permitted")


def _params(body: dict[str, Any], prices: ModelPrices, betas: set[str]) -> Params:
    assert prices.messages is not None  # a Messages API model
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise invalid("max_tokens: Field required")
    if type(max_tokens) is not int or max_tokens < 0:
        raise invalid("max_tokens: must be an integer, 0 or more")
    if max_tokens > prices.messages.output_tokens_max:
        raise invalid(f"max_tokens: {max_tokens} > {prices.messages.output_tokens_max}, which is "
                      f"the maximum allowed number of output tokens for {prices.name}")
    thinking = body.get("thinking")
    budget = None
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        if set(thinking) != {"type", "budget_tokens"}:
            raise invalid("thinking: enabled thinking takes budget_tokens")
        if not prices.reasoning:
            raise invalid(f"thinking: not supported by {prices.name}")
        budget = thinking["budget_tokens"]
        if type(budget) is not int or budget < THINKING_BUDGET_TOKENS_MIN:
            raise invalid("thinking.enabled.budget_tokens: Input should be greater than or "
                          f"equal to {THINKING_BUDGET_TOKENS_MIN}")
        if budget >= max_tokens and INTERLEAVED_THINKING_BETA not in betas:
            raise invalid("`max_tokens` must be greater than `thinking.budget_tokens`")
    elif thinking is not None and thinking != {"type": "disabled"}:
        raise invalid('thinking: type is "enabled" (with budget_tokens) or "disabled"')
    temperature = _number(body, "temperature", 0, 1)
    top_p = _number(body, "top_p", 0, 1)
    top_k = body.get("top_k")
    if top_k is not None and (type(top_k) is not int or top_k < 0):
        raise invalid("top_k: must be an integer, 0 or more")
    if budget is not None and (temperature not in (None, 1) or top_k is not None
                               or (top_p is not None and top_p < THINKING_TOP_P_MIN)):
        raise invalid("thinking isn't compatible with temperature or top_k modifications, and "
                      f"takes top_p from {THINKING_TOP_P_MIN} to 1")
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("stop_sequences: a list of non-empty strings")
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or set(metadata) - {"user_id"}
                                 or not isinstance(metadata.get("user_id", ""), str | None)):
        raise invalid("metadata: only user_id, a string")
    if body.get("service_tier") not in (None, *SERVICE_TIERS):
        raise invalid(f"service_tier: one of {', '.join(SERVICE_TIERS)}")
    if body.get("stream") is not None and type(body["stream"]) is not bool:
        raise invalid("stream: a boolean")
    return Params(max_tokens, budget, tuple(stops))


def _header_count(request: Request, header: str, minimum: int) -> int | None:
    raw = request.headers.get(header)
    if raw is None:
        return None
    try:
        return count(raw, header, minimum)
    except ValueError as exc:
        raise invalid(str(exc)) from exc


def _stopped(words: tuple[str, ...], stops: tuple[str, ...]) -> tuple[str, int, str | None]:
    """The text of `words` up to the first stop sequence: (text, words generated, sequence)."""
    text = ""
    for i, word in enumerate(words):
        text = word if i == 0 else f"{text} {word}"
        for stop in stops:
            # Earlier words matched nothing, so a match must end in this one.
            at = text.find(stop, max(0, len(text) - len(word) - len(stop)))
            if at >= 0:
                return text[:at], i + 1, stop
    return text, len(words), None


class MessagesApi:
    """The Messages API routes, on the app's shared bill, prices, faults and registry."""

    def __init__(self, app: StubProviderApp) -> None:
        self.app = app
        self.cache = PromptCache()

    def reset(self) -> None:
        self.cache = PromptCache()

    # -- routes ------------------------------------------------------------------------------

    async def create(self, request: Request) -> Response:
        app = self.app
        app.bill.requests += 1
        request_id = "req_" + secrets.token_hex(12)
        model: str | None = None
        stream = False
        fault = Fault()
        try:
            betas = self._check_headers(request)
            try:
                fault = app.take_fault(request)
            except ValueError as exc:
                raise invalid(f"X-Stub-* header: {exc}") from exc
            if fault.hang:
                await hang(request)
                self._log(API, model, STATUS_NO_ANSWER, stream, fault)
                return Response(status_code=504)  # nobody reads it: the client has gone
            if fault.fail_status is not None:
                raise MessagesError(fault.fail_status,
                                    f"stub failure {fault.fail_status} on request")
            body = await self._body(request)
            model = body.get("model") if isinstance(body.get("model"), str) else None
            stream = body.get("stream") is True
            decided = self._decide(body, request, fault, betas)
        except MessagesError as exc:
            self._log(API, model, exc.status, stream, fault)
            return exc.response(request_id)
        await asyncio.sleep(app.latency_s())
        # Billed here, before the first byte, whether or not the client is still there.
        status = fault.fail_after_billing or (STATUS_NO_ANSWER if fault.hang_after_billing
                                              else 200)
        self._charge(decided, status, fault)
        reply = decided.reply
        headers = {"request-id": request_id}
        if fault.hang_after_billing:
            await hang(request)
            return Response(status_code=504)
        if fault.fail_after_billing is not None:
            failure = MessagesError(fault.fail_after_billing, f"stub failure {status} after the "
                                    "call was billed")
            if not stream:
                return failure.response(request_id)
            events = [*message_start(reply), error_event(failure.status, failure.message)]
            return StreamingResponse(sent(events, broken=False), headers=headers,
                                     media_type="text/event-stream")
        broken = fault.break_after_events is not None
        if stream:
            events = message_events(reply)
            if fault.break_after_events is not None:
                events = events[:min(fault.break_after_events, len(events) - 1)]
            return StreamingResponse(sent(events, broken=broken), headers=headers,
                                     media_type="text/event-stream")
        doc = message_body(reply)
        if broken:
            raw = json.dumps(doc).encode()
            return StreamingResponse(sent([raw[:len(raw) // 2]], broken=True), headers=headers,
                                     media_type="application/json")
        return JSONResponse(doc, headers=headers)

    async def count_tokens(self, request: Request) -> Response:
        """The input tokens of a call, as it would bill them with nothing cached. Free."""
        self.app.bill.requests += 1
        request_id = "req_" + secrets.token_hex(12)
        model: str | None = None
        try:
            self._check_headers(request)
            body = await self._body(request)
            model = body.get("model") if isinstance(body.get("model"), str) else None
            prices = self._model(body)
            _check_fields(body, COUNT_FIELDS)
            prompt = self._prompt(body, prices)
        except MessagesError as exc:
            self._log(API_COUNT_TOKENS, model, exc.status, False, Fault())
            return exc.response(request_id)
        self._log(API_COUNT_TOKENS, model, 200, False, Fault())
        return JSONResponse({"input_tokens": prompt.tokens}, headers={"request-id": request_id})

    # -- one call ----------------------------------------------------------------------------

    def _check_headers(self, request: Request) -> set[str]:
        """Authorize the call and read its betas."""
        key = self.app.api_key
        if key is not None and request.headers.get("x-api-key") != key and (
            request.headers.get("authorization") != f"Bearer {key}"
        ):
            raise MessagesError(401, "invalid x-api-key")
        version = request.headers.get("anthropic-version")
        if version is None:
            raise invalid("anthropic-version: header is required")
        if not API_VERSION.fullmatch(version):
            raise invalid(f"anthropic-version: {version!r} is not a version")
        return {beta.strip() for header in request.headers.getlist("anthropic-beta")
                for beta in header.split(",") if beta.strip()}

    async def _body(self, request: Request) -> dict[str, Any]:
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > REQUEST_BYTES_MAX:
            raise MessagesError(413, f"Request exceeds the maximum size of {REQUEST_BYTES_MAX} "
                                "bytes")
        try:
            raw = await request.body()
        except ClientDisconnect as exc:  # gone before it finished sending: nothing to serve
            raise MessagesError(499, "the client went away") from exc
        if len(raw) > REQUEST_BYTES_MAX:
            raise MessagesError(413, f"Request exceeds the maximum size of {REQUEST_BYTES_MAX} "
                                "bytes")
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise invalid("the body is not JSON") from exc
        if not isinstance(body, dict):
            raise invalid("the body must be a JSON object")
        return body

    def _model(self, body: dict[str, Any]) -> ModelPrices:
        name = body.get("model")
        if not isinstance(name, str):
            raise invalid("model: Field required")
        prices = self.app.prices.model(name)
        # An unpriced model cannot be billed, so it is not served; nor is OpenAI's model here.
        if prices is None or prices.messages is None:
            raise MessagesError(404, f"model: {name}")
        return prices

    def _prompt(self, body: dict[str, Any], prices: ModelPrices) -> MessagesPrompt:
        try:
            return messages_prompt(body, prices, self.app.registry)
        except InputError as exc:
            raise invalid(str(exc)) from exc

    def _decide(self, body: dict[str, Any], request: Request, fault: Fault,
                betas: set[str]) -> Decided:
        """Decide the whole answer and its usage, or refuse the request (nothing billed)."""
        prices = self._model(body)
        assert prices.messages is not None  # checked by _model
        _check_fields(body, FIELDS)
        params = _params(body, prices, betas)
        prompt = self._prompt(body, prices)
        long_context = prices.long_context if (
            prices.long_context is not None and prices.long_context.beta in betas) else None
        window = (prices.messages.context_window_tokens if long_context is None
                  else long_context.context_window_tokens)
        if prompt.tokens > window:
            raise invalid(f"prompt is too long: {prompt.tokens} tokens > {window} maximum")
        if prompt.tokens + params.max_tokens > window:
            raise invalid(f"input length and `max_tokens` exceed context limit: {prompt.tokens} "
                          f"+ {params.max_tokens} > {window}, decrease input length or "
                          "`max_tokens` and try again")
        tools = prompt.tools
        if params.thinking_budget is not None and tools.forced is not None:
            raise invalid("Thinking may not be enabled when tool_choice forces tool use.")
        cache = self._cache_use(prices, prompt, fault)
        reply = self._reply(body, request, fault, prices, params, tools, prompt, cache)
        tier = TIER_STANDARD
        if long_context is not None and reply.usage.input_tokens > long_context.above_input_tokens:
            tier = TIER_LONG_CONTEXT
        return Decided(reply, prices, prompt, cache, tier, body.get("stream") is True)

    def _cache_use(self, prices: ModelPrices, prompt: MessagesPrompt, fault: Fault) -> CacheUse:
        if fault.cached_tokens is not None:
            return CacheUse(read_tokens=min(fault.cached_tokens, prompt.tokens))
        if not self.app.prompt_cache_on:
            return CacheUse()
        return self.cache.use(prices, prompt, self.app.now_s())

    def _reply(self, body: dict[str, Any], request: Request, fault: Fault, prices: ModelPrices,
               params: Params, tools: Tools, prompt: MessagesPrompt, cache: CacheUse) -> Reply:
        cap = params.max_tokens
        forced = _header_count(request, "x-stub-output-tokens", 1)
        forced_thinking = _header_count(request, "x-stub-reasoning-tokens", 0)
        total = 0 if cap == 0 else min(cap, forced or self.app.draw_output_tokens())
        thinking = 0
        if params.thinking_budget is not None:
            thinking = (min(total, forced_thinking) if forced_thinking is not None
                        else min(math.floor(total * THINKING_SHARE), params.thinking_budget))
        elif forced_thinking is not None:
            raise invalid("X-Stub-Reasoning-Tokens: thinking is not enabled")
        tool = tools.forced
        if request.headers.get("x-stub-tool-call") == "1":
            if not tools.client or tools.choice.kind == "none":
                raise invalid("X-Stub-Tool-Call: the call has no client tool it may call")
            tool = tool or tools.client[0]
        searches = self._searches(tools, fault, tool)
        words = tuple(WORDS[i % len(WORDS)] for i in range(total - thinking))
        tool_call = None
        stop: str | None = None
        if tool is not None and tool != "web_search":
            text, generated = " ".join(words), len(words)
            tool_call = ("toolu_" + secrets.token_hex(12), tool)
        else:
            text, generated, stop = _stopped(words, params.stop_sequences)
        output = thinking + generated
        stop_reason = ("stop_sequence" if stop is not None else "max_tokens" if output == cap
                       else "tool_use" if tool_call is not None else "end_turn")
        search_tokens = sum(search_result_tokens(list(s.results)) for s in searches
                            if s.results is not None)
        usage = Usage(
            input_tokens=prompt.tokens + search_tokens, cached_input_tokens=cache.read_tokens,
            cache_write_tokens=cache.write_5m_tokens + cache.write_1h_tokens,
            cache_write_1h_tokens=cache.write_1h_tokens, image_input_tokens=prompt.image_tokens,
            file_input_tokens=prompt.file_tokens, output_tokens=output, reasoning_tokens=thinking,
            web_search_requests=sum(s.results is not None for s in searches),
        )
        summary = tuple(THINKING_WORDS[i % len(THINKING_WORDS)]
                        for i in range(math.ceil(thinking / THINKING_TOKENS_PER_SUMMARY_WORD)))
        return Reply(
            message_id="msg_" + secrets.token_hex(12), model=str(body["model"]),
            thinking=" ".join(summary) if params.thinking_budget is not None else None,
            signature="stub-signature-" + secrets.token_hex(16), searches=tuple(searches),
            text=text, tool_call=tool_call, stop_reason=stop_reason, stop_sequence=stop,
            usage=usage, search_tokens=search_tokens, server_tools=tools.web_search,
        )

    def _searches(self, tools: Tools, fault: Fault, tool: str | None) -> list[Search]:
        """The web searches the model runs: asked for, or one when the tool is forced; none
        without the tool or under tool_choice none."""
        if not tools.web_search or tools.choice.kind == "none":
            return []
        asked = fault.web_searches if fault.web_searches is not None else int(
            tool == "web_search")
        limit = tools.web_search_max_uses
        run = asked if limit is None else min(asked, limit)
        searches = []
        for i in range(asked if asked == run else run + 1):
            tool_use_id = "srvtoolu_" + secrets.token_hex(12)
            results = self._results(tool_use_id) if i < run else None
            searches.append(Search(tool_use_id, f"stub search {i + 1}", results))
        return searches

    def _results(self, tool_use_id: str) -> tuple[dict[str, Any], ...]:
        """One result, its encrypted content padded so that it counts to exactly the setting."""
        url = f"https://search.stub.invalid/{tool_use_id}"
        title = "stub search result"
        pad = 4 * self.app.web_search_result_tokens - len(url) - len(title)
        return ({"type": "web_search_result", "url": url, "title": title,
                 "encrypted_content": "E" * pad, "page_age": None},)

    def _charge(self, decided: Decided, status: int, fault: Fault) -> None:
        reply, prices = decided.reply, decided.prices
        cost = cost_micros(prices, decided.tier, reply.usage)
        tier = "standard" if decided.tier == TIER_STANDARD else decided.tier
        self.app.bill.record(CallRecord(
            api=API, model=reply.model, status=status, billed=True, cost_micros=cost,
            usage=reply.usage, stream=decided.stream, service_tier=tier, fault=fault.name,
        ))
        if self.app.prompt_cache_on and fault.cached_tokens is None:
            self.cache.store(prices, decided.prompt, decided.cache, self.app.now_s())

    def _log(self, api: str, model: str | None, status: int, stream: bool, fault: Fault) -> None:
        self.app.bill.record(CallRecord(api=api, model=model, status=status, billed=False,
                                        cost_micros=0, usage=None, stream=stream,
                                        fault=fault.name))
