"""The gateway's money: what a request may cost, what to hold, what it cost.

Every call goes price -> reserve -> call -> settle, in one of two wire formats: OpenAI's (chat
completions and Responses) and Anthropic's Messages API. This module decides everything that
touches money, from the request (its body, and for Messages the beta headers it forwards) and
from the provider's answer; api/routes/gateway.py only moves bytes between the client and the
provider. What differs between the formats is read here, each in one place: the request's
fields (plan), the usage an answer reports (usage_of), and where a stream ends (StreamTally).

- The worst case comes from the request: its text bounded by its bytes, its images and audio by
  the model's rules (core/content.py), the output cap (max_tokens / max_completion_tokens /
  max_output_tokens; OUTPUT_TOKENS_DEFAULT is set and forwarded when the caller sets none) times
  `n`, at the requested service tier's rates (core/prices.py); for Messages also the tool-use
  system prompt, and web searches at their fee and their results' bound. A request whose cost
  its body cannot bound (a stored conversation, a file by id, a PDF, hosted tools, audio output,
  a field or beta the gateway does not know) is refused, not guessed at.
- A call is settled from the provider's usage (for streams, the last usage reported before the
  stream's terminal event); at its worst case when a complete answer reports none (hidden
  reasoning tokens can exceed anything the visible answer shows); and left held at its
  reservation when the outcome is unknown, where expiry charges it (always: a gateway call's
  lease expires with the 'charge' policy) and only an operator's correction lowers it.
- What a call is charged is the gateway's alone: its reservation belongs to no API key
  (core/ledger.py GATEWAY_OWNER_PREFIX), so no key can settle or release it.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from core import output_stats
from core.config import OUTPUT_TOKENS_DEFAULT
from core.content import (
    NO_MEDIA,
    InputBound,
    Media,
    chat_input,
    json_bytes,
    messages_input,
    responses_input,
)
from core.errors import (
    BudgetRefused,
    CeilingError,
    FieldUnsupported,
    InputUnbounded,
    InvalidRequest,
)
from core.jsonbody import loads_answer, loads_object
from core.ledger import LedgerStore, LegStatus, Reservation
from core.prices import TIER_AUTO, TIER_DEFAULT, Usage, check_service_tier
from core.service import Caller, CallSpec, CeilingService, SettleSpec

# With X-Ceiling-Clamp, a call that does not fit is sent with a smaller output cap only if at
# least this many tokens still fit: fewer would cut most answers off mid-sentence.
CLAMP_OUTPUT_TOKENS_MIN = 256
# Output-length histograms are read from the ledger at most this often per model and instance:
# a p95 moves slowly, and a read on every call would add a round trip to every call.
HISTOGRAM_CACHE_S = 30.0
# Models whose p95 an instance remembers; bounded because model names come from callers.
HISTOGRAM_MODELS_MAX = 1_024
# An instance records at most one output length per model this often. Under load that is still
# ten a second from every instance, plenty for a p95 over OBSERVATIONS_MAX; and a call does not
# pay a ledger write for it (on one event loop, a write after one answer delays the next).
# Which call is recorded does not depend on its length, so the histogram is not skewed.
OBSERVE_INTERVAL_S = 0.1
# An error answer proves nothing was billed only when it is the provider refusing the request
# itself: a 4xx. Not 408 (the server gave up waiting, maybe while the model ran) nor 499 (the
# client closed, reported by a proxy while the call went on behind it). A 5xx can come after the
# model ran and billed (an error while streaming the answer back, a proxy's 502/504, a CDN's
# 520-524 while the origin kept working): every one of those keeps its hold as unknown.
REFUSAL_STATUSES = range(400, 500)
BILLING_UNKNOWN_4XX = frozenset({408, 499})
# Stream events after which a Responses API call is over, carrying its usage.
RESPONSES_TERMINAL_EVENTS = frozenset(
    {"response.completed", "response.incomplete", "response.failed"}
)


# One encoder for every forwarded body: json.dumps with options builds a new one per call.
_BODY_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


class Api(StrEnum):
    """A gateway route's wire format, by its path below its provider's base URL."""

    CHAT = "chat/completions"
    RESPONSES = "responses"
    # Anthropic's: its base URL (CEILING_ANTHROPIC_URL) is the SDK's, without /v1.
    MESSAGES = "v1/messages"


# The output cap's field names, the one the gateway sets last.
CAP_FIELDS = {
    Api.CHAT: ("max_tokens", "max_completion_tokens"),
    Api.RESPONSES: ("max_output_tokens",),
    Api.MESSAGES: ("max_tokens",),
}
# Fields that make a call cost what its body cannot bound: refused instead of forwarded.
# chat: audio output is billed at audio rates on top of the text it speaks; rejected predicted
# tokens are billed on top of the cap. responses: a background call is billed after the answer.
# Both: Anthropic's fast mode (`speed`) is billed at rates its OpenAI-shaped usage does not name.
UNBOUNDED_FIELDS = {
    Api.CHAT: ("audio", "prediction", "speed"),
    Api.RESPONSES: ("background", "speed"),
}
# Fields that feed the model input the request does not contain (InputUnbounded): search
# results, a stored conversation, response or prompt.
UNBOUNDED_INPUT_FIELDS = {
    Api.CHAT: ("web_search_options",),
    Api.RESPONSES: ("conversation", "previous_response_id", "prompt"),
}
# The top-level fields forwarded, each because its billing effect is known: the ones the worst
# case reads (model, prompt, output cap, `n`, tier, tools), and the ones that change nothing it
# leaves out (sampling, logprobs, which only lengthen the answer's body, caching hints, storing,
# reasoning effort, whose tokens count within the output cap, metadata and end-user ids). Any
# other field is refused by name (FieldUnsupported) and nothing is forwarded: on an
# OpenAI-compatible upstream an unknown field can bill (a router's web plugin, fallback models,
# a provider's cached content), and a field added after this list may. The fields of
# UNBOUNDED_FIELDS and UNBOUNDED_INPUT_FIELDS are known and refused with their own reason. An
# operator adds fields with no billing effect by CEILING_GATEWAY_FIELDS_ALLOWED.
COMMON_FIELDS = frozenset({
    "model", "metadata", "parallel_tool_calls", "prompt_cache_key", "prompt_cache_retention",
    "safety_identifier", "service_tier", "store", "stream", "temperature", "tool_choice",
    "tools", "top_logprobs", "top_p", "user",
})
# Tools the client runs itself; hosted tools (web search, file search, code interpreter...)
# feed the model input the request does not contain.
CLIENT_TOOL_TYPES = frozenset({"function", "custom"})
# A usage's (input, output, input details, output details) fields.
USAGE_FIELDS = {
    Api.CHAT: ("prompt_tokens", "completion_tokens", "prompt_tokens_details",
               "completion_tokens_details"),
    Api.RESPONSES: ("input_tokens", "output_tokens", "input_tokens_details",
                    "output_tokens_details"),
    Api.MESSAGES: ("input_tokens", "output_tokens", "input_tokens_details",
                   "output_tokens_details"),
}

# -- Anthropic's Messages API --
# The request headers forwarded to the provider (its version and betas), by wire format.
FORWARDED_HEADERS = {Api.MESSAGES: frozenset({"anthropic-version", "anthropic-beta"})}
# The top-level fields whose cost the gateway knows (ALLOWED_FIELDS). Any other is refused by
# name: fast mode's `speed` and `inference_geo` bill other rates; `container`, `mcp_servers` and
# `context_management` feed the model input (or run compaction) the request does not contain;
# and a field added after this list may do either.
MESSAGES_FIELDS = frozenset({
    "model", "messages", "max_tokens", "system", "metadata", "stop_sequences", "stream",
    "temperature", "top_p", "top_k", "tools", "tool_choice", "thinking", "service_tier",
    "cache_control",
})
ALLOWED_FIELDS = {
    Api.CHAT: COMMON_FIELDS | {
        "messages", "max_tokens", "max_completion_tokens", "n", "stream_options", "stop",
        "seed", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs",
        "response_format", "reasoning_effort", "verbosity", "modalities", "functions",
        "function_call",
    },
    Api.RESPONSES: COMMON_FIELDS | {
        "input", "instructions", "max_output_tokens", "reasoning", "text", "truncation",
        "include", "max_tool_calls", "stream_options",
    },
    Api.MESSAGES: MESSAGES_FIELDS,
}
# anthropic-beta flags that change nothing the worst case leaves out: interleaved thinking (the
# output is still capped by max_tokens), how tool input streams, fewer tokens for tool calls, a
# higher max_tokens (which is held), 1-hour cache writes (every input token is held at the
# dearest input rate, a 1-hour write's included), prompt caching's early flag, and the Files
# API's (an image by file id is held at the per-image bound; a document by file id is refused).
# Any other is refused: a beta can change the rates (fast mode) or what the model reads.
MESSAGES_BETAS = frozenset({
    "interleaved-thinking-2025-05-14", "fine-grained-tool-streaming-2025-05-14",
    "token-efficient-tools-2025-02-19", "output-128k-2025-02-19",
    "extended-cache-ttl-2025-04-11", "prompt-caching-2024-07-31", "files-api-2025-04-14",
})
# Opens a model's 1M-token window; a call above 200K input tokens is then billed whole at the
# model's long-context rates. Forwarded only for a model whose rates have that tier.
CONTEXT_1M_BETA = "context-1m-2025-08-07"
# Every call with tools is billed a tool-use system prompt besides the definitions: the largest
# count Anthropic publishes for any model and tool_choice (Claude 3 Opus, auto), so that a model
# whose own count is not in the table is held at least at it.
TOOL_USE_SYSTEM_PROMPT_TOKENS_MAX = 530
# Client tools (a definition the client runs), and Anthropic's web search, whose `max_uses`
# bounds its fees. Anthropic's other tools are refused: web fetch and code execution feed the
# model input (or bill container time) the request does not bound, and its client tools (bash,
# text editor, computer use) add system prompts of their own.
MESSAGES_CLIENT_TOOL_TYPES = (None, "custom")
WEB_SEARCH_TOOL_PREFIX = "web_search_"
# Anthropic's request tiers: `standard_only` is the standard rates; `auto` (and none) lets the
# provider serve priority capacity. Its answers name `standard` for the standard rates.
ANTHROPIC_TIERS = {"standard_only": TIER_DEFAULT, "standard": TIER_DEFAULT}


class UpstreamUnreachable(CeilingError):
    """The request provably never reached the provider; its reservation was released."""

    code = "upstream_unreachable"


class UpstreamTimeout(CeilingError):
    """The request was sent and no complete answer came back: whether it was billed is unknown."""

    code = "upstream_timeout"


class UpstreamAnswerTooLarge(CeilingError):
    """The provider answered more than the gateway reads (api/upstream.py
    UPSTREAM_ANSWER_BYTES_MAX): the call was run and billed, and its usage was left unread."""

    code = "upstream_answer_too_large"


def billed_nothing(status: int) -> bool:
    """Whether a provider's error status proves the call was not billed (its hold is released)."""
    return status in REFUSAL_STATUSES and status not in BILLING_UNKNOWN_4XX


