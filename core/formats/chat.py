"""OpenAI's chat completions: POST /v1/chat/completions, forwarded to CEILING_UPSTREAM_URL's
chat/completions."""

from __future__ import annotations

import json
from typing import Any

from core.content import InputBound, Walk, messages_bound, unknown_part
from core.errors import InputUnbounded, InvalidRequest
from core.formats.base import Api, StreamTally, positive_int
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
from core.limits import CHOICES_MAX

DONE = "[DONE]"

# -- its input ----------------------------------------------------------------------------------

# Parts that are text only: bounded by their bytes.
CHAT_TEXT_PARTS = frozenset({"text", "refusal"})


def _image(walk: Walk, part: dict[str, Any], field: str) -> dict[str, Any]:
    given = part.get("image_url")
    if isinstance(given, str):
        walk.image(given, f"{field}.image_url", None, "")
        return {**part, "image_url": ""}
    if not isinstance(given, dict):
        raise InputUnbounded(f"{field}.image_url must be an object with a url",
                             field=f"{field}.image_url")
    for key in given:
        if key not in ("url", "detail"):
            raise InputUnbounded(f"{field}.image_url.{key} is not a field the gateway knows",
                                 field=f"{field}.image_url.{key}")
    walk.image(given.get("url"), f"{field}.image_url.url", given.get("detail"),
               f"{field}.image_url.detail")
    return {**part, "image_url": {**given, "url": ""}}


def _part(walk: Walk, part: dict[str, Any], kind: str, field: str, role: object) -> object:
    if kind in CHAT_TEXT_PARTS:
        return part
    if kind == "image_url":
        return _image(walk, part, field)
    if kind == "input_audio":
        return walk.audio(part, field, role)
    if kind == "file":
        # A file (by id, data or URL; a PDF is billed its text and an image of each page) is
        # input of a size its bytes do not show: held at the window, its payload not counted.
        walk.refer(f"{field}.file")
        return {"type": kind}
    raise unknown_part(kind, field)


def _message(walk: Walk, message: dict[str, Any], field: str) -> dict[str, Any]:
    if message.get("audio") is not None:
        raise InputUnbounded(
            f"{field}.audio refers to an earlier audio answer by id, of a size the request "
            "cannot show", field=f"{field}.audio")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return message
    return {**message, "content": walk.content(content, f"{field}.content",
                                               message.get("role"), _part)}


def chat_input(messages: Any) -> InputBound:
    """The input bound of chat `messages`: their text by bytes, their media counted. The
    sidecar's `messages` are read by it too (core/service.py)."""
    return messages_bound(messages, _message)


# -- its body, for the OpenAPI document (core/formats/schema.py) ----------------------------------

TEXT_PART = object_of({"type": const("text"), "text": STRING}, ("type", "text"))
IMAGE_PART = object_of({
    "type": const("image_url"),
    "image_url": object_of({"url": IMAGE_URL, "detail": DETAIL}, ("url",), more=False),
}, ("type", "image_url"))
AUDIO_PART = object_of({
    "type": const("input_audio"),
    "input_audio": object_of({
        "data": {"type": "string", "description": "the audio, base64-encoded"},
        "format": {"type": "string", "enum": ["wav", "mp3"]},
    }, ("data", "format"), more=False),
}, ("type", "input_audio"))
USER_MESSAGE = object_of({
    "role": const("user"),
    "content": any_of(STRING, array(any_of(TEXT_PART, IMAGE_PART, AUDIO_PART))),
    "name": STRING,
}, ("role", "content"))
# Audio input is taken in user messages only: other roles' audio is billed at other rates.
OTHER_MESSAGE = object_of({
    "role": {"type": "string", "enum": ["developer", "system", "assistant", "tool"]},
    "content": any_of(STRING, array(any_of(TEXT_PART, IMAGE_PART))),
    "name": STRING,
    "tool_call_id": STRING,
}, ("role",))
CHAT_FUNCTION_TOOL = object_of({
    "type": const("function"),
    "function": object_of({"name": STRING, "description": STRING, "parameters": JSON_SCHEMA},
                          ("name",)),
}, ("type", "function"))

