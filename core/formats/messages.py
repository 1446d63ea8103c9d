"""Anthropic's Messages API: POST /v1/messages, forwarded to CEILING_ANTHROPIC_URL's v1/messages
with the provider's key in x-api-key, and the client's anthropic-version and anthropic-beta.

Besides what every format prices, a Messages call is priced with its betas (refused unless the
gateway knows what they bill; the 1M-token context one at long-context rates), its tool-use
system prompt, its thinking budget (inside max_tokens), and its web searches (a fee each, up to
their `max_uses`). Its usage sits beside the input count and reports in parts on a stream.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from core.content import InputBound, Walk, encodable, messages_bound
from core.errors import CeilingError, InputUnbounded, InvalidRequest
from core.formats.base import (
    Api,
    Bounds,
    Plan,
    Provider,
    StreamTally,
    WireFormat,
    read_usage,
    text_tokens,
)
from core.formats.schema import (
    BOOLEAN,
    IMAGE_URL,
    JSON_SCHEMA,
    MODEL,
    STRING,
    TOKENS,
    Schema,
    any_of,
    array,
    const,
    object_of,
)
from core.ledger import Upstream
from core.prices import TIER_AUTO, TIER_DEFAULT, Usage, check_service_tier
from core.upstream_kinds.anthropic import ANTHROPIC_API_HOST

# The SDK's base URL, without /v1, is the setting's.
ANTHROPIC = Provider(Upstream.ANTHROPIC, "CEILING_ANTHROPIC_URL", "https://api.anthropic.com",
                     lambda config: config.anthropic_url, lambda config: config.anthropic_api_key,
                     ("x-api-key", ""), ("anthropic-ratelimit-",), ANTHROPIC_API_HOST)
# The top-level fields whose cost the gateway knows: those the worst case reads, those that
# change nothing it leaves out (sampling, stop sequences, metadata, effort, which spends within
# max_tokens), and those it holds at a bound (output_config's and output_format's schema by its
# bytes plus a system prompt, context_management below). Any other is refused by name: fast
# mode's `speed` and `inference_geo` bill other rates; `container` and `mcp_servers` run code
# or remote tools nothing in the request bounds; and a field added after this list may do
# either.
MESSAGES_FIELDS = frozenset({
    "model", "messages", "max_tokens", "system", "metadata", "stop_sequences", "stream",
    "temperature", "top_p", "top_k", "tools", "tool_choice", "thinking", "service_tier",
    "cache_control", "output_config", "output_format", "context_management",
})
# anthropic-beta flags that change nothing the worst case leaves out. A beta only opens a
# feature; what the feature bills is in the body, which is checked by its own allow-lists (the
# fields above, tool types, content blocks). So these are known to bill nothing beyond what is
# held: interleaved thinking (the output is still capped by max_tokens), how tool input streams,
# fewer tokens for tool calls, a higher max_tokens (which is held), 1-hour cache writes (every
# input token is held at the dearest input rate, a 1-hour write's included), prompt caching's
# flags, the Files API (a file is held at the context window), Claude Code's identification,
# context management and compaction (held as context_management says), effort, structured
# outputs, advanced tool use (deferred tools are definitions the body carries; tool search and
# programmatic calls are tools, checked by type), PDFs and citations (held at the window),
# search result blocks, token counting, the stop reason for a full window, Claude Code's
# per-turn settings and tool changes (messages and definitions the body carries), and a count
# of thinking tokens in the usage. The 1M-token
# context is priced at its long-context rates (CONTEXT_1M_BETA). Any other beta is refused
# unless the operator names it (CEILING_GATEWAY_BETAS_ALLOWED): a beta can change the rates (fast
# mode) or what the model reads.
MESSAGES_BETAS = frozenset({
    "interleaved-thinking-2025-05-14", "fine-grained-tool-streaming-2025-05-14",
    "token-efficient-tools-2025-02-19", "output-128k-2025-02-19",
    "extended-cache-ttl-2025-04-11", "prompt-caching-2024-07-31", "files-api-2025-04-14",
    "claude-code-20250219", "context-management-2025-06-27", "compact-2026-01-12",
    "effort-2025-11-24", "structured-outputs-2025-11-13", "advanced-tool-use-2025-11-20",
    "tool-examples-2025-10-29", "pdfs-2024-09-25", "search-results-2025-06-09",
    "token-counting-2024-11-01", "model-context-window-exceeded-2025-08-26",
    "prompt-caching-scope-2026-01-05", "per-turn-control-2026-07-01",
    "mid-conversation-tool-changes-2026-07-01", "thinking-token-count-2026-05-13",
})
# Context management edits that only clear content from the input (tool results, tool inputs,
# earlier thinking): the body's bound holds. Compaction summarizes the context in a step of its
# own: held at the context window twice and the output cap twice (core/prices/).
CONTEXT_EDITS_CLEARING = frozenset({"clear_tool_uses_20250919", "clear_thinking_20251015"})
CONTEXT_EDITS_COMPACTING = frozenset({"compact_20260112"})
# The max_uses the gateway sets on a web search tool that gives none: each use held is a fee and
# a context window of input more (core/prices/).
WEB_SEARCH_MAX_USES_DEFAULT = 5
# Opens a model's 1M-token window; a call above 200K input tokens is then billed whole at the
# model's long-context rates. Forwarded only for a model whose rates have that tier.
# A prompt-cache entry's TTL unless its cache_control says otherwise; written at the 5-minute
# write rate.
CACHE_TTL_DEFAULT = "5m"
CONTEXT_1M_BETA = "context-1m-2025-08-07"
LONG_CONTEXT_WINDOW_TOKENS = 1_000_000
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
# The key as Anthropic's clients send it, and the headers forwarded with the body.
HEADER_SCHEMAS: dict[str, Schema] = {
    "x-api-key": {"type": "string", "description": "the API key, when no Authorization is sent"},
    "anthropic-version": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
    "anthropic-beta": {"type": "string",
                       "description": "comma-separated beta flags; only those the gateway "
                       "knows the cost of are accepted"},
}

# The gateway's error code -> Anthropic's error type (https://platform.claude.com/docs/en/api/
# errors). Every code api/errors.py knows has one (tests/api/test_messages_parts.py): a new code
# must say how an Anthropic client sees it. The `anthropic` SDK retries 408, 409, 429 and >= 500
# unless the answer says `x-should-retry: false`, as OpenAI's do (api/refusals.py).
ANTHROPIC_TYPES = {
    "invalid_request": "invalid_request_error",
    "model_unpriced": "invalid_request_error",
    "input_unbounded": "invalid_request_error",
    "model_unbounded": "invalid_request_error",
    "field_unsupported": "invalid_request_error",
    "model_not_routed": "invalid_request_error",
    "unauthorized": "authentication_error",
    "forbidden": "permission_error",
    "budget_not_found": "not_found_error",
    "reservation_not_found": "not_found_error",
    "not_found": "not_found_error",
    "method_not_allowed": "invalid_request_error",
    "payload_too_large": "request_too_large",
    # Anthropic's own word for an account that cannot pay for the call.
    "budget_exceeded": "billing_error",
    "budget_busy": "rate_limit_error",
    "state_quota": "rate_limit_error",
    "rate_limited": "rate_limit_error",
    "concurrency_limited": "rate_limit_error",
    "users_exhausted": "permission_error",
    "model_not_allowed": "permission_error",
    "user_required": "invalid_request_error",
    "budget_paused": "billing_error",
    "idempotency_conflict": "invalid_request_error",
    "idempotency_in_flight": "invalid_request_error",
    "reply_not_kept": "invalid_request_error",
    "reservation_resolved": "invalid_request_error",
    "operation_refused": "invalid_request_error",
    "budget_in_use": "invalid_request_error",
    "ledger_not_empty": "invalid_request_error",
    "upstream_unreachable": "api_error",
    "upstream_timeout": "timeout_error",
    "upstream_answer_too_large": "api_error",
    "cost_report_failed": "api_error",
    "ledger_unavailable": "api_error",
    "ledger_not_shared": "api_error",
    "invalid_configuration": "api_error",
    "invariant_broken": "api_error",
}
# A code not in the table yet (a test names it) still answers in Anthropic's shape.
ANTHROPIC_TYPE_DEFAULT = "api_error"


def anthropic_shape(error: dict[str, Any]) -> dict[str, Any]:
    """{"type": "error", "error": {"type", "message", "code", ...details}}: what Anthropic's
    clients parse, `error.type` one of Anthropic's, chosen by the gateway's code; `code` and
    the details are the gateway's own, as on every other route."""
    error = dict(error)
    code = error.pop("code")
    error.pop("type")
    return {"type": "error", "error": {
        "type": ANTHROPIC_TYPES.get(code, ANTHROPIC_TYPE_DEFAULT),
        "message": error.pop("message"), "code": code, **error}}


