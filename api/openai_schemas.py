"""The gateway's request bodies (OpenAI's and Anthropic's), as JSON Schema for the OpenAPI
document.

Documentation only: the gateway reads the raw body (core/gateway.py `plan`) and forwards it as
the client sent it, so nothing validates a request against these. They name what the gateway
reads to bound a call's cost: the model, the prompt and the content it can bound (text, images,
audio), the output caps, `n`, streaming, the tools it lets through and the service tier. Any
other field of OpenAI's API (temperature, stop, seed...) is forwarded as it is, so these objects
allow more fields, except where the gateway refuses what it does not know (an image's or an
audio part's fields). What the gateway refuses (hosted tools, files, stored items) is not
documented as accepted. Anthropic's Messages body allows no other top-level fields: the gateway
refuses the ones whose cost it does not know (core/gateway.py MESSAGES_FIELDS).

Written as JSON Schema, not as models: nothing is validated with them, and a literal costs a
serverless cold start nothing to import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from core.limits import CHOICES_MAX, TOKENS_MAX

Schema = dict[str, Any]


def _object(properties: Schema, required: Sequence[str] = (), *, more: bool = True) -> Schema:
    """An object of these properties; `more`: other fields are allowed (and forwarded)."""
    return {"type": "object", "properties": properties, "required": list(required),
            "additionalProperties": more}


def _const(value: str) -> Schema:
    return {"type": "string", "const": value}


def _array(items: Schema, min_items: int = 0) -> Schema:
    return {"type": "array", "items": items, "minItems": min_items}


def _any_of(*schemas: Schema) -> Schema:
    return {"anyOf": list(schemas)}


STRING: Schema = {"type": "string"}
BOOLEAN: Schema = {"type": "boolean"}
TOKENS: Schema = {"type": "integer", "minimum": 1, "maximum": TOKENS_MAX}
MODEL: Schema = {"type": "string", "minLength": 1}
IMAGE_URL: Schema = {"type": "string", "minLength": 1,
                     "description": "an http(s) URL or a data URL of an image"}
DETAIL: Schema = {"type": "string", "enum": ["auto", "low", "high"]}
# OpenAI's tiers; a request that names none is `auto`.
SERVICE_TIER: Schema = {"type": "string", "enum": ["auto", "default", "flex", "scale", "priority"]}
JSON_SCHEMA: Schema = {"type": "object", "description": "a JSON Schema"}

# -- chat completions -----------------------------------------------------------------------------

TEXT_PART = _object({"type": _const("text"), "text": STRING}, ("type", "text"))
IMAGE_PART = _object({
    "type": _const("image_url"),
    "image_url": _object({"url": IMAGE_URL, "detail": DETAIL}, ("url",), more=False),
}, ("type", "image_url"))
AUDIO_PART = _object({
    "type": _const("input_audio"),
    "input_audio": _object({
        "data": {"type": "string", "description": "the audio, base64-encoded"},
        "format": {"type": "string", "enum": ["wav", "mp3"]},
    }, ("data", "format"), more=False),
}, ("type", "input_audio"))
USER_MESSAGE = _object({
    "role": _const("user"),
    "content": _any_of(STRING, _array(_any_of(TEXT_PART, IMAGE_PART, AUDIO_PART))),
    "name": STRING,
}, ("role", "content"))
# Audio input is taken in user messages only: other roles' audio is billed at other rates.
OTHER_MESSAGE = _object({
    "role": {"type": "string", "enum": ["developer", "system", "assistant", "tool"]},
    "content": _any_of(STRING, _array(_any_of(TEXT_PART, IMAGE_PART))),
    "name": STRING,
    "tool_call_id": STRING,
}, ("role",))
CHAT_FUNCTION_TOOL = _object({
    "type": _const("function"),
    "function": _object({"name": STRING, "description": STRING, "parameters": JSON_SCHEMA},
                        ("name",)),
}, ("type", "function"))

CHAT_COMPLETIONS_BODY = _object({
    "model": MODEL,
    "messages": _array(_any_of(USER_MESSAGE, OTHER_MESSAGE), min_items=1),
    "max_completion_tokens": TOKENS,
    "max_tokens": {**TOKENS, "description": "the older name of max_completion_tokens: "
                   "give one, or equal values; with neither, the gateway sends its default cap"},
    "n": {"type": "integer", "minimum": 1, "maximum": CHOICES_MAX},
    "stream": BOOLEAN,
    "stream_options": _object({"include_usage": BOOLEAN}),
    "tools": _array(CHAT_FUNCTION_TOOL),
    "service_tier": SERVICE_TIER,
}, ("model", "messages"))

# -- responses ------------------------------------------------------------------------------------

INPUT_TEXT = _object({"type": _const("input_text"), "text": STRING}, ("type", "text"))
INPUT_IMAGE = _object({"type": _const("input_image"), "image_url": IMAGE_URL, "detail": DETAIL},
                      ("type", "image_url"), more=False)
INPUT_MESSAGE = _object({
    "type": _const("message"),
    "role": {"type": "string", "enum": ["developer", "system", "user", "assistant"]},
    "content": _any_of(STRING, _array(_any_of(INPUT_TEXT, INPUT_IMAGE))),
}, ("role", "content"))
FUNCTION_CALL = _object({"type": _const("function_call"), "call_id": STRING, "name": STRING,
                         "arguments": STRING}, ("type", "call_id", "name", "arguments"))
FUNCTION_CALL_OUTPUT = _object({"type": _const("function_call_output"), "call_id": STRING,
                                "output": STRING}, ("type", "call_id", "output"))
RESPONSES_FUNCTION_TOOL = _object({"type": _const("function"), "name": STRING,
                                   "description": STRING, "parameters": JSON_SCHEMA},
                                  ("type", "name"))

RESPONSES_BODY = _object({
    "model": MODEL,
    "input": _any_of(STRING, _array(_any_of(INPUT_MESSAGE, FUNCTION_CALL, FUNCTION_CALL_OUTPUT),
                                    min_items=1)),
    "instructions": STRING,
    "max_output_tokens": {**TOKENS,
                          "description": "with none, the gateway sends its default cap"},
    "stream": BOOLEAN,
    "tools": _array(RESPONSES_FUNCTION_TOOL),
    "reasoning": _object({"effort": {"type": "string",
                                     "enum": ["minimal", "low", "medium", "high"]}}),
    "service_tier": SERVICE_TIER,
}, ("model", "input"))

# -- Anthropic's messages -------------------------------------------------------------------------

CACHE_CONTROL = _object({"type": _const("ephemeral"),
                         "ttl": {"type": "string", "enum": ["5m", "1h"]}}, ("type",), more=False)
TEXT = {"type": "string", "minLength": 1}
TEXT_BLOCK = _object({"type": _const("text"), "text": TEXT, "cache_control": CACHE_CONTROL},
                     ("type", "text"))
IMAGE_SOURCE = _any_of(
    _object({"type": _const("base64"),
             "media_type": {"type": "string",
                            "enum": ["image/jpeg", "image/png", "image/gif", "image/webp"]},
             "data": {"type": "string", "description": "the image, base64-encoded"}},
            ("type", "media_type", "data"), more=False),
    _object({"type": _const("url"), "url": IMAGE_URL}, ("type", "url"), more=False),
    _object({"type": _const("file"), "file_id": STRING}, ("type", "file_id"), more=False),
)
IMAGE_BLOCK = _object({"type": _const("image"), "source": IMAGE_SOURCE,
                       "cache_control": CACHE_CONTROL}, ("type", "source"))
# Documents of text only: a PDF, or a file by URL or id, is refused (input_unbounded).
TEXT_DOCUMENT_BLOCK = _object({
    "type": _const("document"),
    "source": _object({"type": _const("text"), "media_type": _const("text/plain"),
                       "data": STRING}, ("type", "media_type", "data"), more=False),
    "title": STRING, "context": STRING, "cache_control": CACHE_CONTROL,
}, ("type", "source"))
TOOL_USE_BLOCK = _object({"type": _const("tool_use"), "id": STRING, "name": STRING,
                          "input": {"type": "object"}}, ("type", "id", "name", "input"))
TOOL_RESULT_BLOCK = _object({
    "type": _const("tool_result"), "tool_use_id": STRING,
    "content": _any_of(STRING, _array(_any_of(TEXT_BLOCK, IMAGE_BLOCK))), "is_error": BOOLEAN,
    "cache_control": CACHE_CONTROL,
}, ("type", "tool_use_id"))
THINKING_BLOCK = _object({"type": _const("thinking"), "thinking": STRING, "signature": STRING},
                         ("type", "thinking", "signature"))
# Turns take the blocks of their role, and are not empty (but for a last assistant turn, which
# the model continues).
USER_TURN = _object({
    "role": _const("user"),
    "content": _any_of(TEXT, _array(_any_of(
        TEXT_BLOCK, IMAGE_BLOCK, TEXT_DOCUMENT_BLOCK, TOOL_RESULT_BLOCK), min_items=1)),
}, ("role", "content"), more=False)
ASSISTANT_TURN = _object({
    "role": _const("assistant"),
    "content": _any_of(STRING, _array(_any_of(TEXT_BLOCK, TOOL_USE_BLOCK, THINKING_BLOCK))),
}, ("role", "content"), more=False)
CUSTOM_TOOL = _object({"type": _const("custom"), "name": STRING, "description": STRING,
                       "input_schema": JSON_SCHEMA, "cache_control": CACHE_CONTROL},
                      ("name", "input_schema"))
# Web search only with max_uses, which bounds its fees; its results need the model's bound
# (web_search_result_tokens_max) in the prices file.
WEB_SEARCH_TOOL = _object({"type": _const("web_search_20250305"), "name": _const("web_search"),
                           "max_uses": {"type": "integer", "minimum": 1}},
                          ("type", "name", "max_uses"))

MESSAGES_BODY = _object({
    "model": MODEL,
    "messages": _array(_any_of(USER_TURN, ASSISTANT_TURN), min_items=1),
    "max_tokens": {**TOKENS, "description": "caps all output, thinking included; with none, "
                   "the gateway sends its default cap"},
    "system": _any_of(STRING, _array(TEXT_BLOCK)),
    "stream": BOOLEAN,
    "tools": _array(_any_of(CUSTOM_TOOL, WEB_SEARCH_TOOL)),
    "tool_choice": _object({"type": {"type": "string", "enum": ["auto", "any", "tool", "none"]},
                            "name": STRING, "disable_parallel_tool_use": BOOLEAN}, ("type",)),
    "thinking": _any_of(
        _object({"type": _const("enabled"),
                 "budget_tokens": {**TOKENS, "description": "at most max_tokens"}},
                ("type", "budget_tokens"), more=False),
        _object({"type": _const("disabled")}, ("type",), more=False)),
    "service_tier": {"type": "string", "enum": ["auto", "standard_only"]},
    "metadata": _object({"user_id": STRING}, more=False),
    "stop_sequences": _array(STRING),
    "temperature": {"type": "number", "minimum": 0, "maximum": 1},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": 0},
    "cache_control": CACHE_CONTROL,
}, ("model", "messages"), more=False)