class Outcome(StrEnum):
    """What is known of a call's bill, in the x-ceiling-billing-outcome header."""

    BILLED = "billed"  # settled from the provider's usage
    # A complete answer without usage, settled at its worst case: an upper bound, never a guess
    # below what the provider can bill.
    ESTIMATED = "estimated"
    # Held at the reservation: expiry charges it unless an operator corrects it.
    UNKNOWN = "unknown"
    RELEASED = "released"  # the provider billed nothing; the reservation was released


@dataclass(frozen=True)
class Plan:
    """One request, priced: the body to forward and the bounds of what it may cost."""

    api: Api
    model: str
    body: dict[str, Any]
    stream: bool
    text_tokens_max: int  # the input's text, framing included
    output_tokens_max: int  # per choice
    choices: int
    usage_wanted: bool  # a chat stream whose client asked for the usage chunk itself
    media: Media = NO_MEDIA  # the input's images and audio, priced by the model's rules
    service_tier: str = TIER_AUTO  # as asked for; a request that names none is `auto`
    headers: tuple[tuple[str, str], ...] = ()  # the client's headers forwarded with the body
    long_context: bool = False  # sent with the 1M-context beta: priced at long-context rates

    def spec(self, output_tokens_max: int | None = None) -> CallSpec:
        return CallSpec(
            model=self.model, input_tokens=self.text_tokens_max,
            output_tokens_max=output_tokens_max or self.output_tokens_max, choices=self.choices,
            media=self.media, service_tier=self.service_tier,
        )

    def clamped(self, output_tokens_max: int) -> Plan:
        body = dict(self.body)
        for field in CAP_FIELDS[self.api]:
            if body.get(field) is not None:
                body[field] = output_tokens_max
        thinking = body.get("thinking")
        if self.api is Api.MESSAGES and isinstance(thinking, dict) and type(
                thinking.get("budget_tokens")) is int and thinking["budget_tokens"] >= (
                output_tokens_max):
            # The thinking budget must stay below the cap; lowered with it (a budget below the
            # provider's minimum is then the provider's to refuse, which releases the hold).
            body["thinking"] = {**thinking, "budget_tokens": output_tokens_max - 1}
        return replace(self, body=body, output_tokens_max=output_tokens_max)

    def content(self) -> bytes:
        """The body as priced, encoded anew rather than forwarded as the client's bytes: a key
        given twice is resolved by each JSON parser its own way (first or last wins, or an
        error), and the provider must read the document the gateway priced."""
        return _BODY_ENCODER.encode(self.body).encode()


