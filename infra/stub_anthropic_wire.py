"""The stub provider's answers in Anthropic's Messages API wire format.

Bodies, stream events and errors only; what to answer is decided before (infra.stub_anthropic).
The shapes follow Anthropic's API reference (https://platform.claude.com/docs/en/api/messages;
streaming: https://platform.claude.com/docs/en/build-with-claude/streaming; errors:
https://platform.claude.com/docs/en/api/errors) and are checked against the real `anthropic`
SDK in tests/infra/test_stub_anthropic.py.

Usage as Anthropic reports it: `input_tokens` is only the input neither read from nor written
to the prompt cache; the total input is `input_tokens + cache_creation_input_tokens +
cache_read_input_tokens`. A stream reports the input in `message_start`, before any web search
ran, and again, cumulatively and final, in `message_delta`, with the output.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from infra.stub_bill import Usage
from infra.stub_wire import pieces, sse

# Characters of tool input JSON a streamed input_json_delta carries: more than one delta a
# call, so a client's partial-JSON parsing is exercised.
JSON_CHUNK_CHARS = 64
# The broad error type Anthropic answers each status with (https://platform.claude.com/docs/en/
# api/errors); other 4xx are invalid_request_error, other 5xx api_error.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 504: "timeout_error",
               529: "overloaded_error"}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(status: int, message: str, request_id: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message},
            "request_id": request_id}


@dataclass(frozen=True)
class Search:
    """One server-side web search: its results, or None when max_uses refused it."""

    tool_use_id: str
    query: str
    results: tuple[dict[str, Any], ...] | None


@dataclass(frozen=True)
class Reply:
    """A message decided before its first byte: what it answers and what it was billed.

    `thinking` is the text shown (a summary of the thinking billed), None when thinking is off;
    `text` is the answer, or the input of the tool call `tool_call` (id, name) answers with."""

    message_id: str
    model: str
    thinking: str | None
    signature: str
    searches: tuple[Search, ...]
    text: str
    tool_call: tuple[str, str] | None
    stop_reason: str
    stop_sequence: str | None
    usage: Usage
    search_tokens: int  # input the search results added, after message_start reported it
    server_tools: bool  # the request had a server tool, so usage reports server_tool_use


def usage_doc(reply: Reply, *, final: bool = True) -> dict[str, Any]:
    """`usage` of the message; `final` False: as message_start reports it."""
    u = reply.usage
    uncached = u.input_tokens - u.cached_input_tokens - u.cache_write_tokens
    doc: dict[str, Any] = {
        "input_tokens": uncached if final else uncached - reply.search_tokens,
        "cache_creation_input_tokens": u.cache_write_tokens,
        "cache_read_input_tokens": u.cached_input_tokens,
        "cache_creation": {
            "ephemeral_5m_input_tokens": u.cache_write_tokens - u.cache_write_1h_tokens,
            "ephemeral_1h_input_tokens": u.cache_write_1h_tokens,
        },
        # message_start shows the first output token; message_delta the total.
        "output_tokens": u.output_tokens if final else min(1, u.output_tokens),
        "service_tier": "standard",
    }
    if reply.server_tools:
        doc["server_tool_use"] = {"web_search_requests": u.web_search_requests if final else 0,
                                  "web_fetch_requests": 0}
    if reply.thinking is not None:
        doc["output_tokens_details"] = {"thinking_tokens": u.reasoning_tokens if final else 0}
    return doc


def _search_blocks(search: Search) -> list[dict[str, Any]]:
    content: Any = (list(search.results) if search.results is not None else
                    {"type": "web_search_tool_result_error", "error_code": "max_uses_exceeded"})
    return [{"type": "server_tool_use", "id": search.tool_use_id, "name": "web_search",
             "input": {"query": search.query}},
            {"type": "web_search_tool_result", "tool_use_id": search.tool_use_id,
             "content": content}]


def content_blocks(reply: Reply) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if reply.thinking is not None:
        blocks.append({"type": "thinking", "thinking": reply.thinking,
                       "signature": reply.signature})
    for search in reply.searches:
        blocks += _search_blocks(search)
    if reply.tool_call is not None:
        call_id, name = reply.tool_call
        blocks.append({"type": "tool_use", "id": call_id, "name": name,
                       "input": {"text": reply.text}})
    elif reply.text:
        blocks.append({"type": "text", "text": reply.text, "citations": None})
    return blocks


def message_body(reply: Reply) -> dict[str, Any]:
    return {
        "id": reply.message_id,
        "type": "message",
        "role": "assistant",
        "model": reply.model,
        "content": content_blocks(reply),
        "stop_reason": reply.stop_reason,
        "stop_sequence": reply.stop_sequence,
        "usage": usage_doc(reply),
    }


def _event(doc: dict[str, Any]) -> bytes:
    return sse(doc, str(doc["type"]))


def _text_deltas(text: str, delta_type: str, key: str) -> list[dict[str, Any]]:
    words = tuple(text.split(" ")) if text else ()
    return [{"type": delta_type, key: piece} for piece in pieces(words)]


def _block_events(index: int, block: dict[str, Any]) -> list[bytes]:
    """content_block_start, its deltas, content_block_stop: the block built up as streamed."""
    kind = block["type"]
    deltas: list[dict[str, Any]] = []
    start = block
    if kind == "text":
        start = {"type": "text", "text": ""}
        deltas = _text_deltas(block["text"], "text_delta", "text")
    elif kind == "thinking":
        start = {"type": "thinking", "thinking": "", "signature": ""}
        deltas = [*_text_deltas(block["thinking"], "thinking_delta", "thinking"),
                  {"type": "signature_delta", "signature": block["signature"]}]
    elif kind in ("tool_use", "server_tool_use"):
        start = {**block, "input": {}}
        arguments = json.dumps(block["input"], separators=(",", ":"))
        deltas = [{"type": "input_json_delta", "partial_json": arguments[at:at + JSON_CHUNK_CHARS]}
                  for at in range(0, len(arguments), JSON_CHUNK_CHARS)]
    # A web_search_tool_result arrives whole in its content_block_start.
    return [_event({"type": "content_block_start", "index": index, "content_block": start}),
            *(_event({"type": "content_block_delta", "index": index, "delta": delta})
              for delta in deltas),
            _event({"type": "content_block_stop", "index": index})]


def message_start(reply: Reply) -> list[bytes]:
    """message_start (with the input usage) and a ping, the way every stream opens."""
    message = {**message_body(reply), "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": usage_doc(reply, final=False)}
    return [_event({"type": "message_start", "message": message}), _event({"type": "ping"})]


def message_events(reply: Reply) -> list[bytes]:
    """Every SSE event of a message stream, message_stop last."""
    events = message_start(reply)
    for index, block in enumerate(content_blocks(reply)):
        events += _block_events(index, block)
    final = usage_doc(reply)
    delta_usage = {k: final[k] for k in ("output_tokens", "input_tokens",
                                         "cache_creation_input_tokens", "cache_read_input_tokens",
                                         "server_tool_use", "output_tokens_details") if k in final}
    events.append(_event({"type": "message_delta",
                          "delta": {"stop_reason": reply.stop_reason,
                                    "stop_sequence": reply.stop_sequence},
                          "usage": delta_usage}))
    events.append(_event({"type": "message_stop"}))
    return events


def error_event(status: int, message: str) -> bytes:
    """An `error` event: how a stream already answered 200 reports a failure."""
    return _event({"type": "error", "error": {"type": error_type(status), "message": message}})