def merged_usage(start: dict[str, Any], delta: dict[str, Any]) -> dict[str, Any]:
    """A stream's usage so far: message_start's, under the cumulative counts of a later
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


# -- its input ----------------------------------------------------------------------------------

# Blocks that carry text only (the model's own turns sent back included: tool calls, web search
# results): bounded by their bytes like any text.
MESSAGES_TEXT_BLOCKS = frozenset({
    "text", "tool_use", "server_tool_use", "web_search_tool_result", "search_result",
})
# Thinking sent back is billed as the thinking its signature carries (encrypted), not as the
# text it shows: a summary, or nothing under `display: omitted` (Claude Code's). Redacted
# thinking is encrypted whole. Neither's bytes are documented to bound its tokens; one block is
# at most what one call writes (core/prices/ holds each at the model's output maximum, or the
# context window where that is not known).
MESSAGES_THINKING_BLOCKS = frozenset({"thinking", "redacted_thinking"})
# Blocks of server tools' results sent back, and references to what the provider holds (a
# container's file, a tool loaded by tool search): input whose billed size the request does not
# show, held at the context window.
MESSAGES_REFERRED_BLOCKS = frozenset({
    "web_fetch_tool_result", "code_execution_tool_result", "bash_code_execution_tool_result",
    "text_editor_code_execution_tool_result", "tool_search_tool_result", "tool_reference",
    "mcp_tool_use", "mcp_tool_result", "container_upload",
})
IMAGE_MEDIA_TYPE_PREFIX = "image/"
# Document sources whose billed size the request does not show (a PDF's pages, a file).
MESSAGES_DOCUMENT_SOURCES = frozenset({"base64", "url", "file"})


def _blocks(walk: Walk, content: object, field: str) -> list[Any]:
    if not isinstance(content, list):
        raise InputUnbounded(f"{field} must be a string or a list of content blocks",
                             field=field)
    return [_block(walk, block, f"{field}[{j}]") for j, block in enumerate(content)]


def _block(walk: Walk, block: object, field: str) -> object:
    """One content block, its media counted and blanked; what it only names is refused."""
    if not isinstance(block, dict):
        raise InputUnbounded(f"{field} must be a content block object", field=field)
    kind = block.get("type")
    if not isinstance(kind, str):
        raise InputUnbounded(f"{field}.type must name the block's type", field=f"{field}.type")
    if kind in MESSAGES_TEXT_BLOCKS:
        return block
    if kind == "image":
        return _image(walk, block, field)
    if kind == "document":
        return _document(walk, block, field)
    if kind == "tool_result":
        content = block.get("content")
        if content is None or isinstance(content, str):
            return block
        return {**block, "content": _blocks(walk, content, f"{field}.content")}
    if kind in MESSAGES_REFERRED_BLOCKS:
        walk.refer(field)
        return {"type": kind}
    if kind in MESSAGES_THINKING_BLOCKS:
        walk.thinking_blocks += 1
        walk.thinking_field = walk.thinking_field or field
        return {"type": kind}
    # Anything newer: input the gateway cannot bound.
    raise InputUnbounded(
        f"{field} is a content block of type {kind!r}, which the gateway cannot bound",
        field=field)


def _image(walk: Walk, block: dict[str, Any], field: str) -> dict[str, Any]:
    """An image is billed by the model's per-image bound whatever its size, so its source (its
    data, a URL or a file the provider holds) is not read, only checked to be an image's."""
    source = block.get("source")
    where = f"{field}.source"
    if not isinstance(source, dict):
        raise InputUnbounded(f"{where} must be an image source object", field=where)
    kind = source.get("type")
    if kind == "base64":
        media_type = source.get("media_type")
        if not isinstance(media_type, str) or not media_type.startswith(IMAGE_MEDIA_TYPE_PREFIX):
            raise InputUnbounded(f"{where}.media_type must be an image's",
                                 field=f"{where}.media_type")
        payload = "data"
    elif kind == "url":
        payload = "url"
    elif kind == "file":
        payload = "file_id"
    else:
        raise InputUnbounded(f"{where}.type must be base64, url or file", field=f"{where}.type")
    value = source.get(payload)
    if not isinstance(value, str) or not value or not encodable(value):
        raise InvalidRequest(f"{where}.{payload} must be a non-empty string",
                             field=f"{where}.{payload}")
    walk.images_high += 1
    walk.image_field = walk.image_field or where
    return {**block, "source": {**source, payload: ""}}