def _positive_int(value: object, field: str) -> int:
    if type(value) is not int or value < 1:
        raise InvalidRequest(f"{field} must be a positive integer", field=field)
    return value


def _prompt(api: Api, body: dict[str, Any]) -> InputBound:
    """The bound of what a call is prompted with (core/content.py): its messages or input."""
    tools = body.get("tools") or []
    if not isinstance(tools, list) or any(
        not isinstance(t, dict) or not isinstance(t.get("type"), str)
        or t["type"] not in CLIENT_TOOL_TYPES for t in tools
    ):
        raise InputUnbounded(
            "only function and custom tools are supported: a hosted tool feeds the model input "
            "whose cost the request cannot bound", field="tools",
        )
    if api is Api.CHAT:
        if not isinstance(body.get("messages"), list):
            raise InvalidRequest("messages must be a list", field="messages")
        return chat_input(body["messages"])
    return responses_input(body.get("input"))


def _output_cap(api: Api, body: dict[str, Any], output_tokens_default: int) -> int:
    """The call's output cap, as given; else `output_tokens_default`, set in the body."""
    caps = {_positive_int(body[f], f) for f in CAP_FIELDS[api] if body.get(f) is not None}
    if len(caps) > 1:
        raise InvalidRequest(
            "give one output cap (max_tokens or max_completion_tokens), or equal values",
            field=CAP_FIELDS[api][-1],
        )
    if not caps:
        body[CAP_FIELDS[api][-1]] = output_tokens_default
        return output_tokens_default
    return caps.pop()


