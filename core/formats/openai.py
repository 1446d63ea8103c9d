"""OpenAI's API family on any OpenAI-compatible provider: what chat completions and Responses
(core/formats/chat.py, responses.py) share. Their provider and how it takes its key, the fields
both forward, the tools both let through, how both price a request, and their errors' shape.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import replace
from typing import Any

from core.content import InputBound
from core.errors import InputUnbounded, InvalidRequest
from core.formats.base import Plan, Provider, WireFormat, positive_int, text_tokens
from core.formats.schema import Schema
from core.ledger import Upstream
from core.prices import TIER_AUTO, check_service_tier
from core.upstream_kinds.openai import OPENAI_API_HOST

OPENAI = Provider(Upstream.OPENAI, "CEILING_UPSTREAM_URL", "https://api.openai.com/v1",
                  lambda config: config.upstream_url, lambda config: config.upstream_api_key,
                  ("authorization", "Bearer "), ("openai-", "x-ratelimit-"), OPENAI_API_HOST)
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
# Tools the client runs itself (their definitions are text the body carries): functions, custom
# tools, the shell and patch tools an agent runs locally, and a namespace of any of these.
CLIENT_TOOL_TYPES = frozenset({"function", "custom", "local_shell", "shell", "apply_patch"})
NAMESPACE_TOOL_TYPE = "namespace"
# Hosted web search: a fee a search, and its results as input of each step after it, bounded by
# the request's max_tool_calls (the gateway sets HOSTED_TOOL_CALLS_DEFAULT where it is not
# given). Other hosted tools (file search, code interpreter, image generation, MCP, computer
# use) bill containers, images or remote tools the request does not bound: refused.
WEB_SEARCH_TOOL_TYPES = frozenset({
    "web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11",
})
# The max_tool_calls the gateway sets on a call with a hosted tool and none given. Agents offer
# web search on every call (Codex does) and most calls search not at all, while each search held
# is a fee and a context window of input more: two keep a search and its follow-up within one
# call, and the agent's next call may search again.
HOSTED_TOOL_CALLS_DEFAULT = 2
MAX_TOOL_CALLS_FIELD = "max_tool_calls"

# What both bodies' schemas (core/formats/schema.py) say alike: an image's detail, and OpenAI's
# tiers (a request that names none is `auto`).
DETAIL: Schema = {"type": "string", "enum": ["auto", "low", "high"]}
SERVICE_TIER: Schema = {"type": "string", "enum": ["auto", "default", "flex", "scale", "priority"]}


def _tools(tools: object, hosted: bool) -> str:
    """Check a call's tools: client tools (a namespace of them too), and with `hosted` hosted web
    search; the first web search tool's JSON path, or ''."""
    if tools is None:
        return ""
    if not isinstance(tools, list):
        raise InvalidRequest("tools must be a list", field="tools")
    search_field = ""
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if not isinstance(kind, str):
            raise InputUnbounded(f"{where}.type must name the tool's type", field=where)
        if kind in CLIENT_TOOL_TYPES:
            continue
        if kind == NAMESPACE_TOOL_TYPE and isinstance(tool, dict):
            inner = tool.get("tools")
            if not isinstance(inner, list) or any(
                    not isinstance(t, dict) or t.get("type") not in CLIENT_TOOL_TYPES
                    for t in inner):
                raise InputUnbounded(
                    f"{where}.tools: a namespace may hold only tools the client runs (function, "
                    "custom)", field=f"{where}.tools")
            continue
        if hosted and kind in WEB_SEARCH_TOOL_TYPES:
            search_field = search_field or where
            continue
        raise InputUnbounded(
            f"{where} is a tool of type {kind!r}: the gateway forwards tools the client runs "
            "(function, custom, shell, patch, a namespace of them) and hosted web search (on "
            "Responses, held at max_tool_calls searches); other hosted tools bill containers, "
            "images or remote tools that nothing in the request bounds", field=where)
    return search_field


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
             output_tokens_default: int, betas_allowed: frozenset[str] = frozenset()) -> Plan:
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
        search_field = _tools(body.get("tools"), self.hosted_tools)
        prompt = self.prompt(body)
        added = self.cap_added(body, output_tokens_default)
        output_tokens_max = self.output_cap(body, output_tokens_default)
        choices = self.choices(body)
        stream = body.get("stream") is True
        usage_wanted = stream and self.stream_usage(body)
        media = prompt.media
        referred = self.referred(body)
        if referred and not media.referred_field:
            media = replace(media, referred_field=referred)
        compaction = self.compaction(body)
        if compaction:
            media = replace(media, compaction_field=compaction)
        if search_field:
            if body.get(MAX_TOOL_CALLS_FIELD) is None:
                body[MAX_TOOL_CALLS_FIELD] = HOSTED_TOOL_CALLS_DEFAULT
                added += ((MAX_TOOL_CALLS_FIELD, HOSTED_TOOL_CALLS_DEFAULT),)
            searches = positive_int(body[MAX_TOOL_CALLS_FIELD], MAX_TOOL_CALLS_FIELD)
            media = replace(media, web_searches=searches, web_search_field=search_field)
        return Plan(self, model, body, stream, text_tokens(body, self.prompt_field, prompt),
                    output_tokens_max, choices, usage_wanted, media, service_tier,
                    bounds_added=added)

    # Whether the API takes hosted tools (Responses); chat takes client tools only.
    hosted_tools = False

    def referred(self, body: dict[str, Any]) -> str:
        """The first top-level field that feeds the model input the body does not hold."""
        return ""

    def compaction(self, body: dict[str, Any]) -> str:
        """The field that lets the provider compact the call's context, if given."""
        return ""

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