def _document(walk: Walk, block: dict[str, Any], field: str) -> dict[str, Any]:
    """A document of text, or of text and image blocks, is bounded as they are. A PDF (sent or
    by URL or file) is billed for text its bytes do not bound (its streams are compressed) and
    an image of each page, and citations add a system prompt and chunking of an undocumented
    size: held at the context window, like a file by URL or id."""
    citations = block.get("citations")
    if isinstance(citations, dict) and citations.get("enabled") not in (None, False):
        walk.refer(f"{field}.citations")
    source = block.get("source")
    where = f"{field}.source"
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "text":
        return block
    if kind == "content" and isinstance(source, dict):
        content = source.get("content")
        if isinstance(content, str):
            return block
        return {**block, "source": {**source, "content": _blocks(
            walk, content, f"{where}.content")}}
    if kind in MESSAGES_DOCUMENT_SOURCES:
        walk.refer(where)
        return {"type": "document"}
    raise InputUnbounded(f"{where}.type must be one of text, content, "
                         f"{', '.join(sorted(MESSAGES_DOCUMENT_SOURCES))}", field=where)


def _message(walk: Walk, message: dict[str, Any], field: str) -> dict[str, Any]:
    content = message.get("content")
    if content is None or isinstance(content, str):
        return message
    return {**message, "content": _blocks(walk, content, f"{field}.content")}