CHAT_COMPLETIONS_BODY = object_of({
    "model": MODEL,
    "messages": array(any_of(USER_MESSAGE, OTHER_MESSAGE), min_items=1),
    "max_completion_tokens": TOKENS,
    "max_tokens": {**TOKENS, "description": "the older name of max_completion_tokens: "
                   "give one, or equal values; with neither, the gateway sends its default cap"},
    "n": {"type": "integer", "minimum": 1, "maximum": CHOICES_MAX},
    "stream": BOOLEAN,
    "stream_options": object_of({"include_usage": BOOLEAN}),
    "tools": array(CHAT_FUNCTION_TOOL),
    "service_tier": SERVICE_TIER,
}, ("model", "messages"))

# -- the format ---------------------------------------------------------------------------------


class Chat(OpenAIFormat):
    api = Api.CHAT
    routed_as = "chat"
    route = "/v1/chat/completions"
    name = "chat_completions"
    body_schema = CHAT_COMPLETIONS_BODY
    cap_fields = ("max_tokens", "max_completion_tokens")
    allowed_fields = COMMON_FIELDS | {
        "messages", "max_tokens", "max_completion_tokens", "n", "stream_options", "stop",
        "seed", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs",
        "response_format", "reasoning_effort", "verbosity", "modalities", "functions",
        "function_call",
    }
    # Audio output is billed at audio rates on top of the text it speaks; rejected predicted
    # tokens are billed on top of the cap; Anthropic's fast mode (`speed`) is billed at rates
    # its OpenAI-shaped usage does not name.
    unbounded_fields = ("audio", "prediction", "speed")
    # Search results feed the model input the request does not contain.
    unbounded_input_fields = ("web_search_options",)
    usage_fields = ("prompt_tokens", "completion_tokens", "prompt_tokens_details",
                    "completion_tokens_details")
    prompt_field = "messages"
    # The stream ends on `data: [DONE]`, sent on to the client after the bill's trailer.
    done_data = DONE
    stream_end = f"data: {DONE}\n\n".encode()

    def check_output(self, body: dict[str, Any]) -> None:
        # Audio output is asked for by `modalities` (`audio` only picks a voice and format,
        # which a provider may default): billed at audio rates, and refused like `audio`.
        modalities = body.get("modalities")
        if modalities is not None and (
            not isinstance(modalities, list) or any(m != "text" for m in modalities)
        ):
            raise InvalidRequest(
                "modalities other than text are not supported: audio output is billed at audio "
                "rates the gateway cannot bound from the request", field="modalities",
            )

    def prompt(self, body: dict[str, Any]) -> InputBound:
        if not isinstance(body.get("messages"), list):
            raise InvalidRequest("messages must be a list", field="messages")
        return chat_input(body["messages"])

    def choices(self, body: dict[str, Any]) -> int:
        choices = body.get("n")
        return 1 if choices is None else positive_int(choices, "n")

    def stream_usage(self, body: dict[str, Any]) -> bool:
        # A chat stream reports its usage only when asked, in a chunk of its own with no choices.
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise InvalidRequest("stream_options must be an object", field="stream_options")
        body["stream_options"] = {**options, "include_usage": True}
        return options.get("include_usage") is True

    def stream_event(self, tally: StreamTally, doc: dict[str, Any]) -> bool:
        usage = self.usage_of(doc.get("usage"), doc.get("service_tier"))
        if usage is not None:
            tally.usage = usage
        # The usage chunk the gateway asked for on the client's behalf is not forwarded.
        return usage is None or doc.get("choices") != [] or tally.plan.usage_wanted

    def error_event(self, error: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(openai_shape(error)).encode() + b"\n\n"


CHAT = Chat()
