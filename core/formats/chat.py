"""OpenAI's chat completions: POST /v1/chat/completions, forwarded to CEILING_UPSTREAM_URL's
chat/completions."""

from __future__ import annotations

import json
from typing import Any

from core.content import InputBound, chat_input
from core.errors import InvalidRequest
from core.formats.base import Api, StreamTally, positive_int
from core.formats.openai import COMMON_FIELDS, OpenAIFormat, openai_shape

DONE = "[DONE]"


class Chat(OpenAIFormat):
    api = Api.CHAT
    route = "/v1/chat/completions"
    name = "chat_completions"
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
