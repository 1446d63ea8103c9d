"""Anthropic's Messages API on the stub provider: the witness for a gateway's POST /v1/messages.

  POST /v1/messages               streaming (message_start ... message_stop) and not.
  POST /v1/messages/count_tokens  the input a call would bill, uncached; free, never billed.

Both take the key by `x-api-key` or `Authorization: Bearer` (checked when the stub has one),
require `anthropic-version` (a YYYY-MM-DD date: the SDK sends its own), read `anthropic-beta`
(`context-1m-2025-08-07` opens a long-context model's 1M window at its long-context rates;
`interleaved-thinking-2025-05-14` lets `thinking.budget_tokens` exceed `max_tokens`), refuse a
request body above 32 MB (413) and refuse fields the API does not have (400), and answer every
response with a `request-id` header and errors in Anthropic's shape
(https://platform.claude.com/docs/en/api/errors). The wire format follows Anthropic's API
reference (https://platform.claude.com/docs/en/api/messages; streaming:
https://platform.claude.com/docs/en/build-with-claude/streaming), checked against the
`anthropic` SDK in tests/infra/test_stub_anthropic.py. A stream reports the input in
`message_start`, before any web search ran, and again, cumulatively and final, in
`message_delta`, with the output.

Billing, as Anthropic documents it (https://platform.claude.com/docs/en/about-claude/pricing):
input at the input rate, prompt-cache writes at the 5-minute (1.25x) or 1-hour (2x) write rate,
reads at the read rate (0.1x), output (thinking included) at the output rate, $10 per 1,000 web
searches, and a long-context model's whole call at its long-context rates when sent with the
beta and more than 200K input tokens.

Counting: infra.stub_tokens' text rule (a block's UTF-8 bytes over four, 4 tokens a message, 3
for the reply; only text counts as text), and:
- Tools: each definition by its JSON bytes (cache_control left out), plus the tool-use system
  prompt Anthropic adds to every call that has tools, by model and `tool_choice` (the table's
  `tool_prompt_tokens`; https://platform.claude.com/docs/en/agents-and-tools/tool-use/overview,
  "pricing").
- Images: Anthropic's area rule, sized from the image itself for a base64 source (whose bytes
  must be the `media_type` they claim), or from the registry for a URL or a Files API id.
- Documents (https://platform.claude.com/docs/en/build-with-claude/pdf-support): a PDF is billed
  for its text (its bytes over four) and an image of each letter page under the area rule; a
  plain-text document is its text, a content document its blocks.
- Thinking blocks sent back (https://platform.claude.com/docs/en/build-with-claude/
  extended-thinking): the thinking of earlier turns is dropped from the context, that of the
  turn still in progress (an assistant turn answered only by tool results) is kept, and a model
  with `keeps_thinking` keeps every turn's. A kept block is billed by the text the request
  carries (signatures are not checked: a forged block is billed too).
- Web search results sent back: their url, title and encrypted content, by bytes.

Prompt cache (https://platform.claude.com/docs/en/build-with-claude/prompt-caching): the prompt
is tools, system, messages, in that order, and each `cache_control` breakpoint (at most 4; a
top-level `cache_control` marks the last cacheable block) caches the prefix up to it, if it is
at least the model's minimum, for 5 minutes or 1 hour from its last use. A call reads the
longest cached prefix found at the block boundaries from each breakpoint back 20 blocks (A),
writes at the 1-hour rate up to its last 1-hour breakpoint after that (B) and at the 5-minute
rate from there to its last breakpoint (C): read A, write 1h B - A, write 5m C - B, the docs'
own rule for mixed TTLs. Changing `tool_choice` or `thinking` invalidates the cached messages
but not the cached tools and system, as the docs' invalidation table says. The clock can be
moved on by /control's `clock_offset_s`, so a test passes 5 minutes without waiting them.

The answer: `max_tokens` caps every output token, thinking included (0 fills the cache and
answers nothing). With `thinking` enabled, half the output is thinking (at most the budget), or
`X-Stub-Reasoning-Tokens: N`; the thinking text shown is a summary of a word every four tokens,
as Claude 4 summarizes what it bills in full. A `tool_choice` of any or tool answers with a call
to the tool, as does `X-Stub-Tool-Call: 1` (the first client tool) under auto; stop sequences
end the text where they appear.

Web search: a call with a `web_search_20250305` tool runs `X-Stub-Web-Searches: N` (or /control's
`web_searches`) searches, one when the tool is forced, none otherwise; at most `max_uses`, the
rest answered with a `max_uses_exceeded` error and not billed. Each search is billed its fee and
its results as input: `web_search_result_tokens` tokens (a /control setting), which the results'
url, title and encrypted content sent back on a later turn also count to.

Faults as on the OpenAI routes (infra.stub_provider), but for fail_after_billing on a stream:
it answers 200, message_start and an `error` event for the status, and no message_stop.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from infra.stub_bill import Usage
from infra.stub_faults import (
    Api,
    ApiError,
    Decided,
    Fault,
    header_count,
    pieces,
    read_body,
    sse,
    words,
)
from infra.stub_prices import (
    TIER_LONG_CONTEXT,
    TIER_STANDARD,
    LongContext,
    ModelPrices,
    cost_micros,
)
from infra.stub_tokens import (
    TOKENS_PER_MESSAGE,
    TOKENS_PER_REPLY,
    FileRef,
    InputError,
    Registry,
    Walk,
    decode_base64,
    image_size,
    image_tokens,
    pdf_pages,
    read_at,
    text_tokens,
)

if TYPE_CHECKING:
    from infra.stub_provider import StubProviderApp

API_COUNT_TOKENS = "messages.count_tokens"
# Anthropic's request size limit for the Messages API (https://platform.claude.com/docs/en/api/
# overview, "request size limits").
REQUEST_BYTES_MAX = 32 * 1024 * 1024
API_VERSION = re.compile(r"\d{4}-\d{2}-\d{2}")
INTERLEAVED_THINKING_BETA = "interleaved-thinking-2025-05-14"
# Extended thinking (https://platform.claude.com/docs/en/build-with-claude/extended-thinking):
# the smallest budget the API takes.
THINKING_BUDGET_TOKENS_MIN = 1_024
# With thinking on, top_p may only be between these (same page); temperature and top_k not set.
THINKING_TOP_P_MIN = 0.95
# The share of an answer spent thinking, within the budget: the stub's own choice, since no
# provider documents one (the OpenAI side's medium effort is the same half).
THINKING_SHARE = Fraction(1, 2)
# The thinking shown is a summary: a word for every this many tokens billed (the stub's own
# ratio; Anthropic documents only that Claude 4 bills the full thinking and shows a summary).
THINKING_TOKENS_PER_SUMMARY_WORD = 4
THINKING_WORDS = ("consider", "the", "budget", "before", "answering")
# The prompt cache looks for hits this many blocks back from each breakpoint (the docs say
# "approximately 20"), and holds at most this many prefixes: a long load run must not grow the
# stub without end.
CACHE_LOOKBACK_BLOCKS = 20
CACHE_PREFIXES_MAX = 10_000
# Prompt caching: at most 4 breakpoints; the two TTLs, in seconds.
CACHE_BREAKPOINTS_MAX = 4
CACHE_TTL_S = {"5m": 300, "1h": 3_600}
# Top-level fields of a Messages call the stub serves; the API's others it refuses by name (a
# field it ignored could change what a real call bills), and anything else the API refuses too.
FIELDS = frozenset({"model", "messages", "max_tokens", "system", "metadata", "stop_sequences",
                    "stream", "temperature", "top_p", "top_k", "tools", "tool_choice", "thinking",
                    "service_tier", "cache_control"})
COUNT_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking",
                          "cache_control"})
FIELDS_NOT_SERVED = frozenset({"container", "mcp_servers", "context_management", "output_config",
                               "output_format", "speed", "inference_geo", "diagnostics",
                               "user_profile_id", "workspace_id"})
SERVICE_TIERS = ("auto", "standard_only")
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
# Anthropic's limits (https://platform.claude.com/docs/en/build-with-claude/vision, "general
# limits"): 5 MB an image; 8000 x 8000 px, or 2000 x 2000 px in a request of more than 20
# images; 100 images a request.
IMAGE_BYTES_MAX = 5 * 1024 * 1024
IMAGE_SIDE_PX_MAX = 8_000
IMAGE_SIDE_PX_MAX_MANY = 2_000
IMAGES_MANY = 20
IMAGES_MAX = 100
# PDF support: 100 pages a request (https://platform.claude.com/docs/en/build-with-claude/
# pdf-support, "requirements"); the request itself is held to 32 MB by the route.
PDF_PAGES_MAX = 100
WEB_SEARCH_TOOL = "web_search_20250305"
# Keys a client tool definition may have; the others are server or Anthropic-defined tools.
CLIENT_TOOL_KEYS = frozenset({"type", "name", "description", "input_schema", "cache_control",
                              "strict"})
WEB_SEARCH_KEYS = frozenset({"type", "name", "max_uses", "allowed_domains", "blocked_domains",
                             "user_location", "cache_control"})
TOOL_CHOICES = ("auto", "any", "tool", "none")
USER_BLOCKS = frozenset({"text", "image", "document", "tool_result"})
ASSISTANT_BLOCKS = frozenset({"text", "thinking", "redacted_thinking", "tool_use",
                              "server_tool_use", "web_search_tool_result"})
# Characters of tool input JSON a streamed input_json_delta carries: more than one delta a
# call, so a client's partial-JSON parsing is exercised.
JSON_CHUNK_CHARS = 64
# The broad error type Anthropic answers each status with; other 4xx are
# invalid_request_error, other 5xx api_error.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 504: "timeout_error",
               529: "overloaded_error"}


# -- counting ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Breakpoint:
    """A `cache_control` marker: the prefix up to boundary `boundary` is cached for `ttl_s`."""

    boundary: int
    ttl_s: int


@dataclass(frozen=True)
class ToolChoice:
    kind: str  # auto, any, tool or none
    name: str | None = None  # the tool `tool` names


@dataclass
class Tools:
    """What the request's tools allow the model to do."""

    client: list[str] = field(default_factory=list)  # client tool names, in order
    web_search: bool = False
    web_search_max_uses: int | None = None  # None: no limit given
    choice: ToolChoice = ToolChoice("auto")

    @property
    def forced(self) -> str | None:
        """The tool the model must call: a named one, or the first for `any`."""
        if self.choice.kind == "tool":
            return self.choice.name
        if self.choice.kind == "any":
            return self.client[0] if self.client else "web_search"
        return None