def _text_tokens(body: dict[str, Any], prompt_field: str, prompt: InputBound) -> int:
    """The prompt's bound, and everything else in the body as forwarded that the provider may
    tokenize (instructions, system prompts, tools, schemas) by its bytes: the framing fields
    counted with it only raise the bound, and two requests that forward the same body are
    priced the same."""
    return prompt.text_tokens + json_bytes({k: v for k, v in body.items() if k != prompt_field})


def plan(api: Api, raw: bytes, output_tokens_default: int = OUTPUT_TOKENS_DEFAULT,
         headers: Sequence[tuple[str, str]] = (),
         fields_allowed: frozenset[str] = frozenset()) -> Plan:
    """Price a request body; InvalidRequest before anything is reserved if it cannot be.

    A call that sets no output cap is sent with `output_tokens_default` (CEILING_DEFAULT_MAX_
    OUTPUT_TOKENS): without a cap there is no worst case. `headers`: the request's headers that
    FORWARDED_HEADERS names for `api`, which are forwarded with it. `fields_allowed`: the
    operator's fields forwarded besides the route's own (CEILING_GATEWAY_FIELDS_ALLOWED)."""
    body = loads_object(raw)
    _check_fields(api, body, fields_allowed)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model is required", field="model")
    if api is Api.MESSAGES:
        return _messages_plan(body, model, tuple(headers), output_tokens_default)
    for field in UNBOUNDED_FIELDS[api]:
        if body.get(field) not in (None, False):
            raise InvalidRequest(
                f"{field} is not supported: the gateway cannot bound its cost from the request",
                field=field,
            )
    # Audio output is asked for by `modalities` (`audio` only picks a voice and format, which a
    # provider may default): billed at audio rates, and refused like `audio`.
    modalities = body.get("modalities") if api is Api.CHAT else None
    if modalities is not None and (
        not isinstance(modalities, list) or any(m != "text" for m in modalities)
    ):
        raise InvalidRequest(
            "modalities other than text are not supported: audio output is billed at audio "
            "rates the gateway cannot bound from the request", field="modalities",
        )
    for field in UNBOUNDED_INPUT_FIELDS[api]:
        if body.get(field) not in (None, False):
            raise InputUnbounded(
                f"{field} feeds the model input the request does not contain, of a size it "
                "cannot show", field=field,
            )
    service_tier = check_service_tier(body.get("service_tier")) or TIER_AUTO
    prompt = _prompt(api, body)
    output_tokens_max = _output_cap(api, body, output_tokens_default)
    choices = body.get("n")
    choices = 1 if api is Api.RESPONSES or choices is None else _positive_int(choices, "n")
    stream = body.get("stream") is True
    usage_wanted = False
    if stream and api is Api.CHAT:
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise InvalidRequest("stream_options must be an object", field="stream_options")
        usage_wanted = options.get("include_usage") is True
        body["stream_options"] = {**options, "include_usage": True}
    text_tokens = _text_tokens(body, "messages" if api is Api.CHAT else "input", prompt)
    return Plan(api, model, body, stream, text_tokens, output_tokens_max, choices, usage_wanted,
                prompt.media, service_tier)


def _check_fields(api: Api, body: dict[str, Any], fields_allowed: frozenset[str]) -> None:
    known = ALLOWED_FIELDS[api]
    for field in body:
        if field not in known and field not in fields_allowed and field not in (
                UNBOUNDED_FIELDS.get(api, ())) and field not in UNBOUNDED_INPUT_FIELDS.get(api, ()):
            # Named as sent, but a lone surrogate (valid in a JSON escape, not in UTF-8) is
            # shown escaped: the answer must encode.
            field = field.encode("utf-8", "backslashreplace").decode()
            raise FieldUnsupported(
                f"{field} is not a field the gateway forwards: what it bills is not known (it "
                "may change the call's rates or feed the model input the request does not "
                "contain), so nothing was forwarded or reserved", field=field)


