"""OpenAI's Chat Completions on the stub provider: POST /v1/chat/completions.

Streamed (SSE chunks, then `data: [DONE]`) and not; `n` choices, each its own draw. What chat
has that Responses has not: `n`, audio output (`modalities`, billed at the audio output rate,
not streamed), predicted output (`prediction`: the stub uses none of it, and the rejected
tokens are billed as output, https://developers.openai.com/api/docs/guides/predicted-outputs),
`web_search_options` (taken by a search model and changing nothing billed, refused by any
other), `max_tokens` (refused with a reasoning model, whose cap must cover its hidden tokens),
and a stream's usage in its last chunk when `stream_options.include_usage` asks, or in every
chunk with `continuous_usage_stats` (vLLM's) or the continuous_usage fault. Billing:
infra.stub_openai. The wire format follows OpenAI's API reference
(https://developers.openai.com/api/reference/resources/chat), checked against the `openai` SDK
in tests/infra/test_stub_provider.py.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from infra.stub_bill import Usage
from infra.stub_faults import Fault, sse
from infra.stub_openai import (
    Answer,
    Choice,
    Counter,
    OpenAIApi,
    Prompt,
    function_text,
    invalid,
    text_of,
)
from infra.stub_prices import ModelPrices
from infra.stub_tokens import InputError, Registry

# What OpenAI's chat search models take in `web_search_options`
# (https://developers.openai.com/api/docs/guides/tools-web-search).
WEB_SEARCH_OPTIONS = frozenset({"search_context_size", "user_location"})
SEARCH_CONTEXT_SIZES = ("low", "medium", "high")
SSE_DONE = b"data: [DONE]\n\n"


class ChatApi(OpenAIApi):
    name = "chat.completions"
    id_prefix = "chatcmpl-"
    cap_fields = ("max_completion_tokens", "max_tokens")

    def prompt(self, body: dict[str, Any], prices: ModelPrices) -> Prompt:
        _web_search_options(body.get("web_search_options"), prices)
        return chat_prompt(body, prices, self.app.registry)

    def choices_asked(self, body: dict[str, Any]) -> object:
        return body.get("n", 1)

    def effort(self, body: dict[str, Any]) -> object:
        return body.get("reasoning_effort")

    def output_schema(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """`response_format`: a json_schema's schema, or any object for json_object."""
        form = body.get("response_format")
        if not isinstance(form, dict) or form.get("type") not in ("json_schema", "json_object"):
            return None
        spec = form.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        return schema if isinstance(schema, dict) else {"type": "object"}

    def output_cap(self, body: dict[str, Any], prices: ModelPrices) -> int:
        if prices.reasoning and body.get("max_tokens") is not None:
            # As OpenAI answers a reasoning model: its cap must cover the hidden tokens too.
            raise invalid("max_tokens is not supported with this model: use "
                          "max_completion_tokens", "max_tokens")
        return super().output_cap(body, prices)

    def audio_output(self, body: dict[str, Any], prices: ModelPrices) -> bool:
        if "audio" not in (body.get("modalities") or []):
            return False
        if prices.standard.audio_output is None:
            raise invalid(f"{prices.name} does not produce audio", "modalities")
        if body.get("stream") is True:
            raise invalid("the stub does not stream audio", "stream")
        return True

    def rejected_prediction(self, body: dict[str, Any], choices: int) -> int:
        """Predicted output the model did not use, billed as output on top of the answer."""
        prediction = body.get("prediction")
        if prediction is None:
            return 0
        content = prediction.get("content") if isinstance(prediction, dict) else None
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str) or choices != 1:
            raise invalid("prediction needs content, and n = 1", "prediction")
        return math.ceil(len(content.encode()) / 4)

    def body(self, decided: Answer) -> dict[str, Any]:
        return {
            "id": decided.answer_id,
            "object": "chat.completion",
            "created": decided.created_s,
            "model": decided.model,
            "service_tier": decided.service_tier,
            "system_fingerprint": "fp_stub",
            "choices": [{"index": c.index, "message": _message(decided, c), "logprobs": None,
                         "finish_reason": c.finish_reason} for c in decided.choices],
            "usage": chat_usage(decided),
        }

    def events(self, decided: Answer, fault: Fault) -> list[bytes]:
        """Every SSE event of a chat stream, in order, the `[DONE]` terminator last.

        With continuous usage every chunk also carries the usage so far: the prompt, the
        reasoning (generated before any text) and the words sent."""
        options = decided.request.get("stream_options") or {}
        options = options if isinstance(options, dict) else {}
        continuous = fault.continuous_usage or options.get("continuous_usage_stats") is True
        head = {"id": decided.answer_id, "object": "chat.completion.chunk",
                "created": decided.created_s, "model": decided.model,
                "service_tier": decided.service_tier, "system_fingerprint": "fp_stub"}
        reasoning = sum(c.reasoning_tokens for c in decided.choices)
        words_sent = 0
        events: list[bytes] = []

        def chunk(choice: Choice, delta: dict[str, Any], finish: str | None = None) -> None:
            doc: dict[str, Any] = {**head, "choices": [
                {"index": choice.index, "delta": delta, "logprobs": None,
                 "finish_reason": finish}]}
            if continuous:
                so_far = replace(decided.usage, output_tokens=reasoning + words_sent,
                                 reasoning_tokens=reasoning, audio_output_tokens=0,
                                 rejected_prediction_tokens=0)
                doc["usage"] = chat_usage(decided, so_far)
            events.append(sse(doc))

        for choice in decided.choices:
            chunk(choice, {"role": "assistant", "content": "", "refusal": None})
            if choice.tool_call is not None:
                words_sent += len(choice.words)
                chunk(choice, {"tool_calls": [{"index": 0, **_tool_call(choice.tool_call)}]})
            else:
                for piece, tokens in choice.deltas():
                    words_sent += tokens
                    chunk(choice, {"content": piece})
            chunk(choice, {}, choice.finish_reason)
        if options.get("include_usage") is True:
            events.append(sse({**head, "choices": [], "usage": chat_usage(decided)}))
        events.append(SSE_DONE)
        return events


