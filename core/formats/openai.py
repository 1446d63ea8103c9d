"""OpenAI's API family on any OpenAI-compatible provider: what chat completions and Responses
(core/formats/chat.py, responses.py) share. Their provider and how it takes its key, the fields
both forward, the tools both let through, how both price a request, and their errors' shape.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

from core.content import InputBound
from core.errors import InputUnbounded, InvalidRequest
from core.formats.base import Plan, Provider, WireFormat, text_tokens
from core.ledger import Upstream
from core.prices import TIER_AUTO, check_service_tier

OPENAI = Provider(Upstream.OPENAI, "CEILING_UPSTREAM_URL", "https://api.openai.com/v1",
                  lambda config: config.upstream_url, lambda config: config.upstream_api_key,
                  ("authorization", "Bearer "), ("openai-", "x-ratelimit-"))
# The top-level fields both forward, each because its billing effect is known: the ones the
# worst case reads (model, prompt, output cap, `n`, tier, tools), and the ones that change
# nothing it leaves out (sampling, logprobs, which only lengthen the answer's body, caching
# hints, storing, reasoning effort, whose tokens count within the output cap, metadata and
# end-user ids). Any other field is refused by name: on an OpenAI-compatible upstream an unknown
# field can bill (a router's web plugin, fallback models, a provider's cached content), and a
# field added after this list may. An operator adds fields with no billing effect by
# CEILING_GATEWAY_FIELDS_ALLOWED.
COMMON_FIELDS = frozenset({
    "model", "metadata", "parallel_tool_calls", "prompt_cache_key", "prompt_cache_retention",
    "safety_identifier", "service_tier", "store", "stream", "temperature", "tool_choice",
    "tools", "top_logprobs", "top_p", "user",
})
# Tools the client runs itself; hosted tools (web search, file search, code interpreter...)
# feed the model input the request does not contain.
CLIENT_TOOL_TYPES = frozenset({"function", "custom"})


def openai_shape(error: dict[str, Any]) -> dict[str, Any]:
    """{"error": {"message", "type", "param", "code", ...details}}: what OpenAI's clients parse."""
    error = dict(error)
    code = error.pop("code")
    return {"error": {"message": error.pop("message"), "type": error.pop("type"),
                      "param": error.pop("field", None), "code": code, **error}}


class OpenAIFormat(WireFormat):
    """An API of OpenAI's: its plan, with what differs between them left to hooks."""

    provider = OPENAI
    prompt_field: str  # the field that holds the prompt, bounded by its content
    # The field OpenAI names for it now first, then the one it replaces.
    user_fields = (("safety_identifier",), ("user",))

    def plan(self, body: dict[str, Any], model: str, headers: tuple[tuple[str, str], ...],
             output_tokens_default: int) -> Plan:
        for field in self.unbounded_fields:
            if body.get(field) not in (None, False):
                raise InvalidRequest(
                    f"{field} is not supported: the gateway cannot bound its cost from the "
                    "request", field=field,
                )
        self.check_output(body)
        for field in self.unbounded_input_fields:
            if body.get(field) not in (None, False):
                raise InputUnbounded(
                    f"{field} feeds the model input the request does not contain, of a size it "
                    "cannot show", field=field,
                )
        service_tier = check_service_tier(body.get("service_tier")) or TIER_AUTO
        tools = body.get("tools") or []
        if not isinstance(tools, list) or any(
            not isinstance(t, dict) or not isinstance(t.get("type"), str)
            or t["type"] not in CLIENT_TOOL_TYPES for t in tools
        ):
            raise InputUnbounded(
                "only function and custom tools are supported: a hosted tool feeds the model "
                "input whose cost the request cannot bound", field="tools",
            )
        prompt = self.prompt(body)
        output_tokens_max = self.output_cap(body, output_tokens_default)
        choices = self.choices(body)
        stream = body.get("stream") is True
        usage_wanted = stream and self.stream_usage(body)
        return Plan(self, model, body, stream, text_tokens(body, self.prompt_field, prompt),
                    output_tokens_max, choices, usage_wanted, prompt.media, service_tier)

    def check_output(self, body: dict[str, Any]) -> None:
        """Refuse output whose cost the request cannot bound, beyond unbounded_fields."""

    @abstractmethod
    def prompt(self, body: dict[str, Any]) -> InputBound:
        """The bound of what a call is prompted with (core/content.py)."""

    def choices(self, body: dict[str, Any]) -> int:
        """How many answers the call asks for."""
        return 1

    def stream_usage(self, body: dict[str, Any]) -> bool:
        """Ask a stream for its usage where the API reports it only when asked; whether the
        client asked for it itself."""
        return False

    def error_body(self, error: dict[str, Any]) -> dict[str, Any]:
        return openai_shape(error)
