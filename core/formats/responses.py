"""OpenAI's Responses API: POST /v1/responses, forwarded to CEILING_UPSTREAM_URL's responses."""

from __future__ import annotations

import json
from typing import Any

from core.content import InputBound, responses_input
from core.formats.base import Api, StreamTally
from core.formats.openai import COMMON_FIELDS, OpenAIFormat, openai_shape

# Stream events after which a call is over, carrying its usage.
TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})


class Responses(OpenAIFormat):
    api = Api.RESPONSES
    route = "/v1/responses"
    name = "responses"
    cap_fields = ("max_output_tokens",)
    allowed_fields = COMMON_FIELDS | {
        "input", "instructions", "max_output_tokens", "reasoning", "text", "truncation",
        "include", "max_tool_calls", "stream_options",
    }
    # A background call is billed after the answer; Anthropic's fast mode (`speed`) is billed at
    # rates its OpenAI-shaped usage does not name.
    unbounded_fields = ("background", "speed")
    # A stored conversation, response or prompt feeds the model input the request does not
    # contain.
    unbounded_input_fields = ("conversation", "previous_response_id", "prompt")
    usage_fields = ("input_tokens", "output_tokens", "input_tokens_details",
                    "output_tokens_details")
    prompt_field = "input"

    def prompt(self, body: dict[str, Any]) -> InputBound:
        return responses_input(body.get("input"))

    def stream_event(self, tally: StreamTally, doc: dict[str, Any]) -> bool:
        if doc.get("type") in TERMINAL_EVENTS:
            tally.finished = True
            response = doc.get("response")
            tally.usage = self.usage_of(
                response.get("usage"), response.get("service_tier")
            ) if isinstance(response, dict) else None
        return True

    def error_event(self, error: dict[str, Any]) -> bytes:
        # Typed `error` (the SDK yields it as one); the error's own type would name an event no
        # client knows.
        event = {**openai_shape(error)["error"], "type": "error"}
        return b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n"


RESPONSES = Responses()