def _web_search_options(options: object, prices: ModelPrices) -> None:
    """`web_search_options`: taken by a search model (whose fee is per call, whatever they
    say), refused by any other."""
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


# -- counting ------------------------------------------------------------------------------------


def chat_prompt(body: dict[str, Any], model: ModelPrices, registry: Registry) -> Prompt:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InputError("messages must be a non-empty list", "messages")
    counter = Counter(model, registry)
    counter.json_segment(body.get("tools") or body.get("functions"))
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") == "json_schema":
        counter.json_segment(response_format.get("json_schema"))
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        counter.count_part(where)
        if not isinstance(message, dict):
            raise InputError("each message must be an object", where)
        text_bytes = text_of(message.get("name", ""), where)
        text_bytes += sum(function_text(c, f"{where}.tool_calls")
                          for c in message.get("tool_calls") or ())
        if message.get("function_call") is not None:
            text_bytes += function_text(message["function_call"], f"{where}.function_call")
        media = [0, 0, 0]  # image, audio, file tokens
        content = message.get("content")
        if isinstance(content, str):
            text_bytes += len(content.encode())
        elif isinstance(content, list):
            for j, part in enumerate(content):
                text_bytes += _part(counter, part, f"{where}.content[{j}]", media)
        elif content is not None:
            raise InputError("content must be a string or a list of parts", where)
        counter.media_segment(message, text_bytes, media)
    return counter.prompt


def _part(counter: Counter, part: object, where: str, media: list[int]) -> int:
    counter.count_part(where)
    if not isinstance(part, dict):
        raise InputError("a content part must be an object", where)
    kind = part.get("type")
    if kind == "text":
        return text_of(part.get("text"), where)
    if kind == "refusal":
        return text_of(part.get("refusal"), where)
    if kind == "image_url":
        image = part.get("image_url")
        if isinstance(image, str):
            image = {"url": image}
        if not isinstance(image, dict):
            raise InputError("image_url must be an object with a url", where)
        media[0] += counter.image(where, image.get("url"), None, image.get("detail"))
    elif kind == "input_audio":
        media[1] += counter.audio(where, part.get("input_audio"))
    elif kind == "file":
        ref = part.get("file")
        if not isinstance(ref, dict):
            raise InputError("a file part needs a file object", where)
        media[2] += counter.file(where, ref.get("file_id"), ref.get("file_data"),
                                 ref.get("file_url"))
    else:
        raise InputError(f"content part type {kind!r} is not served", where)
    return 0


# -- the wire ------------------------------------------------------------------------------------


def chat_usage(answer: Answer, usage: Usage | None = None) -> dict[str, Any]:
    u = usage or answer.usage
    prompt_details: dict[str, int] = {"cached_tokens": u.cached_input_tokens,
                                      "audio_tokens": u.audio_input_tokens}
    if answer.reports_cache_writes:
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


def _tool_call(call: tuple[str, str, str]) -> dict[str, Any]:
    call_id, name, arguments = call
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _message(answer: Answer, choice: Choice) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": choice.text, "refusal": None}
    if choice.tool_call is not None:
        message["content"] = None
        message["tool_calls"] = [_tool_call(choice.tool_call)]
    if answer.audio_output:
        message["content"] = None
        message["audio"] = {"id": "audio_" + answer.answer_id[-24:], "data": "",
                            "expires_at": answer.created_s + 3600, "transcript": choice.text}
    return message