def messages_input(messages: Any) -> InputBound:
    """The input bound of Anthropic Messages API `messages`: their text by bytes, their images
    counted; documents other than text, and blocks the gateway does not know, refused."""
    return messages_bound(messages, _message)


# -- its body, for the OpenAPI document (core/formats/schema.py) ----------------------------------

CACHE_CONTROL = object_of({"type": const("ephemeral"),
                           "ttl": {"type": "string", "enum": ["5m", "1h"]}}, ("type",),
                          more=False)
TEXT = {"type": "string", "minLength": 1}
TEXT_BLOCK = object_of({"type": const("text"), "text": TEXT, "cache_control": CACHE_CONTROL},
                       ("type", "text"))
IMAGE_SOURCE = any_of(
    object_of({"type": const("base64"),
               "media_type": {"type": "string",
                              "enum": ["image/jpeg", "image/png", "image/gif", "image/webp"]},
               "data": {"type": "string", "description": "the image, base64-encoded"}},
              ("type", "media_type", "data"), more=False),
    object_of({"type": const("url"), "url": IMAGE_URL}, ("type", "url"), more=False),
    object_of({"type": const("file"), "file_id": STRING}, ("type", "file_id"), more=False),
)
IMAGE_BLOCK = object_of({"type": const("image"), "source": IMAGE_SOURCE,
                         "cache_control": CACHE_CONTROL}, ("type", "source"))
# Documents of text only: a PDF, or a file by URL or id, is held at the context window and not
# documented as accepted.
TEXT_DOCUMENT_BLOCK = object_of({
    "type": const("document"),
    "source": object_of({"type": const("text"), "media_type": const("text/plain"),
                         "data": STRING}, ("type", "media_type", "data"), more=False),
    "title": STRING, "context": STRING, "cache_control": CACHE_CONTROL,
}, ("type", "source"))
TOOL_USE_BLOCK = object_of({"type": const("tool_use"), "id": STRING, "name": STRING,
                            "input": {"type": "object"}}, ("type", "id", "name", "input"))
TOOL_RESULT_BLOCK = object_of({
    "type": const("tool_result"), "tool_use_id": STRING,
    "content": any_of(STRING, array(any_of(TEXT_BLOCK, IMAGE_BLOCK))), "is_error": BOOLEAN,
    "cache_control": CACHE_CONTROL,
}, ("type", "tool_use_id"))
THINKING_BLOCK = object_of({"type": const("thinking"), "thinking": STRING, "signature": STRING},
                           ("type", "thinking", "signature"))