@dataclass
class MessagesPrompt:
    """A request's input, counted. `boundaries`: (digest of the prompt up to a block, tokens up
    to it) at every block boundary, in order; `breakpoints` point into it."""

    tokens: int = 0
    image_tokens: int = 0
    file_tokens: int = 0
    boundaries: list[tuple[bytes, int]] = field(default_factory=list)
    breakpoints: list[Breakpoint] = field(default_factory=list)
    tools: Tools = field(default_factory=Tools)


def _str(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise InputError("expected a string", where)
    return value


def _text(value: object, where: str) -> int:
    if not isinstance(value, str):
        raise InputError(f"{where}: expected a string", where)
    return len(value.encode())


class MessagesCounter(Walk):
    """Counts one request's blocks in the order Anthropic builds the prompt."""

    parts_name = "messages and blocks"

    def __init__(self, model: ModelPrices, registry: Registry) -> None:
        if model.messages is None:
            raise ValueError(f"{model.name} is not served by the Messages API")
        super().__init__(model, registry)
        self.prompt = MessagesPrompt()
        self.images = 0
        self._sides: list[int] = []  # the longest side of each image
        self._cacheable_at: int | None = None  # the last boundary a breakpoint may sit on

    def block(self, source: dict[str, Any], tokens: int, where: str, *,
              cacheable: bool = True) -> None:
        """Add one block's tokens and its boundary; a `cache_control` on it is a breakpoint."""
        self.count_part(where)
        self.prompt.tokens += tokens
        self.chain({k: v for k, v in source.items() if k != "cache_control"})
        self.prompt.boundaries.append((self.digest, self.prompt.tokens))
        if cacheable:
            self._cacheable_at = len(self.prompt.boundaries) - 1
        control = source.get("cache_control")
        if control is not None:
            if not cacheable:
                raise InputError(f"{where}: this block cannot carry cache_control", where)
            self.breakpoint(control, f"{where}.cache_control")

    def marker(self, settings: object) -> None:
        """Hash settings into the prompt without tokens or a boundary: what follows is cached
        apart from what the same prefix holds under other settings."""
        self.chain({"settings": settings})

    def breakpoint(self, control: object, where: str, boundary: int | None = None) -> None:
        if not isinstance(control, dict) or control.get("type") != "ephemeral" or (
            set(control) - {"type", "ttl"}
        ):
            raise InputError(f'{where} must be {{"type": "ephemeral"}} with an optional ttl',
                             where)
        ttl = control.get("ttl", "5m")
        if not isinstance(ttl, str) or ttl not in CACHE_TTL_S:
            raise InputError(f"{where}.ttl must be 5m or 1h", where)
        if ttl == "1h" and self.model.standard.cache_write_1h is None:
            raise InputError(f"{self.model.name} has no 1-hour cache", where)
        ttl_s = CACHE_TTL_S[ttl]
        breakpoints = self.prompt.breakpoints
        if len(breakpoints) >= CACHE_BREAKPOINTS_MAX:
            raise InputError(f"A maximum of {CACHE_BREAKPOINTS_MAX} blocks with cache_control "
                             "may be provided", where)
        if breakpoints and ttl_s > breakpoints[-1].ttl_s:
            raise InputError("a ttl='1h' cache_control block must not come after a ttl='5m' "
                             "one", where)
        at = len(self.prompt.boundaries) - 1 if boundary is None else boundary
        breakpoints.append(Breakpoint(at, ttl_s))

    def last_cacheable(self, control: object) -> None:
        """Top-level `cache_control`: a breakpoint on the last block that can hold one."""
        if self._cacheable_at is None:
            raise InputError("cache_control: the request has no block to cache", "cache_control")
        self.breakpoint(control, "cache_control", self._cacheable_at)

    def image(self, source: object, where: str) -> int:
        rule = self.model.image
        if rule is None:
            raise InputError(f"{self.model.name} does not accept image input", where)
        self.images += 1
        if self.images > IMAGES_MAX:
            raise InputError(f"too many images: at most {IMAGES_MAX} a request", where)
        if not isinstance(source, dict):
            raise InputError("an image needs a source", where)
        kind = source.get("type")
        if kind == "base64":
            media_type = source.get("media_type")
            if media_type not in IMAGE_MEDIA_TYPES:
                raise InputError(f"image media_type must be one of {', '.join(IMAGE_MEDIA_TYPES)}",
                                 where)
            with read_at(where):
                data = decode_base64(_str(source.get("data"), where), "the image",
                                     IMAGE_BYTES_MAX)
                read_type, size = image_size(data)
            if read_type != media_type:
                raise InputError(f"Image does not match the provided media type {media_type}",
                                 where)
        elif kind == "url":
            url = source.get("url")
            known = self.registry.images.get(url) if isinstance(url, str) else None
            if known is None:
                raise InputError(f"Unable to download the file at {url!r}", where)
            size = known
        elif kind == "file":
            ref = self.registry.files.get(str(source.get("file_id")))
            if ref is None or ref.image is None:
                raise InputError(f"no image file with id {source.get('file_id')!r}", where)
            size = ref.image
        else:
            raise InputError("an image source is base64, url or file", where)
        if max(size) > IMAGE_SIDE_PX_MAX:
            raise InputError(f"image dimensions exceed max allowed size: {IMAGE_SIDE_PX_MAX} "
                             "pixels", where)
        tokens = image_tokens(rule, size[0], size[1], "auto")
        self.prompt.image_tokens += tokens
        self._sides.append(max(size))
        return tokens

    def check_many_images(self) -> None:
        """More than 20 images in a request: each must fit 2000 x 2000 px."""
        if self.images > IMAGES_MANY and max(self._sides, default=0) > IMAGE_SIDE_PX_MAX_MANY:
            raise InputError(f"image dimensions exceed max allowed size for many-image requests: "
                             f"{IMAGE_SIDE_PX_MAX_MANY} pixels", "messages")

    def document(self, source: object, where: str) -> tuple[int, int]:
        """(text tokens, file tokens) of a document block's source."""
        if not isinstance(source, dict):
            raise InputError("a document needs a source", where)
        kind = source.get("type")
        if kind == "text":
            if source.get("media_type", "text/plain") != "text/plain":
                raise InputError("a text document's media_type is text/plain", where)
            return text_tokens(_text(source.get("data"), where)), 0
        if kind == "content":
            content = source.get("content")
            if isinstance(content, str):
                return text_tokens(len(content.encode())), 0
            return self.nested(content, f"{where}.content", ("text", "image")), 0
        if kind == "base64":
            if source.get("media_type") != "application/pdf":
                raise InputError("a base64 document's media_type is application/pdf", where)
            with read_at(where):
                data = decode_base64(_str(source.get("data"), where), "the document")
            pages = pdf_pages(data)
            if not pages:
                raise InputError("The PDF specified was not valid", where)
            ref = FileRef(len(data), pages)
        elif kind in ("url", "file"):
            key = source.get("url") if kind == "url" else source.get("file_id")
            known = self.registry.files.get(key) if isinstance(key, str) else None
            if known is None:
                raise InputError(f"Unable to download the file {key!r}", where)
            ref = known
        else:
            raise InputError("a document source is base64, url, file, text or content", where)
        if ref.pages > PDF_PAGES_MAX:
            raise InputError(f"A maximum of {PDF_PAGES_MAX} PDF pages may be provided", where)
        if self.model.image is None:
            raise InputError(f"{self.model.name} does not accept PDF input", where)
        tokens = self.file_tokens(ref, where)
        self.prompt.file_tokens += tokens
        return 0, tokens

    def nested(self, content: object, where: str, kinds: tuple[str, ...]) -> int:
        """Tokens of blocks inside a tool result or a content document (text, image, document)."""
        if not isinstance(content, list):
            raise InputError("content must be a string or a list of blocks", where)
        tokens = 0
        for j, part in enumerate(content):
            at = f"{where}[{j}]"
            self.count_part(at)
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in kinds or not isinstance(part, dict):
                raise InputError(f"block type {kind!r} is not allowed here", at)
            if kind == "text":
                tokens += text_tokens(_text(part.get("text"), at))
            elif kind == "image":
                tokens += self.image(part.get("source"), at)
            else:
                tokens += sum(self.document(part.get("source"), at))
        return tokens


def messages_prompt(body: dict[str, Any], model: ModelPrices, registry: Registry) -> MessagesPrompt:
    """Count `body` (already checked to be an object with a Messages API model)."""
    counter = MessagesCounter(model, registry)
    counter.prompt.tools = _tools(counter, body.get("tools"), body.get("tool_choice"))
    _system(counter, body.get("system"))
    # Changing tool_choice or thinking invalidates the cached messages but not tools and system.
    counter.marker({"tool_choice": body.get("tool_choice"), "thinking": body.get("thinking")})
    _messages(counter, body.get("messages"))
    if body.get("cache_control") is not None:
        counter.last_cacheable(body["cache_control"])
    counter.check_many_images()
    counter.prompt.tokens += TOKENS_PER_REPLY
    return counter.prompt


def _tools(counter: MessagesCounter, tools: object, choice: object) -> Tools:
    given = Tools()
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise InputError("tools must be a list", "tools")
    messages = counter.model.messages
    assert messages is not None  # checked by MessagesCounter
    given.choice = _tool_choice(choice)
    if not tools:
        if choice is not None and given.choice.kind != "none":
            raise InputError("tool_choice may only be specified while providing tools",
                             "tool_choice")
        return given
    overhead = (messages.tool_prompt_tokens_any if given.choice.kind in ("any", "tool")
                else messages.tool_prompt_tokens_auto)
    counter.prompt.tokens += overhead
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InputError("a tool must be an object", where)
        kind = tool.get("type", "custom")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise InputError("a tool needs a name", where)
        if name in names:
            raise InputError(f"Tool names must be unique: {name!r}", where)
        names.add(name)
        if kind == "custom":
            if set(tool) - CLIENT_TOOL_KEYS:
                raise InputError(f"{where}: Extra inputs are not permitted", where)
            schema = tool.get("input_schema")
            if not isinstance(schema, dict) or schema.get("type") != "object":
                raise InputError("input_schema must be a JSON schema of type object", where)
            given.client.append(name)
        elif kind == WEB_SEARCH_TOOL:
            _web_search(counter, tool, given, where)
        else:
            raise InputError(f"tool type {kind!r} is not served by the stub", where)
        size = len(json.dumps({k: v for k, v in tool.items() if k != "cache_control"},
                              separators=(",", ":"), ensure_ascii=False).encode())
        counter.block(tool, text_tokens(size), where)
    if given.choice.kind == "tool" and given.choice.name not in names:
        raise InputError(f"tool_choice names a tool that is not given: {given.choice.name!r}",
                         "tool_choice")
    return given


def _web_search(counter: MessagesCounter, tool: dict[str, Any], given: Tools, where: str) -> None:
    if counter.model.web_search_micros is None:
        raise InputError(f"web search is not available on {counter.model.name}", where)
    if set(tool) - WEB_SEARCH_KEYS or tool.get("name") != "web_search":
        raise InputError(f"{where}: a web search tool is named web_search and takes max_uses, "
                         "allowed_domains, blocked_domains and user_location", where)
    if "allowed_domains" in tool and "blocked_domains" in tool:
        raise InputError("use either allowed_domains or blocked_domains, not both", where)
    max_uses = tool.get("max_uses")
    if max_uses is not None and (type(max_uses) is not int or max_uses < 1):
        raise InputError("max_uses must be a positive integer", where)
    given.web_search, given.web_search_max_uses = True, max_uses


def _tool_choice(choice: object) -> ToolChoice:
    if choice is None:
        return ToolChoice("auto")
    if not isinstance(choice, dict) or choice.get("type") not in TOOL_CHOICES:
        raise InputError(f"tool_choice.type must be one of {', '.join(TOOL_CHOICES)}",
                         "tool_choice")
    if set(choice) - {"type", "name", "disable_parallel_tool_use"}:
        raise InputError("tool_choice: Extra inputs are not permitted", "tool_choice")
    name = choice.get("name")
    if (choice["type"] == "tool") != isinstance(name, str):
        raise InputError("tool_choice names a tool exactly when its type is tool", "tool_choice")
    return ToolChoice(str(choice["type"]), name if isinstance(name, str) else None)


def _system(counter: MessagesCounter, system: object) -> None:
    if system is None:
        return
    if isinstance(system, str):
        if system:
            counter.block({"type": "text", "text": system}, text_tokens(len(system.encode())),
                          "system")
        return
    if not isinstance(system, list):
        raise InputError("system must be a string or a list of text blocks", "system")
    for i, part in enumerate(system):
        where = f"system[{i}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            raise InputError("system blocks must be text blocks", where)
        counter.block(part, text_tokens(_text(part.get("text"), where)), where)


def _messages(counter: MessagesCounter, messages: object) -> None:
    if not isinstance(messages, list) or not messages:
        raise InputError("messages: at least one message is required", "messages")
    model = counter.model.messages
    assert model is not None  # checked by MessagesCounter
    # Thinking is kept from the turn still in progress: the messages after the last user
    # message that is more than tool results.
    turn_starts = 0
    for i, message in enumerate(messages):
        if isinstance(message, dict) and message.get("role") == "user" and not _only_tool_results(
            message.get("content")
        ):
            turn_starts = i + 1
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        counter.count_part(where)
        if not isinstance(message, dict) or set(message) - {"role", "content"}:
            raise InputError("a message is {role, content}", where)
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise InputError("role must be user or assistant", where)
        content = message.get("content")
        if isinstance(content, str):
            blocks: list[Any] = [{"type": "text", "text": content}] if content else []
        elif isinstance(content, list):
            blocks = content
        else:
            raise InputError("content must be a string or a list of blocks", where)
        if not blocks and not (i == len(messages) - 1 and role == "assistant"):
            raise InputError("messages must have non-empty content except for the optional "
                             "final assistant message", where)
        counter.prompt.tokens += TOKENS_PER_MESSAGE
        keeps_thinking = model.keeps_thinking or i >= turn_starts
        for j, part in enumerate(blocks):
            _block(counter, part, f"{where}.content[{j}]", str(role), keeps_thinking)


def _only_tool_results(content: object) -> bool:
    return isinstance(content, list) and bool(content) and all(
        isinstance(b, dict) and b.get("type") == "tool_result" for b in content)


def _block(counter: MessagesCounter, part: object, where: str, role: str,
           keeps_thinking: bool) -> None:
    if not isinstance(part, dict):
        raise InputError("a content block must be an object", where)
    kind = part.get("type")
    allowed = USER_BLOCKS if role == "user" else ASSISTANT_BLOCKS
    if not isinstance(kind, str) or kind not in allowed:
        raise InputError(f"content block type {kind!r} is not served in a {role} message",
                         where)
    tokens = 0
    cacheable = True
    if kind == "text":
        tokens = text_tokens(_text(part.get("text"), where))
    elif kind == "image":
        tokens = counter.image(part.get("source"), where)
    elif kind == "document":
        text = sum(_text(part[k], where) for k in ("title", "context") if part.get(k) is not None)
        doc_text, files = counter.document(part.get("source"), where)
        tokens = text_tokens(text) + doc_text + files
    elif kind in ("tool_use", "server_tool_use"):
        if not isinstance(part.get("id"), str) or not isinstance(part.get("input"), dict):
            raise InputError(f"a {kind} block needs an id and an input object", where)
        arguments = json.dumps(part["input"], separators=(",", ":"), ensure_ascii=False)
        tokens = text_tokens(_text(part.get("name"), where) + len(arguments.encode()))
    elif kind == "tool_result":
        if not isinstance(part.get("tool_use_id"), str):
            raise InputError("a tool_result needs a tool_use_id", where)
        content = part.get("content", "")
        tokens = (text_tokens(len(content.encode())) if isinstance(content, str)
                  else counter.nested(content, f"{where}.content", ("text", "image", "document")))
    elif kind in ("thinking", "redacted_thinking"):
        cacheable = False  # Anthropic: thinking blocks cannot carry cache_control
        text_key = "thinking" if kind == "thinking" else "data"
        text_bytes = _text(part.get(text_key), where)
        if kind == "thinking" and not isinstance(part.get("signature"), str):
            raise InputError("a thinking block needs its signature", where)
        tokens = text_tokens(text_bytes) if keeps_thinking else 0
    else:  # web_search_tool_result
        tokens = _search_result_tokens(part, where)
    counter.block(part, tokens, where, cacheable=cacheable)


def _search_result_tokens(part: dict[str, Any], where: str) -> int:
    if not isinstance(part.get("tool_use_id"), str):
        raise InputError("a web_search_tool_result needs a tool_use_id", where)
    content = part.get("content")
    if isinstance(content, dict):  # an error: {"type": "web_search_tool_result_error", ...}
        return 0
    if not isinstance(content, list):
        raise InputError("web search results are a list", where)
    size = 0
    for result in content:
        if not isinstance(result, dict) or result.get("type") != "web_search_result":
            raise InputError("each web search result is a web_search_result", where)
        size += sum(_text(result.get(k), where) for k in ("url", "title", "encrypted_content"))
        if result.get("page_age") is not None:
            size += _text(result["page_age"], where)
    return text_tokens(size)


def search_result_tokens(results: list[dict[str, Any]]) -> int:
    """The input tokens a list of web search results costs, sent back or fed to the model."""
    return _search_result_tokens({"tool_use_id": "", "content": results}, "web_search")


# -- the call ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheUse:
    """What a call reads from and writes to the prompt cache; `hit` the boundary it read."""

    read_tokens: int = 0
    write_5m_tokens: int = 0
    write_1h_tokens: int = 0
    hit: int | None = None


class PromptCache:
    """Cached prefixes by (model, digest): when each expires and its TTL."""

    def __init__(self) -> None:
        self.entries: OrderedDict[tuple[str, bytes], tuple[float, int]] = OrderedDict()

    def use(self, model: ModelPrices, prompt: MessagesPrompt, now_s: float) -> CacheUse:
        assert model.messages is not None  # a Messages API model
        tokens = [t for _, t in prompt.boundaries]
        read, hit = 0, None
        for point in prompt.breakpoints:
            for at in range(point.boundary, max(point.boundary - CACHE_LOOKBACK_BLOCKS, 0) - 1,
                            -1):
                entry = self.entries.get((model.name, prompt.boundaries[at][0]))
                if entry is not None and entry[0] > now_s:
                    if tokens[at] > read:
                        read, hit = tokens[at], at
                    break
        written = [p for p in prompt.breakpoints
                   if tokens[p.boundary] >= model.messages.cache_tokens_min
                   and tokens[p.boundary] > read]
        end_1h = max((tokens[p.boundary] for p in written if p.ttl_s > 300), default=read)
        end = max((tokens[p.boundary] for p in written), default=read)
        return CacheUse(read, end - end_1h, end_1h - read, hit)

    def store(self, model: ModelPrices, prompt: MessagesPrompt, use: CacheUse,
              now_s: float) -> None:
        """Refresh the prefix read; cache every breakpoint's prefix that is long enough."""
        assert model.messages is not None  # a Messages API model
        if use.hit is not None:
            key = (model.name, prompt.boundaries[use.hit][0])
            # Another call may have evicted it since this one read it: the read stands.
            entry = self.entries.get(key)
            if entry is not None:
                self.entries[key] = (now_s + entry[1], entry[1])
        for point in prompt.breakpoints:
            digest, tokens = prompt.boundaries[point.boundary]
            if tokens < model.messages.cache_tokens_min:
                continue
            key = (model.name, digest)
            old = self.entries.get(key)
            ttl_s = max(point.ttl_s, old[1] if old is not None and old[0] > now_s else 0)
            self.entries[key] = (now_s + ttl_s, ttl_s)
            self.entries.move_to_end(key)
        while len(self.entries) > CACHE_PREFIXES_MAX:
            self.entries.popitem(last=False)


@dataclass(frozen=True)
class Params:
    max_tokens: int
    thinking_budget: int | None  # None: thinking is off
    stop_sequences: tuple[str, ...]


@dataclass(frozen=True)
class Search:
    """One server-side web search: its results, or None when max_uses refused it."""

    tool_use_id: str
    query: str
    results: tuple[dict[str, Any], ...] | None


@dataclass(frozen=True, kw_only=True)
class Reply(Decided):
    """A message decided before its first byte, and what it was billed.

    `thinking` is the text shown (a summary of the thinking billed), None when thinking is off;
    `text` is the answer, or the input of the tool call `tool_call` (id, name) answers with."""

    message_id: str
    thinking: str | None
    signature: str
    searches: tuple[Search, ...]
    text: str
    tool_call: tuple[str, str] | None
    stop_reason: str
    stop_sequence: str | None
    search_tokens: int  # input the search results added, after message_start reported it
    server_tools: bool  # the request had a server tool, so usage reports server_tool_use
    prices: ModelPrices
    prompt: MessagesPrompt
    cache: CacheUse


def invalid(message: str) -> ApiError:
    return ApiError(400, message)


def _number(body: dict[str, Any], key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if type(value) not in (int, float) or not low <= value <= high:
        raise invalid(f"{key}: must be a number from {low} to {high}")
    return float(value)


def _check_fields(body: dict[str, Any], served: frozenset[str]) -> None:
    for key, value in body.items():
        if key in served:
            continue
        if key in FIELDS_NOT_SERVED:
            if value is not None:
                raise invalid(f"{key}: not served by the stub")
            continue
        raise invalid(f"{key}: Extra inputs are not permitted")


def _params(body: dict[str, Any], prices: ModelPrices, betas: set[str]) -> Params:
    assert prices.messages is not None  # a Messages API model
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise invalid("max_tokens: Field required")
    if type(max_tokens) is not int or max_tokens < 0:
        raise invalid("max_tokens: must be an integer, 0 or more")
    if max_tokens > prices.messages.output_tokens_max:
        raise invalid(f"max_tokens: {max_tokens} > {prices.messages.output_tokens_max}, which is "
                      f"the maximum allowed number of output tokens for {prices.name}")
    thinking = body.get("thinking")
    budget = None
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        if set(thinking) != {"type", "budget_tokens"}:
            raise invalid("thinking: enabled thinking takes budget_tokens")
        if not prices.reasoning:
            raise invalid(f"thinking: not supported by {prices.name}")
        budget = thinking["budget_tokens"]
        if type(budget) is not int or budget < THINKING_BUDGET_TOKENS_MIN:
            raise invalid("thinking.enabled.budget_tokens: Input should be greater than or "
                          f"equal to {THINKING_BUDGET_TOKENS_MIN}")
        if budget >= max_tokens and INTERLEAVED_THINKING_BETA not in betas:
            raise invalid("`max_tokens` must be greater than `thinking.budget_tokens`")
    elif thinking is not None and thinking != {"type": "disabled"}:
        raise invalid('thinking: type is "enabled" (with budget_tokens) or "disabled"')
    temperature = _number(body, "temperature", 0, 1)
    top_p = _number(body, "top_p", 0, 1)
    top_k = body.get("top_k")
    if top_k is not None and (type(top_k) is not int or top_k < 0):
        raise invalid("top_k: must be an integer, 0 or more")
    if budget is not None and (temperature not in (None, 1) or top_k is not None
                               or (top_p is not None and top_p < THINKING_TOP_P_MIN)):
        raise invalid("thinking isn't compatible with temperature or top_k modifications, and "
                      f"takes top_p from {THINKING_TOP_P_MIN} to 1")
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("stop_sequences: a list of non-empty strings")
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or set(metadata) - {"user_id"}
                                 or not isinstance(metadata.get("user_id", ""), str | None)):
        raise invalid("metadata: only user_id, a string")
    if body.get("service_tier") not in (None, *SERVICE_TIERS):
        raise invalid(f"service_tier: one of {', '.join(SERVICE_TIERS)}")
    if body.get("stream") is not None and type(body["stream"]) is not bool:
        raise invalid("stream: a boolean")
    return Params(max_tokens, budget, tuple(stops))


def _stopped(text_words: tuple[str, ...],
             stops: tuple[str, ...]) -> tuple[str, int, str | None]:
    """The text of the words up to the first stop sequence: (text, words generated, sequence)."""
    text = ""
    for i, word in enumerate(text_words):
        text = word if i == 0 else f"{text} {word}"
        for stop in stops:
            # Earlier words matched nothing, so a match must end in this one.
            at = text.find(stop, max(0, len(text) - len(word) - len(stop)))
            if at >= 0:
                return text[:at], i + 1, stop
    return text, len(text_words), None


class MessagesApi(Api[Reply]):
    """The Messages API routes, on the app's shared bill, prices, faults and registry."""

    name = "messages"
    request_bytes_max = REQUEST_BYTES_MAX

    def __init__(self, app: StubProviderApp) -> None:
        self.app = app
        self.cache = PromptCache()

    def reset(self) -> None:
        self.cache = PromptCache()

    def headers(self) -> dict[str, str]:
        return {"request-id": "req_" + secrets.token_hex(12)}

    def error(self, error: ApiError, headers: dict[str, str]) -> Response:
        body = {"type": "error", "error": {"type": _error_type(error.status),
                                           "message": error.message},
                "request_id": headers["request-id"]}
        return JSONResponse(body, status_code=error.status, headers=headers)

    def check(self, request: Request) -> set[str]:
        """Authorize the call and read its betas."""
        key = self.app.api_key
        if key is not None and request.headers.get("x-api-key") != key and (
            request.headers.get("authorization") != f"Bearer {key}"
        ):
            raise ApiError(401, "invalid x-api-key")
        version = request.headers.get("anthropic-version")
        if version is None:
            raise invalid("anthropic-version: header is required")
        if not API_VERSION.fullmatch(version):
            raise invalid(f"anthropic-version: {version!r} is not a version")
        return {beta.strip() for header in request.headers.getlist("anthropic-beta")
                for beta in header.split(",") if beta.strip()}

    async def count_tokens(self, request: Request) -> Response:
        """The input tokens of a call, as it would bill them with nothing cached. Free."""
        self.app.bill.requests += 1
        headers = self.headers()
        model: str | None = None
        try:
            self.check(request)
            body = await read_body(request, REQUEST_BYTES_MAX)
            model = body.get("model") if isinstance(body.get("model"), str) else None
            prices = self._model(body)
            _check_fields(body, COUNT_FIELDS)
            prompt = self._prompt(body, prices)
        except ApiError as exc:
            self.app.log(API_COUNT_TOKENS, model, exc.status, False, Fault())
            return self.error(exc, headers)
        self.app.log(API_COUNT_TOKENS, model, 200, False, Fault())
        return JSONResponse({"input_tokens": prompt.tokens}, headers=headers)

    def _model(self, body: dict[str, Any]) -> ModelPrices:
        name = body.get("model")
        if not isinstance(name, str):
            raise invalid("model: Field required")
        prices = self.app.prices.model(name)
        # An unpriced model cannot be billed, so it is not served; nor is OpenAI's model here.
        if prices is None or prices.messages is None:
            raise ApiError(404, f"model: {name}")
        return prices

    def _prompt(self, body: dict[str, Any], prices: ModelPrices) -> MessagesPrompt:
        try:
            return messages_prompt(body, prices, self.app.registry)
        except InputError as exc:
            raise invalid(str(exc)) from exc

    def decide(self, body: dict[str, Any], request: Request, fault: Fault,
               betas: set[str]) -> Reply:
        prices = self._model(body)
        assert prices.messages is not None  # checked by _model
        _check_fields(body, FIELDS)
        params = _params(body, prices, betas)
        prompt = self._prompt(body, prices)
        long_context = prices.long_context if (
            prices.long_context is not None and prices.long_context.beta in betas) else None
        window = (prices.messages.context_window_tokens if long_context is None
                  else long_context.context_window_tokens)
        if prompt.tokens > window:
            raise invalid(f"prompt is too long: {prompt.tokens} tokens > {window} maximum")
        if prompt.tokens + params.max_tokens > window:
            raise invalid(f"input length and `max_tokens` exceed context limit: {prompt.tokens} "
                          f"+ {params.max_tokens} > {window}, decrease input length or "
                          "`max_tokens` and try again")
        tools = prompt.tools
        if params.thinking_budget is not None and tools.forced is not None:
            raise invalid("Thinking may not be enabled when tool_choice forces tool use.")
        if fault.cached_tokens is not None:
            cache = CacheUse(read_tokens=min(fault.cached_tokens, prompt.tokens))
        elif not self.app.settings.prompt_cache:
            cache = CacheUse()
        else:
            cache = self.cache.use(prices, prompt, self.app.now_s())
        return self._reply(body, request, fault, prices, params, prompt, cache, long_context)

    def _reply(self, body: dict[str, Any], request: Request, fault: Fault, prices: ModelPrices,
               params: Params, prompt: MessagesPrompt, cache: CacheUse,
               long_context: LongContext | None) -> Reply:
        cap, tools = params.max_tokens, prompt.tools
        forced = header_count(request, "x-stub-output-tokens", 1)
        forced_thinking = header_count(request, "x-stub-reasoning-tokens", 0)
        total = 0 if cap == 0 else min(cap, forced or self.app.draw_output_tokens())
        thinking = 0
        if params.thinking_budget is not None:
            thinking = (min(total, forced_thinking) if forced_thinking is not None
                        else min(math.floor(total * THINKING_SHARE), params.thinking_budget))
        elif forced_thinking is not None:
            raise invalid("X-Stub-Reasoning-Tokens: thinking is not enabled")
        tool = tools.forced
        if request.headers.get("x-stub-tool-call") == "1":
            if not tools.client or tools.choice.kind == "none":
                raise invalid("X-Stub-Tool-Call: the call has no client tool it may call")
            tool = tool or tools.client[0]
        searches = self._searches(tools, fault, tool)
        visible = words(total - thinking)
        tool_call = None
        stop: str | None = None
        if tool is not None and tool != "web_search":
            text, generated = " ".join(visible), len(visible)
            tool_call = ("toolu_" + secrets.token_hex(12), tool)
        else:
            text, generated, stop = _stopped(visible, params.stop_sequences)
        output = thinking + generated
        stop_reason = ("stop_sequence" if stop is not None else "max_tokens" if output == cap
                       else "tool_use" if tool_call is not None else "end_turn")
        search_tokens = sum(search_result_tokens(list(s.results)) for s in searches
                            if s.results is not None)
        usage = Usage(
            input_tokens=prompt.tokens + search_tokens, cached_input_tokens=cache.read_tokens,
            cache_write_tokens=cache.write_5m_tokens + cache.write_1h_tokens,
            cache_write_1h_tokens=cache.write_1h_tokens, image_input_tokens=prompt.image_tokens,
            file_input_tokens=prompt.file_tokens, output_tokens=output, reasoning_tokens=thinking,
            web_search_requests=sum(s.results is not None for s in searches),
        )
        tier = TIER_STANDARD
        if long_context is not None and usage.input_tokens > long_context.above_input_tokens:
            tier = TIER_LONG_CONTEXT
        summary = tuple(THINKING_WORDS[i % len(THINKING_WORDS)]
                        for i in range(math.ceil(thinking / THINKING_TOKENS_PER_SUMMARY_WORD)))
        return Reply(
            model=str(body["model"]), usage=usage, cost_micros=cost_micros(prices, tier, usage),
            service_tier="standard" if tier == TIER_STANDARD else tier,
            message_id="msg_" + secrets.token_hex(12),
            thinking=" ".join(summary) if params.thinking_budget is not None else None,
            signature="stub-signature-" + secrets.token_hex(16), searches=tuple(searches),
            text=text, tool_call=tool_call, stop_reason=stop_reason, stop_sequence=stop,
            search_tokens=search_tokens, server_tools=tools.web_search, prices=prices,
            prompt=prompt, cache=cache,
        )

    def _searches(self, tools: Tools, fault: Fault, tool: str | None) -> list[Search]:
        """The web searches the model runs: asked for, or one when the tool is forced; none
        without the tool or under tool_choice none."""
        if not tools.web_search or tools.choice.kind == "none":
            return []
        asked = fault.web_searches if fault.web_searches is not None else int(
            tool == "web_search")
        limit = tools.web_search_max_uses
        run = asked if limit is None else min(asked, limit)
        searches = []
        for i in range(asked if asked == run else run + 1):
            tool_use_id = "srvtoolu_" + secrets.token_hex(12)
            results = self._results(tool_use_id) if i < run else None
            searches.append(Search(tool_use_id, f"stub search {i + 1}", results))
        return searches

    def _results(self, tool_use_id: str) -> tuple[dict[str, Any], ...]:
        """One result, its encrypted content padded so that it counts to exactly the setting."""
        url = f"https://search.stub.invalid/{tool_use_id}"
        title = "stub search result"
        pad = 4 * self.app.settings.web_search_result_tokens - len(url) - len(title)
        return ({"type": "web_search_result", "url": url, "title": title,
                 "encrypted_content": "E" * pad, "page_age": None},)

    def charged(self, decided: Reply, fault: Fault) -> None:
        if self.app.settings.prompt_cache and fault.cached_tokens is None:
            self.cache.store(decided.prices, decided.prompt, decided.cache, self.app.now_s())

    # -- the wire --------------------------------------------------------------------------------

    def body(self, decided: Reply) -> dict[str, Any]:
        return {
            "id": decided.message_id,
            "type": "message",
            "role": "assistant",
            "model": decided.model,
            "content": _content(decided),
            "stop_reason": decided.stop_reason,
            "stop_sequence": decided.stop_sequence,
            "usage": _usage(decided),
        }

    def events(self, decided: Reply, fault: Fault) -> list[bytes]:
        """Every SSE event of a message stream, message_stop last."""
        events = self._start(decided)
        for index, block in enumerate(_content(decided)):
            events += _block_events(index, block)
        final = _usage(decided)
        delta_usage = {k: final[k] for k in ("output_tokens", "input_tokens",
                                             "cache_creation_input_tokens",
                                             "cache_read_input_tokens", "server_tool_use",
                                             "output_tokens_details") if k in final}
        events.append(_event({"type": "message_delta",
                              "delta": {"stop_reason": decided.stop_reason,
                                        "stop_sequence": decided.stop_sequence},
                              "usage": delta_usage}))
        events.append(_event({"type": "message_stop"}))
        return events

    def failed_events(self, decided: Reply, failure: ApiError) -> list[bytes]:
        """A stream already answered 200 reports a failure with an `error` event."""
        return [*self._start(decided), _event({"type": "error", "error": {
            "type": _error_type(failure.status), "message": failure.message}})]

    def _start(self, decided: Reply) -> list[bytes]:
        """message_start (with the input usage) and a ping, the way every stream opens."""
        message = {**self.body(decided), "content": [], "stop_reason": None,
                   "stop_sequence": None, "usage": _usage(decided, final=False)}
        return [_event({"type": "message_start", "message": message}), _event({"type": "ping"})]


def _error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def _usage(reply: Reply, *, final: bool = True) -> dict[str, Any]:
    """`usage` of the message, as Anthropic reports it: `input_tokens` is only the input neither
    read from nor written to the cache; `final` False: as message_start reports it."""
    u = reply.usage
    uncached = u.input_tokens - u.cached_input_tokens - u.cache_write_tokens
    doc: dict[str, Any] = {
        "input_tokens": uncached if final else uncached - reply.search_tokens,
        "cache_creation_input_tokens": u.cache_write_tokens,
        "cache_read_input_tokens": u.cached_input_tokens,
        "cache_creation": {
            "ephemeral_5m_input_tokens": u.cache_write_tokens - u.cache_write_1h_tokens,
            "ephemeral_1h_input_tokens": u.cache_write_1h_tokens,
        },
        # message_start shows the first output token; message_delta the total.
        "output_tokens": u.output_tokens if final else min(1, u.output_tokens),
        "service_tier": "standard",
    }
    if reply.server_tools:
        doc["server_tool_use"] = {"web_search_requests": u.web_search_requests if final else 0,
                                  "web_fetch_requests": 0}
    if reply.thinking is not None:
        doc["output_tokens_details"] = {"thinking_tokens": u.reasoning_tokens if final else 0}
    return doc


def _content(reply: Reply) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if reply.thinking is not None:
        blocks.append({"type": "thinking", "thinking": reply.thinking,
                       "signature": reply.signature})
    for search in reply.searches:
        content: Any = (list(search.results) if search.results is not None else
                        {"type": "web_search_tool_result_error",
                         "error_code": "max_uses_exceeded"})
        blocks += [{"type": "server_tool_use", "id": search.tool_use_id, "name": "web_search",
                    "input": {"query": search.query}},
                   {"type": "web_search_tool_result", "tool_use_id": search.tool_use_id,
                    "content": content}]
    if reply.tool_call is not None:
        call_id, name = reply.tool_call
        blocks.append({"type": "tool_use", "id": call_id, "name": name,
                       "input": {"text": reply.text}})
    elif reply.text:
        blocks.append({"type": "text", "text": reply.text, "citations": None})
    return blocks


def _event(doc: dict[str, Any]) -> bytes:
    return sse(doc, str(doc["type"]))


def _text_deltas(text: str, delta_type: str, key: str) -> list[dict[str, Any]]:
    return [{"type": delta_type, key: piece}
            for piece in pieces(tuple(text.split(" ")) if text else ())]


def _block_events(index: int, block: dict[str, Any]) -> list[bytes]:
    """content_block_start, its deltas, content_block_stop: the block built up as streamed."""
    kind = block["type"]
    deltas: list[dict[str, Any]] = []
    start = block
    if kind == "text":
        start = {"type": "text", "text": ""}
        deltas = _text_deltas(block["text"], "text_delta", "text")
    elif kind == "thinking":
        start = {"type": "thinking", "thinking": "", "signature": ""}
        deltas = [*_text_deltas(block["thinking"], "thinking_delta", "thinking"),
                  {"type": "signature_delta", "signature": block["signature"]}]
    elif kind in ("tool_use", "server_tool_use"):
        start = {**block, "input": {}}
        arguments = json.dumps(block["input"], separators=(",", ":"))
        deltas = [{"type": "input_json_delta", "partial_json": arguments[at:at + JSON_CHUNK_CHARS]}
                  for at in range(0, len(arguments), JSON_CHUNK_CHARS)]
    # A web_search_tool_result arrives whole in its content_block_start.
    return [_event({"type": "content_block_start", "index": index, "content_block": start}),
            *(_event({"type": "content_block_delta", "index": index, "delta": delta})
              for delta in deltas),
            _event({"type": "content_block_stop", "index": index})]
