"""OpenAI's Responses API on the stub provider: POST /v1/responses.

Streamed (`response.created` ... `response.completed`, or `response.incomplete` at the cap) and
not; one answer a call. What Responses has that chat has not: `instructions`, input items
(function calls and their outputs, reasoning summaries, `item_reference` to a stored item, sized
from the registry), a JSON schema in `text.format`, client tools only (function and custom: a
hosted tool is billed per call on top of its tokens, which the stub does not model), and
`previous_response_id`: a response stored (unless `store: false`) is billed again as input of
the call that continues it, its input and its output. `conversation`, `prompt`, `background`
and `n` are refused. Billing: infra.stub_openai. The wire format follows OpenAI's API reference
(https://developers.openai.com/api/reference/resources/responses, streaming events:
.../responses/streaming-events), checked against the `openai` SDK in
tests/infra/test_stub_provider.py.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from infra.stub_faults import Fault, pieces, sse
from infra.stub_openai import (
    Answer,
    Counter,
    OpenAIApi,
    Prompt,
    function_text,
    invalid,
    text_of,
)
from infra.stub_prices import ModelPrices
from infra.stub_tokens import InputError, Registry

# The stored responses are bounded: a long load run must not grow the stub without end.
RESPONSES_STORED_MAX = 10_000
# Tools the stub serves: those the client runs itself.
CLIENT_TOOL_TYPES = frozenset({"function", "custom"})


class ResponsesApi(OpenAIApi):
    name = "responses"
    id_prefix = "resp_"
    cap_fields = ("max_output_tokens",)
    stored: OrderedDict[str, int]  # response id -> its context's tokens

    def reset(self) -> None:
        super().reset()
        self.stored = OrderedDict()

    def prompt(self, body: dict[str, Any], prices: ModelPrices) -> Prompt:
        for unserved in ("conversation", "prompt", "background"):
            if body.get(unserved) not in (None, False):
                raise InputError(f"{unserved} is not served by the stub", unserved)
        if body.get("n") is not None:
            raise InputError("n is not a Responses parameter", "n")
        previous = body.get("previous_response_id")
        if previous is not None and previous not in self.stored:
            raise InputError(f"previous response {previous!r} not found", "previous_response_id")
        previous_tokens = 0 if previous is None else self.stored[str(previous)]
        return responses_prompt(body, prices, self.app.registry, previous_tokens)

    def effort(self, body: dict[str, Any]) -> object:
        reasoning = body.get("reasoning")
        if reasoning is not None and not isinstance(reasoning, dict):
            raise invalid("reasoning must be an object", "reasoning")
        return None if reasoning is None else reasoning.get("effort")

    def charged(self, decided: Answer, fault: Fault) -> None:
        super().charged(decided, fault)
        if decided.request.get("store", True) is not False:
            self.stored[decided.answer_id] = (decided.usage.input_tokens
                                              + len(decided.choices[0].words))
            while len(self.stored) > RESPONSES_STORED_MAX:
                self.stored.popitem(last=False)

    def body(self, decided: Answer, *, final: bool = True) -> dict[str, Any]:
        """The response object; `final` False gives it as `response.created` shows it."""
        request = decided.request
        incomplete = decided.choices[0].finish_reason == "length"
        status = ("incomplete" if incomplete else "completed") if final else "in_progress"
        return {
            "id": decided.answer_id,
            "object": "response",
            "created_at": decided.created_s,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if final and incomplete
            else None,
            "instructions": request.get("instructions"),
            "max_output_tokens": request.get("max_output_tokens"),
            "model": decided.model,
            "output": _items(decided) if final else [],
            "parallel_tool_calls": request.get("parallel_tool_calls", True),
            "previous_response_id": request.get("previous_response_id"),
            "reasoning": request.get("reasoning") or {"effort": None, "summary": None},
            "service_tier": decided.service_tier,
            "store": request.get("store", True),
            "temperature": request.get("temperature", 1.0),
            "text": request.get("text") or {"format": {"type": "text"}},
            "tool_choice": request.get("tool_choice", "auto"),
            "tools": request.get("tools") or [],
            "top_p": request.get("top_p", 1.0),
            "truncation": request.get("truncation", "disabled"),
            "usage": _usage(decided) if final else None,
            "metadata": request.get("metadata") or {},
        }

    def events(self, decided: Answer, fault: Fault) -> list[bytes]:
        """Every SSE event of the stream; the terminal `response.completed` (or
        `response.incomplete` when the cap was hit) last, carrying the usage."""
        events: list[bytes] = []

        def event(kind: str, **fields: Any) -> None:
            events.append(sse({"type": kind, "sequence_number": len(events), **fields}, kind))

        event("response.created", response=self.body(decided, final=False))
        event("response.in_progress", response=self.body(decided, final=False))
        choice = decided.choices[0]
        for index, item in enumerate(_items(decided)):
            at = {"item_id": item["id"], "output_index": index}
            if item["type"] == "message":
                opened = {**item, "status": "in_progress", "content": []}
                event("response.output_item.added", output_index=index, item=opened)
                empty = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                event("response.content_part.added", **at, content_index=0, part=empty)
                for piece in pieces(choice.words):
                    event("response.output_text.delta", **at, content_index=0, delta=piece,
                          logprobs=[])
                event("response.output_text.done", **at, content_index=0, text=choice.text,
                      logprobs=[])
                event("response.content_part.done", **at, content_index=0,
                      part=item["content"][0])
            elif item["type"] == "function_call":
                event("response.output_item.added", output_index=index,
                      item={**item, "arguments": "", "status": "in_progress"})
                event("response.function_call_arguments.delta", **at, delta=item["arguments"])
                event("response.function_call_arguments.done", **at,
                      arguments=item["arguments"])
            else:
                event("response.output_item.added", output_index=index, item=item)
            event("response.output_item.done", output_index=index, item=item)
        final = self.body(decided)
        event("response.incomplete" if final["status"] == "incomplete" else "response.completed",
              response=final)
        return events


# -- counting ------------------------------------------------------------------------------------


def responses_prompt(body: dict[str, Any], model: ModelPrices, registry: Registry,
                     previous_tokens: int = 0) -> Prompt:
    """The input of a call; `previous_tokens` is the stored conversation that
    `previous_response_id` adds in front of it."""
    counter = Counter(model, registry)
    tools = body.get("tools") or []
    if not isinstance(tools, list) or any(
        not isinstance(t, dict) or t.get("type") not in CLIENT_TOOL_TYPES for t in tools
    ):
        raise InputError("the stub serves function and custom tools only", "tools")
    counter.json_segment(tools)
    text = body.get("text")
    if isinstance(text, dict) and isinstance(text.get("format"), dict):
        counter.json_segment(text["format"].get("schema"))
    if previous_tokens:
        counter.segment({"previous_response_tokens": previous_tokens}, 0, previous_tokens,
                        framed=False)
    instructions = body.get("instructions")
    if instructions is not None:
        counter.segment({"instructions": instructions}, text_of(instructions, "instructions"))
    given = body.get("input")
    items = [{"role": "user", "content": given}] if isinstance(given, str) else given
    if not isinstance(items, list) or not items:
        raise InputError("input must be a string or a non-empty list of items", "input")
    for i, item in enumerate(items):
        _item(counter, item, f"input[{i}]")
    return counter.prompt


def _item(counter: Counter, item: object, where: str) -> None:
    counter.count_part(where)
    if not isinstance(item, dict):
        raise InputError("an input item must be an object", where)
    kind = item.get("type", "message")
    media = [0, 0, 0]
    text_bytes = 0
    if kind == "message":
        content = item.get("content")
        if isinstance(content, str):
            text_bytes = len(content.encode())
        elif isinstance(content, list):
            for j, part in enumerate(content):
                text_bytes += _part(counter, part, f"{where}.content[{j}]", media)
        else:
            raise InputError("content must be a string or a list of parts", where)
    elif kind == "function_call":
        text_bytes = function_text(item, where)
    elif kind in ("function_call_output", "custom_tool_call_output"):
        output = item.get("output")
        if isinstance(output, list):
            for j, part in enumerate(output):
                text_bytes += _part(counter, part, f"{where}.output[{j}]", media)
        else:
            text_bytes = text_of(output, where)
    elif kind == "custom_tool_call":
        text_bytes = text_of(item.get("name", ""), where) + text_of(item.get("input", ""), where)
    elif kind == "reasoning":
        summary = item.get("summary") or []
        text_bytes = sum(text_of(s.get("text") if isinstance(s, dict) else s, where)
                         for s in summary)
    elif kind == "item_reference":
        ref = counter.registry.files.get(str(item.get("id")))
        if ref is None:
            raise InputError(f"no stored item {item.get('id')!r}", where)
        media[2] += counter.file_tokens(ref, where)
    else:
        raise InputError(f"input item type {kind!r} is not served", where)
    counter.media_segment(item, text_bytes, media)


def _part(counter: Counter, part: object, where: str, media: list[int]) -> int:
    counter.count_part(where)
    if not isinstance(part, dict):
        raise InputError("a content part must be an object", where)
    kind = part.get("type")
    if kind in ("input_text", "output_text"):
        return text_of(part.get("text"), where)
    if kind == "refusal":
        return text_of(part.get("refusal"), where)
    if kind == "input_image":
        media[0] += counter.image(where, part.get("image_url"), part.get("file_id"),
                                  part.get("detail"))
    elif kind == "input_file":
        media[2] += counter.file(where, part.get("file_id"), part.get("file_data"),
                                 part.get("file_url"))
    else:
        raise InputError(f"content part type {kind!r} is not served", where)
    return 0


# -- the wire ------------------------------------------------------------------------------------


def _usage(answer: Answer) -> dict[str, Any]:
    u = answer.usage
    input_details: dict[str, int] = {"cached_tokens": u.cached_input_tokens}
    if answer.reports_cache_writes:
        input_details["cache_write_tokens"] = u.cache_write_tokens
    return {
        "input_tokens": u.input_tokens,
        "input_tokens_details": input_details,
        "output_tokens": u.output_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.input_tokens + u.output_tokens,
    }


def _items(answer: Answer) -> list[dict[str, Any]]:
    """The output items of the answer: reasoning first, then a message or a call."""
    choice = answer.choices[0]
    suffix = answer.answer_id.removeprefix("resp_")
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