# Turns take the blocks of their role, and are not empty (but for a last assistant turn, which
# the model continues).
USER_TURN = object_of({
    "role": const("user"),
    "content": any_of(TEXT, array(any_of(
        TEXT_BLOCK, IMAGE_BLOCK, TEXT_DOCUMENT_BLOCK, TOOL_RESULT_BLOCK), min_items=1)),
}, ("role", "content"), more=False)
ASSISTANT_TURN = object_of({
    "role": const("assistant"),
    "content": any_of(STRING, array(any_of(TEXT_BLOCK, TOOL_USE_BLOCK, THINKING_BLOCK))),
}, ("role", "content"), more=False)
CUSTOM_TOOL = object_of({"type": const("custom"), "name": STRING, "description": STRING,
                         "input_schema": JSON_SCHEMA, "cache_control": CACHE_CONTROL},
                        ("name", "input_schema"))
# Web search only with max_uses, which bounds its fees; its results need the model's bound
# (web_search_result_tokens_max) in the prices file.
WEB_SEARCH_TOOL = object_of({"type": const("web_search_20250305"), "name": const("web_search"),
                             "max_uses": {"type": "integer", "minimum": 1}},
                            ("type", "name", "max_uses"))

# No other top-level field: the gateway refuses the ones whose cost it does not know
# (MESSAGES_FIELDS).
MESSAGES_BODY = object_of({
    "model": MODEL,
    "messages": array(any_of(USER_TURN, ASSISTANT_TURN), min_items=1),
    "max_tokens": {**TOKENS, "description": "caps all output, thinking included; with none, "
                   "the gateway sends its default cap"},
    "system": any_of(STRING, array(TEXT_BLOCK)),
    "stream": BOOLEAN,
    "tools": array(any_of(CUSTOM_TOOL, WEB_SEARCH_TOOL)),
    "tool_choice": object_of({"type": {"type": "string",
                                       "enum": ["auto", "any", "tool", "none"]},
                              "name": STRING, "disable_parallel_tool_use": BOOLEAN}, ("type",)),
    "thinking": any_of(
        object_of({"type": const("enabled"),
                   "budget_tokens": {**TOKENS, "description": "at most max_tokens"}},
                  ("type", "budget_tokens"), more=False),
        object_of({"type": const("disabled")}, ("type",), more=False)),
    "service_tier": {"type": "string", "enum": ["auto", "standard_only"]},
    "metadata": object_of({"user_id": STRING}, more=False),
    "stop_sequences": array(STRING),
    "temperature": {"type": "number", "minimum": 0, "maximum": 1},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": 0},
    "cache_control": CACHE_CONTROL,
}, ("model", "messages"), more=False)


# -- the format ---------------------------------------------------------------------------------


def _betas(headers: tuple[tuple[str, str], ...], allowed: frozenset[str]) -> bool:
    """Check the anthropic-beta flags (`allowed`: the operator's, CEILING_GATEWAY_BETAS_ALLOWED);
    whether they open the 1M-token context window."""
    long_context = False
    for name, value in headers:
        if name != "anthropic-beta":
            continue
        for beta in (b.strip() for b in value.split(",")):
            if beta == CONTEXT_1M_BETA:
                long_context = True
            elif beta and beta not in MESSAGES_BETAS and beta not in allowed:
                raise InputUnbounded(
                    f"anthropic-beta {beta!r} is not one the gateway knows the cost of: a beta "
                    "can change a call's rates or what the model reads. An operator who knows "
                    "it bills nothing beyond the body names it in CEILING_GATEWAY_BETAS_ALLOWED",
                    field="anthropic-beta")
    return long_context


