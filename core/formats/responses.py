"""OpenAI's Responses API: POST /v1/responses, forwarded to CEILING_UPSTREAM_URL's responses."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from core.content import InputBound, responses_input
from core.errors import InputUnbounded
from core.formats.base import Api, StreamTally
from core.formats.openai import COMMON_FIELDS, OpenAIFormat, openai_shape
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


class Responses(OpenAIFormat):
    api = Api.RESPONSES
    route = "/v1/responses"
    name = "responses"
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