def _betas(headers: tuple[tuple[str, str], ...]) -> bool:
    """Check the anthropic-beta flags; whether they open the 1M-token context window."""
    long_context = False
    for name, value in headers:
        if name != "anthropic-beta":
            continue
        for beta in (b.strip() for b in value.split(",")):
            if beta == CONTEXT_1M_BETA:
                long_context = True
            elif beta and beta not in MESSAGES_BETAS:
                raise InputUnbounded(
                    f"anthropic-beta {beta!r} is not one the gateway knows the cost of: a beta "
                    "can change a call's rates or what the model reads", field="anthropic-beta")
    return long_context


def _messages_tools(tools: object) -> tuple[int, str]:
    """Check a Messages call's tools: the most web searches they allow, and the first web
    search tool's field."""
    if tools is None:
        return 0, ""
    if not isinstance(tools, list):
        raise InvalidRequest("tools must be a list", field="tools")
    searches, field = 0, ""
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else "?"
        if kind in MESSAGES_CLIENT_TOOL_TYPES:
            continue
        if isinstance(tool, dict) and isinstance(kind, str) and kind.startswith(
                WEB_SEARCH_TOOL_PREFIX):
            max_uses = tool.get("max_uses")
            if type(max_uses) is not int or max_uses < 1:
                raise InputUnbounded(
                    f"{where}.max_uses is required: a web search is billed a fee each, and "
                    "without it the number of searches has no bound", field=f"{where}.max_uses")
            searches += max_uses
            field = field or where
            continue
        raise InputUnbounded(
            f"{where} is a tool of type {kind!r}: only client tools and web search (with "
            "max_uses) are supported; Anthropic's other tools feed the model input, or bill "
            "time, that the request does not bound", field=where)
    return searches, field


def _messages_system(system: object) -> None:
    """A system prompt is text (counted by its bytes with the rest of the body)."""
    if system is None or isinstance(system, str):
        return
    if not isinstance(system, list) or any(
            not isinstance(b, dict) or b.get("type") != "text" for b in system):
        raise InputUnbounded("system must be a string or a list of text blocks", field="system")


def _messages_plan(body: dict[str, Any], model: str, headers: tuple[tuple[str, str], ...],
                   output_tokens_default: int) -> Plan:
    """An Anthropic Messages API call, priced: what plan() does for OpenAI's, in its format."""
    long_context = _betas(headers)
    _messages_system(body.get("system"))
    searches, search_field = _messages_tools(body.get("tools"))
    prompt = messages_input(body.get("messages"))
    output_tokens_max = _output_cap(Api.MESSAGES, body, output_tokens_default)
    thinking = body.get("thinking")
    budget = thinking.get("budget_tokens") if isinstance(thinking, dict) else None
    if type(budget) is int and budget > output_tokens_max:
        raise InputUnbounded(
            f"thinking.budget_tokens ({budget}) must fit inside max_tokens "
            f"({output_tokens_max}), which is what the gateway holds for all of a call's output",
            field="thinking.budget_tokens")
    tier = body.get("service_tier")
    tier = ANTHROPIC_TIERS.get(tier, tier) if isinstance(tier, str) else tier
    service_tier = check_service_tier(tier) or TIER_AUTO
    text_tokens = _text_tokens(body, "messages", prompt)
    if body.get("tools"):
        text_tokens += TOOL_USE_SYSTEM_PROMPT_TOKENS_MAX
    media = prompt.media
    if searches:
        media = replace(media, web_searches=searches, web_search_field=search_field)
    return Plan(Api.MESSAGES, model, body, body.get("stream") is True, text_tokens,
                output_tokens_max, 1, False, media, service_tier, headers, long_context)


def _count(value: object) -> int:
    if value is None:
        return 0
    if type(value) is not int or value < 0:
        raise ValueError(f"not a token count: {value!r}")
    return value