def _tools(tools: object) -> tuple[int, str, Bounds]:
    """Check a call's tools: the most web searches they allow, the first web search tool's
    field, and the max_uses the gateway set where a web search tool gave none."""
    if tools is None:
        return 0, "", ()
    if not isinstance(tools, list):
        raise InvalidRequest("tools must be a list", field="tools")
    searches, field = 0, ""
    added: Bounds = ()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else "?"
        if kind in MESSAGES_CLIENT_TOOL_TYPES:
            continue
        if isinstance(tool, dict) and isinstance(kind, str) and kind.startswith(
                WEB_SEARCH_TOOL_PREFIX):
            if tool.get("max_uses") is None:
                tool["max_uses"] = WEB_SEARCH_MAX_USES_DEFAULT
                added += ((f"{where}.max_uses", WEB_SEARCH_MAX_USES_DEFAULT),)
            max_uses = tool["max_uses"]
            if type(max_uses) is not int or max_uses < 1:
                raise InvalidRequest(f"{where}.max_uses must be a positive integer",
                                     field=f"{where}.max_uses")
            searches += max_uses
            field = field or where
            continue
        raise InputUnbounded(
            f"{where} is a tool of type {kind!r}: only client tools and web search (held at "
            "max_uses) are supported; Anthropic's other tools feed the model input, or bill "
            "time, that the request does not bound", field=where)
    return searches, field, added


def _context_management(given: object) -> str:
    """Check context_management's edits: the field of a compacting one, or '' when they only
    clear content."""
    if given is None:
        return ""
    edits = given.get("edits") if isinstance(given, dict) else None
    if not isinstance(given, dict) or not isinstance(edits, list) or set(given) != {"edits"}:
        raise InvalidRequest("context_management must be {\"edits\": [...]}",
                             field="context_management")
    compacting = ""
    for i, edit in enumerate(edits):
        kind = edit.get("type") if isinstance(edit, dict) else None
        if kind in CONTEXT_EDITS_COMPACTING:
            compacting = compacting or f"context_management.edits[{i}]"
        elif kind not in CONTEXT_EDITS_CLEARING:
            raise InputUnbounded(
                f"context_management.edits[{i}] is an edit of type {kind!r}, which the gateway "
                "does not know the cost of", field=f"context_management.edits[{i}]")
    return compacting


def _asks_1h_cache(value: object) -> bool:
    """Whether a `cache_control` anywhere in `value` asks for a cache entry of another TTL than
    the default 5 minutes: only then can the call be billed a 1-hour write's rate."""
    if isinstance(value, dict):
        control = value.get("cache_control")
        if isinstance(control, dict) and control.get("ttl", CACHE_TTL_DEFAULT) != (
                CACHE_TTL_DEFAULT):
            return True
        return any(_asks_1h_cache(v) for v in value.values() if isinstance(v, (dict, list)))
    if isinstance(value, list):
        return any(_asks_1h_cache(v) for v in value if isinstance(v, (dict, list)))
    return False


def _output_format(body: dict[str, Any]) -> bool:
    """Check output_config (effort, format) and output_format; whether an output format is
    given (its schema is text the body carries; a format adds a system prompt)."""
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise InvalidRequest("output_config must be an object", field="output_config")
    formats = [(config or {}).get("format"), body.get("output_format")]
    for given in formats:
        if given is not None and not isinstance(given, dict):
            raise InvalidRequest("an output format must be an object", field="output_config")
    return any(given is not None for given in formats)


def _system(system: object) -> None:
    """A system prompt is text (counted by its bytes with the rest of the body)."""
    if system is None or isinstance(system, str):
        return
    if not isinstance(system, list) or any(
            not isinstance(b, dict) or b.get("type") != "text" for b in system):
        raise InputUnbounded("system must be a string or a list of text blocks", field="system")


