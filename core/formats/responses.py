"""OpenAI's Responses API: POST /v1/responses, forwarded to CEILING_UPSTREAM_URL's responses."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from core.content import MESSAGES_MAX, InputBound, Walk, messages_bound, unknown_part
from core.errors import InputUnbounded, InvalidRequest
from core.formats.base import Api, StreamTally
from core.formats.openai import COMMON_FIELDS, DETAIL, SERVICE_TIER, OpenAIFormat, openai_shape
from core.formats.schema import (
    BOOLEAN,
    IMAGE_URL,
    JSON_SCHEMA,
    MODEL,
    STRING,
    TOKENS,
    any_of,
    array,
    const,
    object_of,
)
from core.prices import Usage

# Stream events after which a call is over, carrying its usage.
TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})
# Fields that feed the model input the body does not hold (a stored response, conversation or
# prompt): the call's input is held at the model's context window.
REFERRED_FIELDS = ("previous_response_id", "conversation", "prompt")
# The context management OpenAI offers: server-side compaction, a summarizing step whose output
# (an encrypted item) replaces the context.
COMPACTION = "compaction"
# An output item of a hosted web search: billed a fee each.
WEB_SEARCH_CALL = "web_search_call"

# -- its input ----------------------------------------------------------------------------------

# Parts that are text only: bounded by their bytes.
RESPONSES_TEXT_PARTS = frozenset({"input_text", "output_text", "refusal"})
# Items that carry text only: calls of tools the client runs, and their outputs (by their bytes;
# a function's or custom tool's output may hold content parts, walked as such).
RESPONSES_CALL_ITEMS = frozenset({
    "function_call", "custom_tool_call", "local_shell_call", "shell_call", "apply_patch_call",
    "local_shell_call_output", "shell_call_output", "apply_patch_call_output",
})
RESPONSES_OUTPUT_ITEMS = frozenset({"function_call_output", "custom_tool_call_output"})
# Items whose billed size the request does not show: reasoning sent back (encrypted, or looked
# up by id), a reference to a stored item, a compaction's encrypted summary, and hosted tools'
# calls sent back (their results are the provider's). Held at the context window.
RESPONSES_REFERRED_ITEMS = frozenset({
    "reasoning", "item_reference", "compaction", "web_search_call", "file_search_call",
    "image_generation_call", "code_interpreter_call", "computer_call", "computer_call_output",
    "tool_search_call", "tool_search_output",
})


def _image(walk: Walk, part: dict[str, Any], field: str) -> dict[str, Any]:
    for key in part:
        if key not in ("type", "image_url", "file_id", "detail"):
            raise InputUnbounded(f"{field}.{key} is not a field the gateway knows",
                                 field=f"{field}.{key}")
    if part.get("file_id") is not None:
        # An image stored with the provider is still billed by the per-image rule.
        if not isinstance(part["file_id"], str) or not part["file_id"]:
            raise InvalidRequest(f"{field}.file_id must be a file id", field=f"{field}.file_id")
        walk.image("file", f"{field}.file_id", part.get("detail"), f"{field}.detail")
        return {**part, "file_id": ""}
    walk.image(part.get("image_url"), f"{field}.image_url", part.get("detail"),
               f"{field}.detail")
    return {**part, "image_url": ""}


def _part(walk: Walk, part: dict[str, Any], kind: str, field: str, role: object) -> object:
    if kind in RESPONSES_TEXT_PARTS:
        return part
    if kind == "input_image":
        return _image(walk, part, field)
    if kind == "input_audio":
        return walk.audio(part, field, role)
    if kind == "input_file":
        # A file (by id, data or URL; a PDF is billed its text and an image of each page) is
        # input of a size its bytes do not show: held at the window, its payload not counted.
        walk.refer(field)
        return {"type": kind}
    raise unknown_part(kind, field)


def _item(walk: Walk, item: dict[str, Any], field: str) -> dict[str, Any]:
    kind = item.get("type", "message" if "role" in item else None)
    if not isinstance(kind, str):
        raise InputUnbounded(f"{field}.type must name the item's type", field=f"{field}.type")
    if kind == "message":
        return {**item, "content": walk.content(
            item.get("content"), f"{field}.content", item.get("role"), _part)}
    if kind in RESPONSES_OUTPUT_ITEMS:
        return {**item, "output": walk.content(
            item.get("output"), f"{field}.output", "tool", _part)}
    if kind in RESPONSES_REFERRED_ITEMS:
        walk.refer(field)
        # Its payload (encrypted reasoning, a hosted tool's results) is not counted as text:
        # the window holds it.
        return {"type": kind}
    if kind not in RESPONSES_CALL_ITEMS:
        # Anything newer: input (or an action) the gateway cannot bound.
        raise InputUnbounded(
            f"{field} is an item of type {kind!r}, which the gateway does not know: what it "
            "bills cannot be bounded", field=field)
    return item


def responses_input(given: Any) -> InputBound:
    """The input bound of a Responses API `input`: a string, or a list of items."""
    if isinstance(given, str):
        given = [{"role": "user", "content": given}]
    return messages_bound(given, _item, "input",
                          f"a string or a list of at most {MESSAGES_MAX} items",
                          "input item", least=0)


# -- its body, for the OpenAPI document (core/formats/schema.py) ----------------------------------

INPUT_TEXT = object_of({"type": const("input_text"), "text": STRING}, ("type", "text"))
INPUT_IMAGE = object_of({"type": const("input_image"), "image_url": IMAGE_URL, "detail": DETAIL},
                        ("type", "image_url"), more=False)
INPUT_MESSAGE = object_of({
    "type": const("message"),
    "role": {"type": "string", "enum": ["developer", "system", "user", "assistant"]},
    "content": any_of(STRING, array(any_of(INPUT_TEXT, INPUT_IMAGE))),
}, ("role", "content"))
FUNCTION_CALL = object_of({"type": const("function_call"), "call_id": STRING, "name": STRING,
                           "arguments": STRING}, ("type", "call_id", "name", "arguments"))
FUNCTION_CALL_OUTPUT = object_of({"type": const("function_call_output"), "call_id": STRING,
                                  "output": STRING}, ("type", "call_id", "output"))
RESPONSES_FUNCTION_TOOL = object_of({"type": const("function"), "name": STRING,
                                     "description": STRING, "parameters": JSON_SCHEMA},
                                    ("type", "name"))

RESPONSES_BODY = object_of({
    "model": MODEL,
    "input": any_of(STRING, array(any_of(INPUT_MESSAGE, FUNCTION_CALL, FUNCTION_CALL_OUTPUT),
                                  min_items=1)),
    "instructions": STRING,
    "max_output_tokens": {**TOKENS,
                          "description": "with none, the gateway sends its default cap"},
    "stream": BOOLEAN,
    "tools": array(RESPONSES_FUNCTION_TOOL),
    "reasoning": object_of({"effort": {"type": "string",
                                       "enum": ["minimal", "low", "medium", "high"]}}),
    "service_tier": SERVICE_TIER,
}, ("model", "input"))

# -- the format ---------------------------------------------------------------------------------


class Responses(OpenAIFormat):
    api = Api.RESPONSES
    routed_as = "responses"
    route = "/v1/responses"
    name = "responses"
    body_schema = RESPONSES_BODY
    cap_fields = ("max_output_tokens",)
    allowed_fields = COMMON_FIELDS | {
        "input", "instructions", "max_output_tokens", "reasoning", "text", "truncation",
        "include", "max_tool_calls", "stream_options", "client_metadata", "context_management",
        *REFERRED_FIELDS,
    }
    # A background call is billed after the answer; Anthropic's fast mode (`speed`) is billed at
    # rates its OpenAI-shaped usage does not name.
    unbounded_fields = ("background", "speed")
    usage_fields = ("input_tokens", "output_tokens", "input_tokens_details",
                    "output_tokens_details")
    prompt_field = "input"
    hosted_tools = True

    def prompt(self, body: dict[str, Any]) -> InputBound:
        return responses_input(body.get("input"))

    def referred(self, body: dict[str, Any]) -> str:
        return next((f for f in REFERRED_FIELDS if body.get(f) not in (None, "")), "")

    def compaction(self, body: dict[str, Any]) -> str:
        given = body.get("context_management")
        if given is None:
            return ""
        if not isinstance(given, list) or any(
                not isinstance(entry, dict) or entry.get("type") != COMPACTION
                for entry in given):
            raise InputUnbounded(
                f"context_management entries must be of type {COMPACTION!r}, the only kind "
                "the gateway knows the cost of", field="context_management")
        return "context_management" if given else ""

    def answer_usage(self, doc: dict[str, Any]) -> Usage | None:
        """Its usage, with the hosted web searches its output items show: a search is billed a
        fee its usage does not count."""
        usage = super().answer_usage(doc)
        output = doc.get("output")
        if usage is None or not isinstance(output, list):
            return usage
        searches = sum(1 for item in output
                       if isinstance(item, dict) and item.get("type") == WEB_SEARCH_CALL)
        return replace(usage, web_search_requests=searches) if searches else usage

    def stream_event(self, tally: StreamTally, doc: dict[str, Any]) -> bool:
        if doc.get("type") in TERMINAL_EVENTS:
            tally.finished = True
            response = doc.get("response")
            tally.usage = self.answer_usage(response) if isinstance(response, dict) else None
        return True

    def error_event(self, error: dict[str, Any]) -> bytes:
        # Typed `error` (the SDK yields it as one); the error's own type would name an event no
        # client knows.
        event = {**openai_shape(error)["error"], "type": "error"}
        return b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n"


RESPONSES = Responses()