def usage_of(api: Api, usage: object, service_tier: object = None) -> Usage | None:
    """The usage a provider reported, and the service tier its answer names; None if it
    reported no usage we can read (the call is then settled from an upper bound).

    Read as OpenAI reports it: cache reads and audio are parts of the input tokens, reasoning
    and audio parts of the output tokens. Where a compatible provider reports otherwise, the
    reading that costs more is taken: reasoning tokens above the output count, or a total above
    input plus output, are output the count left out; cache reads and writes reported beside
    the input count, Anthropic's way (cache_read_input_tokens, cache_creation_input_tokens), are
    input on top of it. An answer that names no tier is priced at the dearest it could be.
    Anthropic's usage names its own tier (`standard`: the default rates) and counts the web
    searches run (`server_tool_use`)."""
    if not isinstance(usage, dict):
        return None
    input_field, output_field, input_details, output_details = USAGE_FIELDS[api]
    if api is Api.MESSAGES:
        service_tier = usage.get("service_tier")
        service_tier = ANTHROPIC_TIERS.get(service_tier, service_tier) if isinstance(
            service_tier, str) else None
    try:
        given_in = usage.get(input_details) or {}
        given_out = usage.get(output_details) or {}
        if not isinstance(given_in, dict) or not isinstance(given_out, dict):
            return None
        input_tokens, output_tokens = _count(usage[input_field]), _count(usage[output_field])
        # Anthropic's cache counts sit beside the input count rather than in it; the 1-hour
        # writes are split out of all writes in `cache_creation`.
        creation = usage.get("cache_creation")
        creation = creation if isinstance(creation, dict) else {}
        writes_1h = _count(creation.get("ephemeral_1h_input_tokens"))
        writes_beside = max(_count(usage.get("cache_creation_input_tokens")),
                            writes_1h + _count(creation.get("ephemeral_5m_input_tokens")))
        reads_beside = _count(usage.get("cache_read_input_tokens"))
        input_tokens += writes_beside + reads_beside
        reads = _count(given_in.get("cached_tokens")) + reads_beside
        writes = _count(given_in.get("cache_write_tokens")) + writes_beside - writes_1h
        reasoning = _count(given_out.get("reasoning_tokens"))
        if reasoning > output_tokens:
            output_tokens += reasoning
        total = usage.get("total_tokens")
        if type(total) is int and total - input_tokens > output_tokens:
            output_tokens = total - input_tokens
        server_tools = usage.get("server_tool_use")
        searches = _count(server_tools.get("web_search_requests")) if isinstance(
            server_tools, dict) else 0
        return Usage(
            input_tokens, output_tokens, reads, writes, writes_1h,
            _count(given_in.get("audio_tokens")), _count(given_out.get("audio_tokens")),
            service_tier if isinstance(service_tier, str) and service_tier else TIER_AUTO,
            searches,
        )
    except (KeyError, ValueError, CeilingError):
        return None


def merged_usage(start: dict[str, Any], delta: dict[str, Any]) -> dict[str, Any]:
    """A Messages stream's usage so far: message_start's, under the cumulative counts of a later
    message_delta (which may leave fields out, and come more than once with server tools). A
    delta that raises the cache writes without saying their TTLs leaves the split the start
    gave: the writes it adds are read as 1-hour ones, the reading that costs no less."""
    usage = {**start, **delta}
    split = start.get("cache_creation")
    if "cache_creation" not in delta and isinstance(split, dict):
        five_m = split.get("ephemeral_5m_input_tokens")
        written = usage.get("cache_creation_input_tokens")
        if type(five_m) is int and type(written) is int and written >= five_m:
            usage["cache_creation"] = {**split, "ephemeral_1h_input_tokens": written - five_m}
    return usage


class StreamTally:
    """What a provider's stream has said so far, and which of its bytes the client gets.

    Fed the stream's bytes as they come, it splits them into server-sent events, keeps the last
    usage reported (a provider may report cumulative usage in every chunk, vLLM's continuous
    usage stats: only the last covers the whole answer; a Messages stream reports its input in
    message_start and cumulative counts in message_delta), notes the terminal event (chat's
    `data: [DONE]`; Responses' response.completed / .incomplete / .failed; Messages'
    message_stop), and returns the events to forward: all of them but the usage chunk the
    gateway asked for on the client's behalf, and the chat stream's `[DONE]`, which the relay
    sends after its trailer. A stream is complete only once its terminal event came: usage seen
    before it may be partial.
    """

    def __init__(self, call_plan: Plan) -> None:
        self.plan = call_plan
        self.usage: Usage | None = None
        self.finished = False
        self._buffer = b""
        self._messages_usage: dict[str, Any] = {}

    def feed(self, chunk: bytes) -> bytes:
        self._buffer += chunk
        if b"\r" in self._buffer:
            self._buffer = self._buffer.replace(b"\r\n", b"\n")
        out = []
        while (end := self._buffer.find(b"\n\n")) >= 0:
            event, self._buffer = self._buffer[:end], self._buffer[end + 2:]
            data = [line[5:].removeprefix(b" ") for line in event.split(b"\n")
                    if line.startswith(b"data:")]
            if not data or self._take(b"\n".join(data).decode(errors="replace")):
                out.append(event + b"\n\n")
        return b"".join(out)

    def _take(self, data: str) -> bool:
        if self.plan.api is Api.CHAT and data == "[DONE]":
            self.finished = True
            return False
        doc = loads_answer(data)
        if not isinstance(doc, dict):
            return True
        if self.plan.api is Api.MESSAGES:
            self._take_messages(doc)
            return True
        if self.plan.api is Api.RESPONSES:
            if doc.get("type") in RESPONSES_TERMINAL_EVENTS:
                self.finished = True
                response = doc.get("response")
                self.usage = usage_of(
                    Api.RESPONSES, response.get("usage"), response.get("service_tier")
                ) if isinstance(response, dict) else None
            return True
        usage = usage_of(Api.CHAT, doc.get("usage"), doc.get("service_tier"))
        if usage is not None:
            self.usage = usage
        return usage is None or doc.get("choices") != [] or self.plan.usage_wanted

    def _take_messages(self, doc: dict[str, Any]) -> None:
        kind = doc.get("type")
        if kind == "message_start":
            message = doc.get("message")
            usage = message.get("usage") if isinstance(message, dict) else None
            self._messages_usage = dict(usage) if isinstance(usage, dict) else {}
        elif kind == "message_delta":
            usage = doc.get("usage")
            if isinstance(usage, dict):
                self._messages_usage = merged_usage(self._messages_usage, usage)
        elif kind == "message_stop":
            self.finished = True
            self.usage = usage_of(Api.MESSAGES, self._messages_usage or None)