class Messages(WireFormat):
    api = Api.MESSAGES
    routed_as = "messages"
    route = "/v1/messages"
    name = "messages"
    body_schema = MESSAGES_BODY
    provider = ANTHROPIC
    cap_fields = ("max_tokens",)
    allowed_fields = MESSAGES_FIELDS
    forwarded_headers = ("anthropic-version", "anthropic-beta")
    key_header = "x-api-key"
    count_path = "v1/messages/count_tokens"
    count_route = "/v1/messages/count_tokens"
    user_fields = (("metadata", "user_id"),)
    header_schemas = HEADER_SCHEMAS
    usage_fields = ("input_tokens", "output_tokens", "input_tokens_details",
                    "output_tokens_details")

    def plan(self, body: dict[str, Any], model: str, headers: tuple[tuple[str, str], ...],
             output_tokens_default: int, betas_allowed: frozenset[str] = frozenset()) -> Plan:
        long_context = _betas(headers, betas_allowed)
        _system(body.get("system"))
        searches, search_field, added = _tools(body.get("tools"))
        compacting = _context_management(body.get("context_management"))
        formatted = _output_format(body)
        prompt = messages_input(body.get("messages"))
        added = self.cap_added(body, output_tokens_default) + added
        output_tokens_max = self.output_cap(body, output_tokens_default)
        thinking = body.get("thinking")
        budget = thinking.get("budget_tokens") if isinstance(thinking, dict) else None
        if type(budget) is int and budget > output_tokens_max:
            raise InputUnbounded(
                f"thinking.budget_tokens ({budget}) must fit inside max_tokens "
                f"({output_tokens_max}), which is what the gateway holds for all of a call's "
                "output", field="thinking.budget_tokens")
        tier = body.get("service_tier")
        tier = ANTHROPIC_TIERS.get(tier, tier) if isinstance(tier, str) else tier
        service_tier = check_service_tier(tier) or TIER_AUTO
        text_tokens_max = text_tokens(body, "messages", prompt)
        if body.get("tools") or formatted:
            # Structured outputs add a system prompt of their own, of no published size: held
            # at the tool-use one's, the largest Anthropic publishes.
            text_tokens_max += TOOL_USE_SYSTEM_PROMPT_TOKENS_MAX
        media = prompt.media
        if searches:
            media = replace(media, web_searches=searches, web_search_field=search_field)
        if compacting:
            media = replace(media, compaction_field=compacting)
        if long_context and (media.referred_field or compacting or searches):
            media = replace(media, window_tokens=LONG_CONTEXT_WINDOW_TOKENS)
        if not _asks_1h_cache(body):
            media = replace(media, cache_1h=False)
        return Plan(self, model, body, body.get("stream") is True, text_tokens_max,
                    output_tokens_max, 1, False, media, service_tier, headers, long_context,
                    added)

    def count_checked(self, body: dict[str, Any], headers: tuple[tuple[str, str], ...],
                      betas_allowed: frozenset[str]) -> None:
        _betas(headers, betas_allowed)

    def clamped_body(self, body: dict[str, Any], output_tokens_max: int) -> dict[str, Any]:
        body = super().clamped_body(body, output_tokens_max)
        thinking = body.get("thinking")
        if isinstance(thinking, dict) and type(thinking.get("budget_tokens")) is int and (
                thinking["budget_tokens"] >= output_tokens_max):
            # The thinking budget must stay below the cap; lowered with it (a budget below the
            # provider's minimum is then the provider's to refuse, which releases the hold).
            body["thinking"] = {**thinking, "budget_tokens": output_tokens_max - 1}
        return body

    def long_context_refusal(self, model: str) -> CeilingError:
        return InputUnbounded(
            f"anthropic-beta {CONTEXT_1M_BETA} bills a call above 200K input tokens at "
            f"long-context rates, which the gateway does not know for model {model!r}",
            field="anthropic-beta", model=model)

    def usage_of(self, usage: object, service_tier: object = None) -> Usage | None:
        """Its usage names its own tier (`standard`: the default rates) and counts the web
        searches run (`server_tool_use`); the answer's own tier is not read."""
        tier = usage.get("service_tier") if isinstance(usage, dict) else None
        return read_usage(usage, self.usage_fields,
                          ANTHROPIC_TIERS.get(tier, tier) if isinstance(tier, str) else None)

    def stream_event(self, tally: StreamTally, doc: dict[str, Any]) -> bool:
        # The input is reported in message_start, cumulative counts in message_delta; the stream
        # ends on message_stop.
        kind = doc.get("type")
        if kind == "message_start":
            message = doc.get("message")
            usage = message.get("usage") if isinstance(message, dict) else None
            tally.reported = dict(usage) if isinstance(usage, dict) else {}
        elif kind == "message_delta":
            usage = doc.get("usage")
            if isinstance(usage, dict):
                tally.reported = merged_usage(tally.reported, usage)
        elif kind == "message_stop":
            tally.finished = True
            tally.usage = self.usage_of(tally.reported or None)
        return True

    def error_body(self, error: dict[str, Any]) -> dict[str, Any]:
        return anthropic_shape(error)

    def error_event(self, error: dict[str, Any]) -> bytes:
        return b"event: error\ndata: " + json.dumps(anthropic_shape(error)).encode() + b"\n\n"


MESSAGES = Messages()
