"""The stub provider's answers in OpenAI's wire formats: Chat Completions and Responses.

Bodies and stream events only; what to answer is decided before (infra.stub_provider). The
shapes follow OpenAI's API reference (https://developers.openai.com/api/reference/resources/
chat and .../responses, streaming events: .../responses/streaming-events) and are checked
against the real `openai` SDK in tests/infra/test_stub_provider.py.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from typing import Any

from infra.stub_bill import Usage

# Tokens per streamed text delta: enough deltas to exercise a client's stream parser, few
# enough to be cheap.
CHUNK_TOKENS = 16
# The "model" answers with these words, one token each.
WORDS = ("the", "ceiling", "holds", "when", "every", "call", "reserves", "first", "and", "settles")


@dataclass(frozen=True)
class Choice:
    """One generated answer: visible words plus hidden reasoning, within the output cap."""

    index: int
    words: tuple[str, ...]
    reasoning_tokens: int
    finish_reason: str  # "stop", "length" or "tool_calls"
    tool_call: tuple[str, str, str] | None = None  # (call id, function name, arguments)

    @property
    def text(self) -> str:
        return " ".join(self.words)

    @property
    def output_tokens(self) -> int:
        return len(self.words) + self.reasoning_tokens


@dataclass(frozen=True)
class Served:
    """A call decided before its first byte: what it answers and what it was billed."""

    answer_id: str
    model: str
    service_tier: str
    choices: tuple[Choice, ...]
    usage: Usage
    reports_cache_writes: bool  # the model has a cache-write rate, so usage names the writes
    audio_output: bool = False
    created_s: int = 0

    def __post_init__(self) -> None:
        if not self.created_s:
            object.__setattr__(self, "created_s", int(time.time()))


def sse(doc: dict[str, Any], event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def pieces(words: tuple[str, ...]) -> list[str]:
    """The text of `words` in deltas of CHUNK_TOKENS words, which joined give it back."""
    return [("" if start == 0 else " ") + " ".join(words[start:start + CHUNK_TOKENS])
            for start in range(0, len(words), CHUNK_TOKENS)]


# -- chat completions --------------------------------------------------------------------------


def chat_usage(served: Served, usage: Usage | None = None) -> dict[str, Any]:
    u = usage or served.usage
    prompt_details: dict[str, int] = {"cached_tokens": u.cached_input_tokens,
                                      "audio_tokens": u.audio_input_tokens}
    if served.reports_cache_writes:
        prompt_details["cache_write_tokens"] = u.cache_write_tokens
    return {
        "prompt_tokens": u.input_tokens,
        "completion_tokens": u.output_tokens,
        "total_tokens": u.input_tokens + u.output_tokens,
        "prompt_tokens_details": prompt_details,
        "completion_tokens_details": {
            "reasoning_tokens": u.reasoning_tokens, "audio_tokens": u.audio_output_tokens,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": u.rejected_prediction_tokens,
        },
    }


def _chat_message(served: Served, choice: Choice) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": choice.text, "refusal": None}
    if choice.tool_call is not None:
        call_id, name, arguments = choice.tool_call
        message["content"] = None
        message["tool_calls"] = [{"id": call_id, "type": "function",
                                  "function": {"name": name, "arguments": arguments}}]
    if served.audio_output:
        message["content"] = None
        message["audio"] = {"id": "audio_" + served.answer_id[-24:], "data": "",
                            "expires_at": served.created_s + 3600, "transcript": choice.text}
    return message


def chat_body(served: Served) -> dict[str, Any]:
    return {
        "id": served.answer_id,
        "object": "chat.completion",
        "created": served.created_s,
        "model": served.model,
        "service_tier": served.service_tier,
        "system_fingerprint": "fp_stub",
        "choices": [{"index": c.index, "message": _chat_message(served, c), "logprobs": None,
                     "finish_reason": c.finish_reason} for c in served.choices],
        "usage": chat_usage(served),
    }


def chat_events(served: Served, *, include_usage: bool, continuous_usage: bool) -> list[bytes]:
    """Every SSE event of a chat stream, in order, the `[DONE]` terminator last.

    With `continuous_usage` (vLLM's `continuous_usage_stats`), every chunk also carries the
    usage so far: the prompt, the reasoning (generated before any text) and the words sent."""
    head = {"id": served.answer_id, "object": "chat.completion.chunk",
            "created": served.created_s, "model": served.model,
            "service_tier": served.service_tier, "system_fingerprint": "fp_stub"}
    reasoning = sum(c.reasoning_tokens for c in served.choices)
    words_sent = 0
    events: list[bytes] = []

    def chunk(choice: Choice, delta: dict[str, Any], finish: str | None = None) -> None:
        doc: dict[str, Any] = {**head, "choices": [
            {"index": choice.index, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        if continuous_usage:
            so_far = replace(served.usage, output_tokens=reasoning + words_sent,
                             reasoning_tokens=reasoning, audio_output_tokens=0,
                             rejected_prediction_tokens=0)
            doc["usage"] = chat_usage(served, so_far)
        events.append(sse(doc))

    for choice in served.choices:
        chunk(choice, {"role": "assistant", "content": "", "refusal": None})
        if choice.tool_call is not None:
            call_id, name, arguments = choice.tool_call
            words_sent += len(choice.words)
            chunk(choice, {"tool_calls": [{"index": 0, "id": call_id, "type": "function",
                                           "function": {"name": name, "arguments": arguments}}]})
        else:
            for piece in pieces(choice.words):
                words_sent += len(piece.split())
                chunk(choice, {"content": piece})
        chunk(choice, {}, choice.finish_reason)
    if include_usage:
        events.append(sse({**head, "choices": [], "usage": chat_usage(served)}))
    events.append(SSE_DONE)
    return events


# -- responses -------------------------------------------------------------------------------


def responses_usage(served: Served) -> dict[str, Any]:
    u = served.usage
    input_details: dict[str, int] = {"cached_tokens": u.cached_input_tokens}
    if served.reports_cache_writes:
        input_details["cache_write_tokens"] = u.cache_write_tokens
    return {
        "input_tokens": u.input_tokens,
        "input_tokens_details": input_details,
        "output_tokens": u.output_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.input_tokens + u.output_tokens,
    }


def _items(served: Served) -> list[dict[str, Any]]:
    """The output items of the (single) choice: reasoning first, then a message or a call."""
    choice = served.choices[0]
    suffix = served.answer_id.removeprefix("resp_")
    items: list[dict[str, Any]] = []
    if choice.reasoning_tokens:
        items.append({"type": "reasoning", "id": "rs_" + suffix, "summary": []})
    if choice.tool_call is not None:
        call_id, name, arguments = choice.tool_call
        items.append({"type": "function_call", "id": "fc_" + suffix, "call_id": call_id,
                      "name": name, "arguments": arguments, "status": "completed"})
    else:
        items.append({"type": "message", "id": "msg_" + suffix, "status": "completed",
                      "role": "assistant",
                      "content": [{"type": "output_text", "text": choice.text,
                                   "annotations": [], "logprobs": []}]})
    return items


def responses_body(served: Served, request: dict[str, Any], *,
                   final: bool = True) -> dict[str, Any]:
    """The response object; `final` False gives it as `response.created` shows it."""
    incomplete = served.choices[0].finish_reason == "length"
    status = ("incomplete" if incomplete else "completed") if final else "in_progress"
    return {
        "id": served.answer_id,
        "object": "response",
        "created_at": served.created_s,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if final and incomplete else None,
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "model": served.model,
        "output": _items(served) if final else [],
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "previous_response_id": request.get("previous_response_id"),
        "reasoning": request.get("reasoning") or {"effort": None, "summary": None},
        "service_tier": served.service_tier,
        "store": request.get("store", True),
        "temperature": request.get("temperature", 1.0),
        "text": request.get("text") or {"format": {"type": "text"}},
        "tool_choice": request.get("tool_choice", "auto"),
        "tools": request.get("tools") or [],
        "top_p": request.get("top_p", 1.0),
        "truncation": request.get("truncation", "disabled"),
        "usage": responses_usage(served) if final else None,
        "metadata": request.get("metadata") or {},
    }


def responses_events(served: Served, request: dict[str, Any]) -> list[bytes]:
    """Every SSE event of a Responses stream; the terminal `response.completed` (or
    `response.incomplete` when the cap was hit) last, carrying the usage."""
    events: list[bytes] = []

    def event(kind: str, **fields: Any) -> None:
        events.append(sse({"type": kind, "sequence_number": len(events), **fields}, kind))

    event("response.created", response=responses_body(served, request, final=False))
    event("response.in_progress", response=responses_body(served, request, final=False))
    choice = served.choices[0]
    for index, item in enumerate(_items(served)):
        if item["type"] == "message":
            opened = {**item, "status": "in_progress", "content": []}
            event("response.output_item.added", output_index=index, item=opened)
            empty = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            event("response.content_part.added", item_id=item["id"], output_index=index,
                  content_index=0, part=empty)
            for piece in pieces(choice.words):
                event("response.output_text.delta", item_id=item["id"], output_index=index,
                      content_index=0, delta=piece, logprobs=[])
            event("response.output_text.done", item_id=item["id"], output_index=index,
                  content_index=0, text=choice.text, logprobs=[])
            event("response.content_part.done", item_id=item["id"], output_index=index,
                  content_index=0, part=item["content"][0])
        elif item["type"] == "function_call":
            event("response.output_item.added", output_index=index,
                  item={**item, "arguments": "", "status": "in_progress"})
            event("response.function_call_arguments.delta", item_id=item["id"],
                  output_index=index, delta=item["arguments"])
            event("response.function_call_arguments.done", item_id=item["id"],
                  output_index=index, arguments=item["arguments"])
        else:
            event("response.output_item.added", output_index=index, item=item)
        event("response.output_item.done", output_index=index, item=item)
    final = responses_body(served, request)
    event("response.incomplete" if final["status"] == "incomplete" else "response.completed",
          response=final)
    return events