def body_outcome(call_plan: Plan, raw: bytes) -> tuple[Usage | None] | None:
    """A complete non-streaming answer's usage (None inside when it reports none); None if the
    answer is not a JSON object, which leaves the call's outcome unknown."""
    doc = loads_answer(raw)
    if not isinstance(doc, dict):
        return None
    return (usage_of(call_plan.api, doc.get("usage"), doc.get("service_tier")),)


_background: set[asyncio.Task[None]] = set()


def spawn(work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    """Run `work` in a task of its own, kept referenced until it finishes."""
    task = asyncio.create_task(work)
    _background.add(task)
    task.add_done_callback(_background.discard)
    return task


class OutputLengths:
    """One instance's view of output lengths: each model's p95 from the ledger's shared
    histograms, cached, and the lengths it records into them, sampled."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._cache: dict[str, tuple[float, int | None]] = {}
        self._recorded_at_s: dict[str, float] = {}

    def record(self, store: LedgerStore, model: str, output_tokens: int) -> None:
        """Count one call's output length (per choice), unless this model was counted just now."""
        key = model.lower()
        now_s = self._clock()
        if now_s - self._recorded_at_s.get(key, -OBSERVE_INTERVAL_S) < OBSERVE_INTERVAL_S:
            return
        if len(self._recorded_at_s) >= HISTOGRAM_MODELS_MAX:
            self._recorded_at_s.clear()
        self._recorded_at_s[key] = now_s
        spawn(_observe(store, model, output_tokens))

    async def p95_tokens(self, store: LedgerStore, model: str) -> int | None:
        key = model.lower()
        now_s = self._clock()
        cached = self._cache.get(key)
        if cached is not None and cached[0] > now_s:
            return cached[1]
        try:
            histogram = await store.output_histogram(model)
        except CeilingError:
            histogram = {}  # no p95 without the ledger: the full worst case is held
        tokens = output_stats.p95(histogram)
        if len(self._cache) >= HISTOGRAM_MODELS_MAX:
            self._cache.clear()
        self._cache[key] = (now_s + HISTOGRAM_CACHE_S, tokens)
        return tokens


@dataclass(frozen=True)
class Hold:
    """A call's reservation, and the plan as it is forwarded (its output cap maybe clamped)."""

    reservation: Reservation
    plan: Plan
    clamped: bool


def _room_micros(legs: tuple[LegStatus, ...]) -> int:
    return min((leg.remaining_micros for leg in legs), default=0)


async def hold(
    svc: CeilingService, who: Caller, call_plan: Plan, lengths: OutputLengths, *, clamp: bool,
    p95: bool,
) -> Hold:
    """Reserve for a call: its worst case; with `p95` (CEILING_HOLD_P95=1, off by default) its
    p95 while the budget is far from its ceiling.

    Reserving every call's full output cap locks a small budget after a few concurrent calls,
    though most use a fraction of it; so while a budget is far from its ceiling the hold is the
    model's p95 output length. A call may then use more than its hold; settle charges it in full
    and records the overshoot. The p95 hold is kept only if, with it in place, every budget of
    the call still has the call's full worst case left (the margin): even if this call runs to
    its cap, what the provider bills for it fits under the ceiling. Within the margin the full
    worst case is held.

    The margin covers one call's overshoot. Several calls held at their p95 at once can each
    overshoot, and the holds admitted after them fill the room the margin kept: if k of them run
    past their p95 near the ceiling, the bill can exceed it by up to the sum of their (worst case
    - p95). No hold smaller than the worst case can rule that out under concurrency; only the
    worst case does, which is what is held as soon as the margin is reached.

    With `clamp` (X-Ceiling-Clamp: 1), a call whose worst case does not fit is sent with the
    largest output cap that does, if that is at least CLAMP_OUTPUT_TOKENS_MIN; else it is refused.
    """
    if call_plan.long_context and len(svc.prices.rates(call_plan.model).input) < 2:
        # Priced by input size only where the rates have a tier by it (the long-context one).
        raise InputUnbounded(
            f"anthropic-beta {CONTEXT_1M_BETA} bills a call above 200K input tokens at "
            f"long-context rates, which the gateway does not know for model "
            f"{call_plan.model!r}", field="anthropic-beta", model=call_plan.model)
    p95_tokens = await lengths.p95_tokens(svc.store, call_plan.model) if p95 else None
    if p95_tokens is not None and p95_tokens < call_plan.output_tokens_max:
        try:
            reservation = await svc.reserve(who, call_plan.spec(p95_tokens))
        except BudgetRefused as refusal:
            return await _clamped_or_refused(svc, who, call_plan, refusal, clamp)
        if _room_micros(reservation.legs) >= svc.worst_case_micros(call_plan.spec())[0]:
            return Hold(reservation, call_plan, clamped=False)
        await svc.release(who, reservation.reservation_id)
    try:
        return Hold(await svc.reserve(who, call_plan.spec()), call_plan, clamped=False)
    except BudgetRefused as refusal:
        return await _clamped_or_refused(svc, who, call_plan, refusal, clamp)


async def _clamped_or_refused(
    svc: CeilingService, who: Caller, call_plan: Plan, refusal: BudgetRefused, clamp: bool
) -> Hold:
    if not clamp:
        raise refusal
    room_micros = _room_micros(await svc.my_budgets(who))
    # The largest cap whose worst case fits the room; the worst case grows with the cap.
    low, high = 0, call_plan.output_tokens_max - 1
    while low < high:
        middle = (low + high + 1) // 2
        if svc.worst_case_micros(call_plan.spec(middle))[0] <= room_micros:
            low = middle
        else:
            high = middle - 1
    if low < CLAMP_OUTPUT_TOKENS_MIN:
        raise refusal
    clamped = call_plan.clamped(low)
    return Hold(await svc.reserve(who, clamped.spec()), clamped, clamped=True)


@dataclass(frozen=True)
class Bill:
    """A call's figures for its answer: held, charged (or to be charged), and what is left."""

    reservation_id: str
    reserved_micros: int
    charged_micros: int
    outcome: Outcome
    remaining_micros: int | None  # the tightest budget of the call's path
    run_remaining_micros: int | None  # the run's budget, when the call named a run


class Call:
    """One call's reservation, from the hold to the one way it is resolved."""

    def __init__(self, svc: CeilingService, who: Caller, held: Hold,
                 lengths: OutputLengths) -> None:
        self.svc, self.who, self.hold, self.lengths = svc, who, held, lengths

    def bill(self, charged_micros: int, outcome: Outcome) -> Bill:
        """Figures as of the reservation's snapshot of its budgets, with this call resolved."""
        reservation = self.hold.reservation
        held = reservation.reserved_micros
        run = self.who.run_limit()
        remaining = run_remaining = None
        for leg in reservation.legs:
            left = max(0, leg.ceiling_micros - leg.committed_micros - leg.reserved_micros
                       + held - charged_micros)
            if run is not None and leg.budget_id == run.budget_id.path:
                run_remaining = left
            else:
                remaining = left if remaining is None else min(remaining, left)
        return Bill(reservation.reservation_id, held, charged_micros, outcome, remaining,
                    run_remaining)

    def leave_open(self) -> Bill:
        """Unknown outcome: keep the hold. Expiry charges it (outcome 'unknown'); an operator
        who reads the provider's bill may correct it by the reservation id in the answer
        (POST /v1/admin/reservations/{id}/settle). No API key can."""
        return self.bill(self.hold.reservation.reserved_micros, Outcome.UNKNOWN)

    async def release(self) -> Bill:
        try:
            await self.svc.release(self.who, self.hold.reservation.reservation_id)
        except CeilingError:
            return self.leave_open()
        return self.bill(0, Outcome.RELEASED)

    async def settle(self, usage: Usage | None) -> Bill:
        """Settle a complete answer from the provider's usage; without usage, at the call's
        worst case (the whole hold, or more under a p95 hold): the visible answer does not bound
        what was billed (hidden reasoning tokens), and the worst case does."""
        call_plan = self.hold.plan
        if usage is not None and usage.service_tier == TIER_AUTO != call_plan.service_tier:
            # The answer names no tier: it was served at the one the request named, if any.
            usage = replace(usage, service_tier=call_plan.service_tier)
        try:
            spec = SettleSpec(usage) if usage is not None else SettleSpec(actual_micros=max(
                self.hold.reservation.reserved_micros,
                self.svc.worst_case_micros(call_plan.spec())[0]))
            settled = await self.svc.settle(
                self.who, self.hold.reservation.reservation_id, spec
            )
        except CeilingError:
            # The lease is still held; expiry charges it. So is a usage that cannot be priced
            # (audio for a model with no audio rate, a tier with no known rates): never low.
            return self.leave_open()
        if usage is None:
            return self.bill(settled.charged_micros, Outcome.ESTIMATED)
        self.lengths.record(self.svc.store, call_plan.model,
                            math.ceil(usage.output_tokens / call_plan.choices))
        return self.bill(settled.charged_micros, Outcome.BILLED)


async def _observe(store: LedgerStore, model: str, output_tokens: int) -> None:
    try:
        await store.observe_output(model, output_tokens)
    except CeilingError:
        return  # a lost observation moves a p95 by nothing; no money depends on it
