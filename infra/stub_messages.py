"""Anthropic's Messages API on the stub provider: the witness for a gateway's POST /v1/messages.

  POST /v1/messages               streaming (message_start ... message_stop) and not.
  POST /v1/messages/count_tokens  the input a call would bill, uncached; free, never billed.

Both take the key by `x-api-key` or `Authorization: Bearer` (checked when the stub has one),
require `anthropic-version` (a YYYY-MM-DD date: the SDK sends its own), read `anthropic-beta`
(`context-1m-2025-08-07` opens a long-context model's 1M window at its long-context rates;
`interleaved-thinking-2025-05-14` lets `thinking.budget_tokens` exceed `max_tokens`; any other
beta name is accepted and changes nothing, as none changes the price: the features they open are
served whether or not the header names them), refuse a
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
  with `keeps_thinking` keeps every turn's (a clear_thinking edit says otherwise, below). A kept
  block is billed as the whole thinking its signature carries (the stub's signatures say how
  many tokens; the text shown is a summary, or empty under `display: omitted`), or by its text
  where that is more (signatures are not checked: a forged block is billed too).
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

What real clients send (Claude Code 2.1, the SDKs; tests/infra/test_stub_messages_clients.py):
- `thinking` enabled (budget_tokens), adaptive (no budget: the effort's share of max_tokens) or
  disabled, with `display` (omitted: the thinking text is empty, its signature still carries
  it); `output_config.effort` (or a system message's, per turn) sets the share spent thinking.
- `output_config.format` (or the older top-level `output_format`): a JSON schema the answer's
  text is a minimal valid instance of, billed as the JSON written; its prompt is billed as the
  schema's JSON (Anthropic documents that structured outputs add a system prompt, not its size).
  A tool whose schema has properties is called with a minimal instance of it.
- Tool fields `strict`, `defer_loading` (a deferred tool bills nothing until a `tool_reference`
  in a tool result loads it: then its definition, where the reference stands),
  `eager_input_streaming`, `input_examples`, `allowed_callers`.
- Web fetch (`web_fetch_20250910` and later): `X-Stub-Web-Fetches: N` pages fetched (one when
  the tool is forced, none otherwise), at most `max_uses` (the rest answered max_uses_exceeded,
  unbilled); no fee (https://platform.claude.com/docs/en/agents-and-tools/tool-use/
  web-fetch-tool), each page billed as input: `max_content_tokens`, or the setting
  `web_search_result_tokens` without it; a page sent back counts its URL and text.
- Messages with role `system` (text, tool additions and removals; `clear_at:
  next_user_message` stops billing one once a user message follows), `compaction` blocks.
- `metadata.user_id` of any length.
- `speed: fast` (Claude Code's /fast): billed at the model's `fast` tier in the price table (2x
  every rate on Opus 5.5); refused on a model without one.
- `context_management` (https://platform.claude.com/docs/en/build-with-claude/context-editing):
  clear_thinking_20251015 keeps the thinking of the last `keep` assistant turns (from the last
  user message that is more than tool results on); clear_tool_uses_20250919, once its trigger is
  passed (input tokens, default 100,000, or tool uses), replaces the results of every tool use
  but the last `keep` (default 3) and those of `exclude_tools` with a placeholder, their inputs
  too under `clear_tool_inputs`, unless that clears fewer than `clear_at_least` tokens. Cleared
  content is not billed; the answer lists each edit that cleared anything in
  `context_management.applied_edits` (in message_delta when streamed).
- Compaction (compact_20260112, https://platform.claude.com/docs/en/build-with-claude/
  compaction): input above the trigger (default 150,000, at least 50,000) is summarized by a
  sampling step of its own, billed: it reads the whole input and its instructions (the stub's
  COMPACTION_PROMPT_TOKENS_DEFAULT when none are given) and writes COMPACTION_SUMMARY_TOKENS.
  The answer starts with the `compaction` block and reads tools, system and the summary; usage
  reports both steps in `iterations`, the top-level fields the answer's own, as Anthropic does.
  `pause_after_compaction` answers the block alone (stop_reason `compaction`). A compaction
  block sent back drops everything before it, unbilled.
- count_tokens takes all of it and answers the input after context editing (compaction, a
  sampling step, it does not run), with
  `context_management.original_input_tokens` before it.

/billing's log says per call, in `beyond_body`, what it billed or cleared beyond what the body
holds: cleared_tool_input_tokens, cleared_thinking_input_tokens, compaction_input_tokens and
compaction_output_tokens, compaction_dropped_input_tokens, signed_thinking_input_tokens (thinking
read from signatures beyond the text sent), loaded_tool_input_tokens, web_search_result_tokens,
web_fetch_content_tokens, output_format_prompt_tokens.

Scripted tool calls (/control's `tool_calls`, infra.stub_faults): the next call whose client
tools include a queued call's name answers with that call (thinking first, if on) and takes it off
the queue; a call after it (the tool result sent) answers text, unless another is queued.

Faults as on the OpenAI routes (infra.stub_provider), but for fail_after_billing on a stream:
it answers 200, message_start and an `error` event for the status, and no message_stop.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field, replace
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
# A thinking block's signature: this prefix, the thinking tokens billed, and a random tail. Real
# signatures carry the full thinking encrypted, which the model reads when the block is sent back.
SIGNATURE_PREFIX = "stub-signature-"
SIGNED_TOKENS_DIGITS_MAX = 9  # more than any output cap
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
                    "service_tier", "cache_control", "context_management", "output_config",
                    "output_format", "speed"})
COUNT_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking",
                          "cache_control", "context_management", "output_config",
                          "output_format"})
FIELDS_NOT_SERVED = frozenset({"container", "mcp_servers", "inference_geo",
                               "diagnostics", "user_profile_id", "workspace_id"})
SERVICE_TIERS = ("auto", "standard_only")
# `speed: fast`, and the price table's tier of a model's fast-mode rates.
SPEED_FAST = "fast"
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
# Web fetch (https://platform.claude.com/docs/en/agents-and-tools/tool-use/web-fetch-tool): no
# fee beyond the tokens of what it fetches.
WEB_FETCH_TOOLS = frozenset({"web_fetch_20250910", "web_fetch_20260209", "web_fetch_20260309",
                             "web_fetch_20260318"})
# Keys a client tool definition may have (the fields the SDKs and Claude Code send; the
# advanced-tool-use beta's `defer_loading`, `input_examples` and `allowed_callers`, fine-grained
# streaming's `eager_input_streaming`); the others are server or Anthropic-defined tools.
CLIENT_TOOL_KEYS = frozenset({"type", "name", "description", "input_schema", "cache_control",
                              "strict", "defer_loading", "eager_input_streaming",
                              "input_examples", "allowed_callers"})
SERVER_TOOL_KEYS = frozenset({"type", "name", "max_uses", "allowed_domains", "blocked_domains",
                              "cache_control", "defer_loading", "strict", "allowed_callers"})
WEB_SEARCH_KEYS = SERVER_TOOL_KEYS | {"user_location"}
WEB_FETCH_KEYS = SERVER_TOOL_KEYS | {"citations", "max_content_tokens", "url_sources"}
TOOL_CHOICES = ("auto", "any", "tool", "none")
USER_BLOCKS = frozenset({"text", "image", "document", "tool_result"})
ASSISTANT_BLOCKS = frozenset({"text", "thinking", "redacted_thinking", "tool_use",
                              "server_tool_use", "web_search_tool_result",
                              "web_fetch_tool_result", "compaction"})
# The server tools the stub runs itself (a call to one is never a client tool_use).
SERVER_TOOLS = ("web_search", "web_fetch")
# A mid-conversation system message (Claude Code sends one after the first user message):
# text, and the mid-conversation-tool-changes beta's tool additions and removals.
SYSTEM_BLOCKS = frozenset({"text", "tool_addition", "tool_removal"})
SYSTEM_MESSAGE_KEYS = frozenset({"role", "content", "clear_at", "output_config"})
CLEAR_ATS = ("next_user_message", "never")
ROLES = ("user", "assistant", "system")
# Effort (https://platform.claude.com/docs/en/build-with-claude/effort) and the share of an
# answer spent thinking at each: the stub's own shares, since Anthropic documents only that
# more effort spends more tokens. No effort: THINKING_SHARE.
EFFORT_THINKING_SHARES = {"low": Fraction(1, 4), "medium": Fraction(1, 2),
                          "high": Fraction(3, 4), "xhigh": Fraction(3, 4),
                          "max": Fraction(7, 8)}
THINKING_DISPLAYS = ("summarized", "omitted", "updates")
# Context editing (https://platform.claude.com/docs/en/build-with-claude/context-editing) and
# compaction (https://platform.claude.com/docs/en/build-with-claude/compaction): the edits and
# their documented defaults.
EDIT_CLEAR_TOOL_USES = "clear_tool_uses_20250919"
EDIT_CLEAR_THINKING = "clear_thinking_20251015"
EDIT_COMPACT = "compact_20260112"
CLEAR_TOOL_USES_TRIGGER_TOKENS_DEFAULT = 100_000
CLEAR_TOOL_USES_KEEP_DEFAULT = 3
CLEAR_THINKING_TURNS_KEEP_DEFAULT = 1
COMPACT_TRIGGER_TOKENS_DEFAULT = 150_000
COMPACT_TRIGGER_TOKENS_MIN = 50_000
# `keep: "all"` of clear_thinking: more turns than any request holds.
THINKING_TURNS_ALL = 2**31
# The text a cleared tool result (or input) is replaced by: Anthropic documents a placeholder
# but not its words, so the stub's own, billed as text.
CLEARED_PLACEHOLDER = "[cleared by context management]"
# Compaction's summarizing step: its prompt when `instructions` are not given, and the summary it
# writes, in tokens. Anthropic documents neither size; the stub's own, both reported in /billing.
COMPACTION_PROMPT_TOKENS_DEFAULT = 200
COMPACTION_SUMMARY_TOKENS = 1_000
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
    web_fetch: bool = False
    web_fetch_max_uses: int | None = None  # None: no limit given
    web_fetch_max_content_tokens: int | None = None
    choice: ToolChoice = ToolChoice("auto")
    schemas: dict[str, dict[str, Any]] = field(default_factory=dict)  # client tools' input
    # Tools with defer_loading, not in the prompt until referenced: their definitions' tokens.
    deferred_tokens: dict[str, int] = field(default_factory=dict)

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
    format_tokens: int = 0  # the structured output format's prompt
    signed_thinking_tokens: int = 0  # thinking read from signatures beyond the text shown
    loaded_tool_tokens: int = 0  # deferred tools' definitions tool_reference blocks loaded
    cleared_thinking_tokens: int = 0  # thinking a clear_thinking edit took out
    cleared_thinking_turns: int = 0


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
        self.cleared_thinking_tokens = 0  # thinking a clear_thinking edit took out
        self.cleared_thinking_turns: set[int] = set()

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
        # `scope` (Claude Code's prompt-caching-scope beta) says who may share the prefix; it
        # changes no price, so the stub takes any and caches as without it.
        if not isinstance(control, dict) or control.get("type") != "ephemeral" or (
            set(control) - {"type", "ttl", "scope"}
        ) or not isinstance(control.get("scope", ""), str):
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
            elif kind == "tool_reference":
                # Tool search (advanced-tool-use beta): a reference loads a deferred tool, whose
                # whole definition the prompt then holds.
                name = part.get("tool_name")
                if name not in self.prompt.tools.deferred_tokens:
                    raise InputError(f"tool_reference names no deferred tool: {name!r}", at)
                tokens += self.prompt.tools.deferred_tokens[str(name)]
                self.prompt.loaded_tool_tokens += self.prompt.tools.deferred_tokens[str(name)]
            else:
                tokens += sum(self.document(part.get("source"), at))
        return tokens


def messages_prompt(body: dict[str, Any], model: ModelPrices, registry: Registry, *,
                    messages: object = None, thinking_turns_kept: int | None = None,
                    output_schema: dict[str, Any] | None = None) -> MessagesPrompt:
    """Count `body` (already checked to be an object with a Messages API model), with
    `messages` in place of its own when given (context management's edited copy)."""
    counter = MessagesCounter(model, registry)
    counter.prompt.tools = _tools(counter, body.get("tools"), body.get("tool_choice"))
    _system(counter, body.get("system"))
    if output_schema is not None:
        # Structured outputs add a system prompt that explains the format; Anthropic documents
        # it but not its size, so the stub bills the schema itself, as a tool definition is.
        size = len(json.dumps(output_schema, separators=(",", ":"), ensure_ascii=False).encode())
        counter.block({"type": "output_format", "schema": output_schema}, text_tokens(size),
                      "output_config.format", cacheable=False)
        counter.prompt.format_tokens = text_tokens(size)
    # Changing tool_choice or thinking invalidates the cached messages but not tools and system.
    counter.marker({"tool_choice": body.get("tool_choice"), "thinking": body.get("thinking")})
    _messages(counter, body.get("messages") if messages is None else messages,
              thinking_turns_kept)
    if body.get("cache_control") is not None:
        counter.last_cacheable(body["cache_control"])
    counter.check_many_images()
    counter.prompt.tokens += TOKENS_PER_REPLY
    counter.prompt.cleared_thinking_tokens = counter.cleared_thinking_tokens
    counter.prompt.cleared_thinking_turns = len(counter.cleared_thinking_turns)
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
            given.schemas[name] = schema
        elif kind == WEB_SEARCH_TOOL:
            _web_search(counter, tool, given, where)
        elif kind in WEB_FETCH_TOOLS:
            _web_fetch(tool, given, where)
        else:
            raise InputError(f"tool type {kind!r} is not served by the stub", where)
        size = len(json.dumps({k: v for k, v in tool.items() if k != "cache_control"},
                              separators=(",", ":"), ensure_ascii=False).encode())
        if tool.get("defer_loading") is True:
            # Not in the prompt until a tool search loads it (advanced-tool-use beta): then a
            # tool_reference block brings its definition in, billed where it stands.
            given.deferred_tokens[name] = text_tokens(size)
            continue
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


def _web_fetch(tool: dict[str, Any], given: Tools, where: str) -> None:
    if set(tool) - WEB_FETCH_KEYS or tool.get("name") != "web_fetch":
        raise InputError(f"{where}: a web fetch tool is named web_fetch and takes max_uses, "
                         "allowed_domains, blocked_domains, citations and max_content_tokens",
                         where)
    max_uses = tool.get("max_uses")
    if max_uses is not None and (type(max_uses) is not int or max_uses < 1):
        raise InputError("max_uses must be a positive integer", where)
    content_max = tool.get("max_content_tokens")
    if content_max is not None and (type(content_max) is not int or content_max < 1):
        raise InputError("max_content_tokens must be a positive integer", where)
    given.web_fetch, given.web_fetch_max_uses = True, max_uses
    given.web_fetch_max_content_tokens = content_max


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


def _messages(counter: MessagesCounter, messages: object, thinking_turns_kept: int | None) -> None:
    """Count the messages. `thinking_turns_kept`: a clear_thinking edit's `keep`, the assistant
    turns (from the last) whose thinking stays; None: the API's own rule (below)."""
    if not isinstance(messages, list) or not messages:
        raise InputError("messages: at least one message is required", "messages")
    model = counter.model.messages
    assert model is not None  # checked by MessagesCounter
    # A turn starts at each user message that is more than tool results. Without an edit, the
    # thinking of the turn still in progress (after the last such message) is kept, and of the
    # others only on a model that keeps thinking; with one, that of the last turns it keeps.
    turn_of: list[int] = []
    turns = 0
    for message in messages:
        if isinstance(message, dict) and message.get("role") == "user" and not _only_tool_results(
            message.get("content")
        ):
            turns += 1
        turn_of.append(turns)
    assistant_turns = sorted({turn_of[i] for i, m in enumerate(messages)
                              if isinstance(m, dict) and m.get("role") == "assistant"})
    last_user = max((i for i, m in enumerate(messages)
                     if isinstance(m, dict) and m.get("role") == "user"), default=-1)
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        counter.count_part(where)
        if not isinstance(message, dict) or set(message) - (
                SYSTEM_MESSAGE_KEYS if message.get("role") == "system" else {"role", "content"}):
            raise InputError("a message is {role, content}", where)
        role = message.get("role")
        if role not in ROLES:
            raise InputError(f"role must be one of {', '.join(ROLES)}", where)
        content = message.get("content")
        if role == "system":
            clear_at = message.get("clear_at")
            if clear_at not in (None, *CLEAR_ATS):
                raise InputError(f"clear_at is one of {', '.join(CLEAR_ATS)}", where)
            if content is None and message.get("output_config") is None:
                raise InputError("a system message needs content or output_config", where)
            # Shown to the model only until the next user message, then not read nor billed.
            if content is None or (clear_at == "next_user_message" and last_user > i):
                continue
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
        keeps_thinking = model.keeps_thinking or turn_of[i] == turns
        cleared = False  # the edit takes out thinking the API's own rule keeps
        if thinking_turns_kept is not None:
            from_last = (len(assistant_turns) - 1 - assistant_turns.index(turn_of[i])
                         if turn_of[i] in assistant_turns else 0)
            cleared = keeps_thinking and from_last >= thinking_turns_kept
            keeps_thinking = from_last < thinking_turns_kept
        for j, part in enumerate(blocks):
            _block(counter, part, f"{where}.content[{j}]", str(role), keeps_thinking,
                   turn_of[i] if cleared else None)


def _only_tool_results(content: object) -> bool:
    return isinstance(content, list) and bool(content) and all(
        isinstance(b, dict) and b.get("type") == "tool_result" for b in content)


def _block(counter: MessagesCounter, part: object, where: str, role: str,
           keeps_thinking: bool, clearing_turn: int | None) -> None:
    """Count one block. `clearing_turn`: its turn, when a clear_thinking edit takes out
    thinking the API would otherwise keep (counted as cleared)."""
    if not isinstance(part, dict):
        raise InputError("a content block must be an object", where)
    kind = part.get("type")
    allowed = (USER_BLOCKS if role == "user" else ASSISTANT_BLOCKS if role == "assistant"
               else SYSTEM_BLOCKS)
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
                  else counter.nested(content, f"{where}.content",
                                      ("text", "image", "document", "tool_reference")))
    elif kind in ("thinking", "redacted_thinking"):
        cacheable = False  # Anthropic: thinking blocks cannot carry cache_control
        text_key = "thinking" if kind == "thinking" else "data"
        text_bytes = _text(part.get(text_key), where)
        if kind == "thinking" and not isinstance(part.get("signature"), str):
            raise InputError("a thinking block needs its signature", where)
        # The model reads the whole thinking its signature carries, whatever text is shown (a
        # summary, or nothing under `display: omitted`): the stub's own signatures say how
        # much; text beyond that (or a signature not the stub's) is billed as sent.
        read = max(text_tokens(text_bytes), signed_thinking_tokens(part.get("signature")))
        tokens = read if keeps_thinking else 0
        if keeps_thinking:
            counter.prompt.signed_thinking_tokens += read - text_tokens(text_bytes)
        if clearing_turn is not None:
            counter.cleared_thinking_tokens += read
            counter.cleared_thinking_turns.add(clearing_turn)
    elif kind in ("tool_addition", "tool_removal"):
        # A tool added mid-conversation is a definition in the prompt; a removal only says so.
        if not isinstance(part.get("tool"), dict):
            raise InputError(f"a {kind} block needs a tool", where)
        size = len(json.dumps(part["tool"], separators=(",", ":"), ensure_ascii=False).encode())
        tokens = text_tokens(size) if kind == "tool_addition" else 0
    elif kind == "compaction":
        # A compaction block sent back: its summary is the context (what came before it was
        # dropped before counting); a failed compaction (content null) is nothing.
        summary = part.get("content")
        if summary is not None and not isinstance(summary, str):
            raise InputError("a compaction block's content is a string or null", where)
        tokens = text_tokens(len(summary.encode())) if summary else 0
    elif kind == "web_fetch_tool_result":
        tokens = _fetch_tool_result_tokens(part, where)
    else:  # web_search_tool_result
        tokens = _search_result_tokens(part, where)
    counter.block(part, tokens, where, cacheable=cacheable)


def thinking_signature(thinking_tokens: int) -> str:
    """A thinking block's signature: opaque to a client, it carries the thinking billed."""
    return f"{SIGNATURE_PREFIX}{thinking_tokens}-{secrets.token_hex(16)}"


def signed_thinking_tokens(signature: object) -> int:
    """The thinking tokens a stub signature carries; 0 for any other."""
    if not isinstance(signature, str) or not signature.startswith(SIGNATURE_PREFIX):
        return 0
    count = signature[len(SIGNATURE_PREFIX):].split("-", 1)[0]
    return int(count) if count.isdigit() and len(count) <= SIGNED_TOKENS_DIGITS_MAX else 0


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


def _fetch_tool_result_tokens(part: dict[str, Any], where: str) -> int:
    if not isinstance(part.get("tool_use_id"), str):
        raise InputError("a web_fetch_tool_result needs a tool_use_id", where)
    content = part.get("content")
    if isinstance(content, dict) and content.get("type") == "web_fetch_tool_result_error":
        return 0
    if not isinstance(content, dict) or content.get("type") != "web_fetch_result":
        raise InputError("a web fetch result is a web_fetch_result", where)
    return fetch_result_tokens(content, where)


def fetch_result_tokens(result: dict[str, Any], where: str = "web_fetch") -> int:
    """The input tokens a fetched page costs, fed to the model or sent back: its URL and its
    text (a page that is not text is refused: the stub fetches only text)."""
    document = result.get("content")
    source = document.get("source") if isinstance(document, dict) else None
    if not isinstance(source, dict) or source.get("type") != "text":
        raise InputError("a fetched page is a text document", where)
    return text_tokens(_text(result.get("url"), where) + _text(source.get("data"), where))


def search_result_tokens(results: list[dict[str, Any]]) -> int:
    """The input tokens a list of web search results costs, sent back or fed to the model."""
    return _search_result_tokens({"tool_use_id": "", "content": results}, "web_search")


# -- context management --------------------------------------------------------------------------


@dataclass(frozen=True)
class ClearToolUses:
    """clear_tool_uses_20250919: once triggered (input tokens above, or tool uses more than,
    `trigger_value`), the results of every tool use but the last `keep` are replaced by a
    placeholder, oldest first, but for `exclude_tools`; their inputs too where `clear_inputs`
    says (True: all; a set: those tools'); nothing unless at least `clear_at_least_tokens` go."""

    trigger_tool_uses: bool
    trigger_value: int
    keep: int
    clear_at_least_tokens: int
    exclude_tools: frozenset[str]
    clear_inputs: bool | frozenset[str]


@dataclass(frozen=True)
class Compact:
    """compact_20260112: input above `trigger_tokens` is summarized first (a sampling step of its
    own, billed), and the answer continues from the summary, or stops there (`pause`)."""

    trigger_tokens: int
    instructions_tokens: int
    pause: bool


@dataclass(frozen=True)
class ContextEdits:
    thinking_turns_kept: int | None = None  # clear_thinking's keep; None: no such edit
    clear_tool_uses: ClearToolUses | None = None
    compact: Compact | None = None


def _count_value(doc: object, kinds: tuple[str, ...], where: str,
                 minimum: int = 0) -> tuple[str, int]:
    if (not isinstance(doc, dict) or set(doc) != {"type", "value"} or doc["type"] not in kinds
            or type(doc["value"]) is not int or doc["value"] < minimum):
        raise InputError(f'{where} is {{"type": {" or ".join(kinds)}, "value": an integer of at '
                         f"least {minimum}}}", where)
    return str(doc["type"]), int(doc["value"])


def context_edits(doc: object) -> ContextEdits:
    """The request's `context_management`, checked as Anthropic's API checks it."""
    if doc is None:
        return ContextEdits()
    if not isinstance(doc, dict) or set(doc) - {"edits"} or not isinstance(
            doc.get("edits", []), list):
        raise InputError("context_management is {edits: [...]}", "context_management")
    edits = ContextEdits()
    for i, edit in enumerate(doc.get("edits", [])):
        where = f"context_management.edits[{i}]"
        kind = edit.get("type") if isinstance(edit, dict) else None
        if not isinstance(edit, dict) or kind not in (EDIT_CLEAR_TOOL_USES, EDIT_CLEAR_THINKING,
                                                      EDIT_COMPACT):
            raise InputError(f"{where}.type is one of {EDIT_CLEAR_TOOL_USES}, "
                             f"{EDIT_CLEAR_THINKING} and {EDIT_COMPACT}", where)
        if kind == EDIT_CLEAR_THINKING:
            # The docs: when strategies are combined, clear_thinking comes first.
            if i != 0 or set(edit) - {"type", "keep"}:
                raise InputError(f"{where}: {EDIT_CLEAR_THINKING} takes keep and must be the "
                                 "first edit", where)
            keep = edit.get("keep", {"type": "thinking_turns",
                                     "value": CLEAR_THINKING_TURNS_KEEP_DEFAULT})
            if keep == "all" or keep == {"type": "all"}:
                kept = THINKING_TURNS_ALL
            else:
                kept = _count_value(keep, ("thinking_turns",), f"{where}.keep", 1)[1]
            edits = replace(edits, thinking_turns_kept=kept)
        elif kind == EDIT_CLEAR_TOOL_USES:
            if set(edit) - {"type", "trigger", "keep", "clear_at_least", "exclude_tools",
                            "clear_tool_inputs"}:
                raise InputError(f"{where}: Extra inputs are not permitted", where)
            trigger = edit.get("trigger") or {"type": "input_tokens",
                                              "value": CLEAR_TOOL_USES_TRIGGER_TOKENS_DEFAULT}
            trigger_kind, trigger_value = _count_value(
                trigger, ("input_tokens", "tool_uses"), f"{where}.trigger", 1)
            keep_value = _count_value(edit.get("keep") or {
                "type": "tool_uses", "value": CLEAR_TOOL_USES_KEEP_DEFAULT},
                ("tool_uses",), f"{where}.keep")[1]
            at_least = (0 if edit.get("clear_at_least") is None else _count_value(
                edit["clear_at_least"], ("input_tokens",), f"{where}.clear_at_least")[1])
            exclude = edit.get("exclude_tools") or []
            inputs = edit.get("clear_tool_inputs") or False
            if not isinstance(exclude, list) or not all(isinstance(n, str) for n in exclude):
                raise InputError(f"{where}.exclude_tools is a list of tool names", where)
            if not (inputs is True or inputs is False or (
                    isinstance(inputs, list) and all(isinstance(n, str) for n in inputs))):
                raise InputError(f"{where}.clear_tool_inputs is a boolean or a list of tool "
                                 "names", where)
            edits = replace(edits, clear_tool_uses=ClearToolUses(
                trigger_kind == "tool_uses", trigger_value, keep_value, at_least,
                frozenset(exclude), inputs if isinstance(inputs, bool) else frozenset(inputs)))
        else:
            if set(edit) - {"type", "trigger", "pause_after_compaction", "instructions"}:
                raise InputError(f"{where}: Extra inputs are not permitted", where)
            trigger_tokens = (COMPACT_TRIGGER_TOKENS_DEFAULT if edit.get("trigger") is None
                              else _count_value(edit["trigger"], ("input_tokens",),
                                                f"{where}.trigger",
                                                COMPACT_TRIGGER_TOKENS_MIN)[1])
            instructions = edit.get("instructions")
            if instructions is not None and not isinstance(instructions, str):
                raise InputError(f"{where}.instructions is a string", where)
            pause = edit.get("pause_after_compaction", False)
            if type(pause) is not bool:
                raise InputError(f"{where}.pause_after_compaction is a boolean", where)
            edits = replace(edits, compact=Compact(
                trigger_tokens, COMPACTION_PROMPT_TOKENS_DEFAULT if instructions is None
                else text_tokens(len(instructions.encode())), pause))
    return edits


@dataclass
class Managed:
    """A request's input once context management has run: the `prompt` the answer reads, what
    the edits cleared (`applied_edits`, as the answer reports them), the compaction step's
    tokens, and `beyond_body`: what was billed or cleared beyond the body, for /billing."""

    prompt: MessagesPrompt
    original_input_tokens: int
    applied_edits: list[dict[str, Any]] = field(default_factory=list)
    compaction_input_tokens: int = 0
    compaction_output_tokens: int = 0
    compaction_summary: str | None = None  # the summary a compaction in this call wrote
    pause: bool = False
    beyond_body: dict[str, int] = field(default_factory=dict)


def _after_compaction(messages: object) -> tuple[object, bool]:
    """The messages from the last compaction block on: the API drops what precedes it."""
    if not isinstance(messages, list):
        return messages, False
    for i in range(len(messages) - 1, -1, -1):
        message = messages[i]
        if not isinstance(message, dict) or message.get("role") != "assistant":
            continue
        content = message.get("content")
        if isinstance(content, list):
            for j in range(len(content) - 1, -1, -1):
                block = content[j]
                if isinstance(block, dict) and block.get("type") == "compaction":
                    if i == 0 and j == 0:
                        return messages, False
                    return [{**message, "content": content[j:]}, *messages[i + 1:]], True
    return messages, False


def _tool_uses(messages: list[Any]) -> list[tuple[str, str]]:
    """(id, name) of every tool_use block in the assistant messages, in order."""
    uses = []
    for message in messages:
        if isinstance(message, dict) and message.get("role") == "assistant" and isinstance(
                message.get("content"), list):
            uses += [(str(b.get("id")), str(b.get("name"))) for b in message["content"]
                     if isinstance(b, dict) and b.get("type") == "tool_use"]
    return uses


def _cleared(messages: list[Any], ids: set[str], inputs: bool | frozenset[str],
             names: dict[str, str]) -> list[Any]:
    """A copy of `messages` with the results (and inputs, as `inputs` says) of the tool uses
    `ids` replaced by the placeholder."""
    edited = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            edited.append(message)
            continue
        blocks = []
        for block in content:
            if isinstance(block, dict) and block.get("type") == "tool_result" and block.get(
                    "tool_use_id") in ids:
                block = {**block, "content": CLEARED_PLACEHOLDER}
            elif isinstance(block, dict) and block.get("type") == "tool_use" and block.get(
                    "id") in ids and (inputs is True or (
                    isinstance(inputs, frozenset) and names.get(str(block["id"])) in inputs)):
                block = {**block, "input": {}}
            blocks.append(block)
        edited.append({**message, "content": blocks})
    return edited


def managed_prompt(body: dict[str, Any], model: ModelPrices, registry: Registry,
                   edits: ContextEdits, output_schema: dict[str, Any] | None) -> Managed:
    """Count the request as the model reads it: what precedes a compaction block sent back is
    dropped, then each edit runs in turn (thinking, tool uses, compaction)."""
    messages, dropped = _after_compaction(body.get("messages"))
    beyond: dict[str, int] = {}
    prompt = messages_prompt(body, model, registry, messages=messages,
                             output_schema=output_schema)
    if dropped:
        whole = messages_prompt(body, model, registry, output_schema=output_schema)
        beyond["compaction_dropped_input_tokens"] = whole.tokens - prompt.tokens
    managed = Managed(prompt, prompt.tokens, beyond_body=beyond)
    if output_schema is not None:
        beyond["output_format_prompt_tokens"] = prompt.format_tokens
    if edits.thinking_turns_kept is not None:
        prompt = messages_prompt(body, model, registry, messages=messages,
                                 thinking_turns_kept=edits.thinking_turns_kept,
                                 output_schema=output_schema)
        if prompt.cleared_thinking_turns:
            managed.applied_edits.append({
                "type": EDIT_CLEAR_THINKING,
                "cleared_thinking_turns": prompt.cleared_thinking_turns,
                "cleared_input_tokens": prompt.cleared_thinking_tokens})
            beyond["cleared_thinking_input_tokens"] = prompt.cleared_thinking_tokens
    rule = edits.clear_tool_uses
    if rule is not None and isinstance(messages, list):
        uses = _tool_uses(messages)
        triggered = (len(uses) > rule.trigger_value if rule.trigger_tool_uses
                     else prompt.tokens > rule.trigger_value)
        clear = [u for u in uses[:max(0, len(uses) - rule.keep)]
                 if u[1] not in rule.exclude_tools]
        if triggered and clear:
            edited = _cleared(messages, {i for i, _ in clear}, rule.clear_inputs, dict(uses))
            after = messages_prompt(body, model, registry, messages=edited,
                                    thinking_turns_kept=edits.thinking_turns_kept,
                                    output_schema=output_schema)
            cleared = prompt.tokens - after.tokens
            if cleared > 0 and cleared >= rule.clear_at_least_tokens:
                prompt, messages = after, edited
                managed.applied_edits.append({"type": EDIT_CLEAR_TOOL_USES,
                                              "cleared_tool_uses": len(clear),
                                              "cleared_input_tokens": cleared})
                beyond["cleared_tool_input_tokens"] = cleared
    # What the blocks sent carry beyond their text, read by the answer or by compaction.
    if prompt.signed_thinking_tokens:
        beyond["signed_thinking_input_tokens"] = prompt.signed_thinking_tokens
    if prompt.loaded_tool_tokens:
        beyond["loaded_tool_input_tokens"] = prompt.loaded_tool_tokens
    if edits.compact is not None and prompt.tokens > edits.compact.trigger_tokens:
        # The summarizing step reads the whole input and its instructions, and writes the
        # summary; the answer then reads tools, system and the summary.
        managed.compaction_input_tokens = prompt.tokens + edits.compact.instructions_tokens
        managed.compaction_output_tokens = COMPACTION_SUMMARY_TOKENS
        managed.compaction_summary = " ".join(words(COMPACTION_SUMMARY_TOKENS))
        managed.pause = edits.compact.pause
        prompt = messages_prompt(body, model, registry, messages=[{
            "role": "assistant", "content": [{"type": "compaction",
                                              "content": managed.compaction_summary}]}],
            output_schema=output_schema)
        beyond["compaction_input_tokens"] = managed.compaction_input_tokens
        beyond["compaction_output_tokens"] = managed.compaction_output_tokens
    managed.prompt = prompt
    return managed


# -- structured outputs -------------------------------------------------------------------------

# A value of each string format structured outputs allow
# (https://platform.claude.com/docs/en/build-with-claude/structured-outputs, "JSON Schema
# limitations"), valid under the format, so a client's own validation passes.
STRING_FORMATS = {"date-time": "2026-01-01T00:00:00Z", "date": "2026-01-01", "time": "00:00:00",
                  "duration": "PT1S", "email": "stub@example.com", "hostname": "example.com",
                  "uri": "https://example.com/", "ipv4": "127.0.0.1", "ipv6": "::1",
                  "uuid": "00000000-0000-4000-8000-000000000000"}
# Nesting deeper than this is a schema the stub cannot instance (a recursive $ref without end).
SCHEMA_DEPTH_MAX = 32


def schema_instance(schema: object, root: object = None, depth: int = 0) -> Any:
    """A minimal instance of a JSON schema in the subset structured outputs allow: objects with
    their required properties, empty arrays (or minItems items), "" (or minLength x's, or a
    format's sample), the minimum number, false, an enum's or anyOf's first, a const."""
    root = schema if root is None else root
    if depth > SCHEMA_DEPTH_MAX:
        raise InputError("the schema nests too deep to answer", "output_config.format")
    if not isinstance(schema, dict):
        return None
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target: Any = root
        for part in ref[2:].split("/"):
            target = target.get(part) if isinstance(target, dict) else None
        return schema_instance(target, root, depth + 1)
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return schema_instance(schema[key][0], root, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object" or (kind is None and "properties" in schema):
        properties = schema.get("properties") or {}
        required = schema.get("required") or []
        return {name: schema_instance(properties.get(name), root, depth + 1) for name in required
                if isinstance(name, str)}
    if kind == "array":
        count = schema.get("minItems") or 0
        return [schema_instance(schema.get("items"), root, depth + 1)
                for _ in range(count if isinstance(count, int) else 0)]
    if kind == "string":
        sample = STRING_FORMATS.get(str(schema.get("format")), "")
        length = schema.get("minLength")
        return sample if not isinstance(length, int) or len(sample) >= length else "x" * length
    if kind in ("number", "integer"):
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        value = low if isinstance(low, int | float) else 0
        if "exclusiveMinimum" in schema and "minimum" not in schema:
            value += 1
        return int(value) if kind == "integer" else value
    if kind == "boolean":
        return False
    return None


def _free_form(schema: dict[str, Any]) -> bool:
    """A tool input schema any object fits (the stub then answers {"text": ...})."""
    return not schema.get("properties") and not schema.get("required") and schema.get(
        "additionalProperties") is not False


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
    thinking_budget: int | None  # None: thinking is off; adaptive thinking: max_tokens
    stop_sequences: tuple[str, ...]
    thinking_shown: bool = True  # False: `display: omitted`, the thinking text left out
    thinking_share: Fraction = THINKING_SHARE  # by effort
    output_schema: dict[str, Any] | None = None  # structured outputs' format
    fast: bool = False  # `speed: fast`: billed at the model's fast tier


@dataclass(frozen=True)
class Search:
    """One server-side web search or fetch (`tool`): its results (a fetch's page), or None when
    max_uses refused it. `query` is the search's query or the fetched URL."""

    tool_use_id: str
    query: str
    results: tuple[dict[str, Any], ...] | None
    tool: str = "web_search"


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
    managed: Managed  # context management's edits and compaction
    tool_input: dict[str, Any] | None = None  # the tool call's input; None: {"text": text}


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
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    # between_tools (Sonnet 5.5's): adaptive thinking without the upfront part, served as
    # adaptive: the stub bills a share of the answer as thinking either way.
    if isinstance(thinking, dict) and kind in ("enabled", "adaptive", "between_tools"):
        if kind == "enabled" and ("budget_tokens" not in thinking or set(thinking) - {
                "type", "budget_tokens", "display"}):
            raise invalid("thinking: enabled thinking takes budget_tokens")
        if kind != "enabled" and set(thinking) - {"type", "display", "block_binding"}:
            raise invalid("thinking: adaptive thinking takes display")
        if thinking.get("display") not in (None, *THINKING_DISPLAYS):
            raise invalid(f"thinking.display: one of {', '.join(THINKING_DISPLAYS)}")
        if not prices.reasoning:
            raise invalid(f"thinking: not supported by {prices.name}")
        # Adaptive thinking spends what the effort asks, within max_tokens.
        budget = thinking.get("budget_tokens", max_tokens)
        if kind == "enabled" and (type(budget) is not int or budget < THINKING_BUDGET_TOKENS_MIN):
            raise invalid("thinking.enabled.budget_tokens: Input should be greater than or "
                          f"equal to {THINKING_BUDGET_TOKENS_MIN}")
        if (kind == "enabled" and budget >= max_tokens
                and INTERLEAVED_THINKING_BETA not in betas):
            raise invalid("`max_tokens` must be greater than `thinking.budget_tokens`")
    elif thinking is not None and thinking != {"type": "disabled"}:
        raise invalid('thinking: type is "enabled" (with budget_tokens), "adaptive", '
                      '"between_tools" or "disabled"')
    effort, schema = _output_config(body)
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
    # Fast mode (https://platform.claude.com/docs/en/build-with-claude/fast-mode): the same
    # model at a multiplier on every rate, served where the table prices it.
    speed = body.get("speed")
    if speed not in (None, "standard", SPEED_FAST):
        raise invalid('speed: "standard" or "fast"')
    if speed == SPEED_FAST and SPEED_FAST not in prices.tiers:
        raise invalid(f"speed: fast mode is not supported by {prices.name}")
    return Params(max_tokens, budget, tuple(stops), fast=speed == SPEED_FAST,
                  thinking_shown=not isinstance(thinking, dict) or thinking.get(
                      "display") != "omitted",
                  thinking_share=THINKING_SHARE if effort is None
                  else EFFORT_THINKING_SHARES[effort], output_schema=schema)


def _output_config(body: dict[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
    """(effort, format schema) of `output_config`, or of the older `output_format` (the
    structured-outputs-2025-11-13 beta's shape)."""
    config = body.get("output_config")
    if config is None:
        config = {}
    if not isinstance(config, dict) or set(config) - {"effort", "format", "task_budget"}:
        raise invalid("output_config: takes effort, format and task_budget")
    effort = config.get("effort")
    # A system message's output_config (per-turn-control beta) sets the effort from its turn on.
    for message in body.get("messages") or []:
        if isinstance(message, dict) and message.get("role") == "system" and isinstance(
                message.get("output_config"), dict) and "effort" in message["output_config"]:
            effort = message["output_config"]["effort"]
    if effort is not None and effort not in EFFORT_THINKING_SHARES:
        raise invalid(f"output_config.effort: one of {', '.join(EFFORT_THINKING_SHARES)}")
    given = config.get("format")
    if body.get("output_format") is not None:
        if given is not None:
            raise invalid("output_format and output_config.format: give one")
        given = body["output_format"]
    if given is None:
        return effort, None
    if (not isinstance(given, dict) or given.get("type") != "json_schema"
            or set(given) - {"type", "schema"} or not isinstance(given.get("schema"), dict)):
        raise invalid('output_config.format is {"type": "json_schema", "schema": {...}}')
    return effort, given["schema"]


def _bounded_json(value: Any, room_tokens: int) -> tuple[str, int]:
    """`value` as JSON text and its tokens, cut off at `room_tokens` (the cap's room) as a
    model's output is."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    tokens = max(1, text_tokens(len(text.encode())))
    if tokens <= room_tokens:
        return text, tokens
    return text.encode()[:4 * room_tokens].decode(errors="ignore"), room_tokens


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
        """The input tokens of a call, as it would bill them with nothing cached, after context
        editing (and the count before it, as `context_management.original_input_tokens`), before
        any compaction. Free."""
        self.app.bill.requests += 1
        headers = self.headers()
        model: str | None = None
        try:
            self.check(request)
            body = await read_body(request, REQUEST_BYTES_MAX)
            model = body.get("model") if isinstance(body.get("model"), str) else None
            managed = self.counted(body)
        except ApiError as exc:
            self.app.log(API_COUNT_TOKENS, model, exc.status, False, Fault())
            return self.error(exc, headers)
        self.app.log(API_COUNT_TOKENS, model, 200, False, Fault())
        answer: dict[str, Any] = {"input_tokens": managed.prompt.tokens}
        if body.get("context_management") is not None:
            answer["context_management"] = {
                "original_input_tokens": managed.original_input_tokens}
        return JSONResponse(answer, headers=headers)

    def counted(self, body: dict[str, Any], served: frozenset[str] = COUNT_FIELDS) -> Managed:
        """The input of a call whose fields are among `served`, as count_tokens counts it
        (Bedrock's CountTokens too, which takes a whole call's body). ApiError if refused."""
        prices = self._model(body)
        _check_fields(body, served)
        return self._managed(body, prices, _output_config(body)[1], compacts=False)

    def _model(self, body: dict[str, Any]) -> ModelPrices:
        name = body.get("model")
        if not isinstance(name, str):
            raise invalid("model: Field required")
        prices = self.app.prices.model(name)
        # An unpriced model cannot be billed, so it is not served; nor is OpenAI's model here.
        if prices is None or prices.messages is None:
            raise ApiError(404, f"model: {name}")
        return prices

    def _managed(self, body: dict[str, Any], prices: ModelPrices,
                 output_schema: dict[str, Any] | None, *, compacts: bool = True) -> Managed:
        """The request once context management ran; `compacts` False: without compaction, a
        sampling step count_tokens does not run."""
        try:
            edits = context_edits(body.get("context_management"))
            return managed_prompt(body, prices, self.app.registry,
                                  edits if compacts else replace(edits, compact=None),
                                  output_schema)
        except InputError as exc:
            raise invalid(str(exc)) from exc

    def decide(self, body: dict[str, Any], request: Request, fault: Fault,
               betas: set[str]) -> Reply:
        prices = self._model(body)
        assert prices.messages is not None  # checked by _model
        _check_fields(body, FIELDS)
        params = _params(body, prices, betas)
        managed = self._managed(body, prices, params.output_schema)
        prompt = managed.prompt
        long_context = prices.long_context if (
            prices.long_context is not None and prices.long_context.beta in betas) else None
        window = (prices.messages.context_window_tokens if long_context is None
                  else long_context.context_window_tokens)
        # The model reads the input before any compaction: it must fit the window.
        read_tokens = max(prompt.tokens, managed.compaction_input_tokens)
        if read_tokens > window:
            raise invalid(f"prompt is too long: {read_tokens} tokens > {window} maximum")
        if prompt.tokens + params.max_tokens > window:
            raise invalid(f"input length and `max_tokens` exceed context limit: {prompt.tokens} "
                          f"+ {params.max_tokens} > {window}, decrease input length or "
                          "`max_tokens` and try again")
        tools = prompt.tools
        if params.thinking_budget is not None and tools.forced is not None:
            raise invalid("Thinking may not be enabled when tool_choice forces tool use.")
        if managed.pause:  # the answer is the compaction block alone
            cache = CacheUse()
        elif fault.cached_tokens is not None:
            cache = CacheUse(read_tokens=min(fault.cached_tokens, prompt.tokens))
        elif not self.app.settings.prompt_cache:
            cache = CacheUse()
        else:
            cache = self.cache.use(prices, prompt, self.app.now_s())
        scripted = self._scripted(tools)
        reply = self._reply(body, request, fault, prices, params, managed, cache, long_context,
                            scripted)
        if scripted is not None:  # decided: the scripted call is spent
            calls = list(self.app.settings.tool_calls)
            calls.remove(scripted)
            self.app.settings = replace(self.app.settings, tool_calls=tuple(calls))
        return reply

    def _scripted(self, tools: Tools) -> dict[str, Any] | None:
        """The first scripted tool call (/control's `tool_calls`) this call's tools can make."""
        if tools.choice.kind == "none":
            return None
        return next((c for c in self.app.settings.tool_calls if c["name"] in tools.client), None)

    def _reply(self, body: dict[str, Any], request: Request, fault: Fault, prices: ModelPrices,
               params: Params, managed: Managed, cache: CacheUse,
               long_context: LongContext | None, scripted: dict[str, Any] | None) -> Reply:
        prompt = managed.prompt
        cap, tools = params.max_tokens, prompt.tools
        forced = header_count(request, "x-stub-output-tokens", 1)
        forced_thinking = header_count(request, "x-stub-reasoning-tokens", 0)
        total = 0 if cap == 0 or managed.pause else min(
            cap, forced or self.app.draw_output_tokens())
        thinking = 0
        if params.thinking_budget is not None:
            thinking = (min(total, forced_thinking) if forced_thinking is not None
                        else min(math.floor(total * params.thinking_share),
                                 params.thinking_budget))
        elif forced_thinking is not None:
            raise invalid("X-Stub-Reasoning-Tokens: thinking is not enabled")
        tool = tools.forced
        if request.headers.get("x-stub-tool-call") == "1":
            if not tools.client or tools.choice.kind == "none":
                raise invalid("X-Stub-Tool-Call: the call has no client tool it may call")
            tool = tool or tools.client[0]
        if scripted is not None and not managed.pause:
            tool = str(scripted["name"])
        searches = [] if managed.pause else [*self._searches(tools, fault, tool),
                                             *self._fetches(tools, request, tool)]
        visible = words(total - thinking)
        tool_call = None
        tool_input: dict[str, Any] | None = None
        stop: str | None = None
        if managed.pause:
            text, generated = "", 0
        elif tool is not None and tool not in SERVER_TOOLS:
            schema = tools.schemas.get(tool, {})
            if scripted is not None:
                tool_input = dict(scripted["input"])
            elif not _free_form(schema):
                tool_input = schema_instance(schema)
            # An input the schema (or the script) dictates is written whole, as far as the cap
            # lets it, whatever length was drawn.
            if tool_input is None:
                text, generated = " ".join(visible), len(visible)
            else:
                text, generated = _bounded_json(tool_input, cap - thinking)
            tool_call = ("toolu_" + secrets.token_hex(12), tool)
        elif params.output_schema is not None:
            text, generated = _bounded_json(schema_instance(params.output_schema), cap - thinking)
        else:
            text, generated, stop = _stopped(visible, params.stop_sequences)
        output = thinking + generated
        stop_reason = ("compaction" if managed.pause else "stop_sequence" if stop is not None
                       else "max_tokens" if output == cap
                       else "tool_use" if tool_call is not None else "end_turn")
        search_tokens = sum(search_result_tokens(list(s.results)) for s in searches
                            if s.results is not None and s.tool == "web_search")
        fetch_tokens = sum(fetch_result_tokens(s.results[0]) for s in searches
                           if s.results is not None and s.tool == "web_fetch")
        compaction_in, compaction_out = (managed.compaction_input_tokens,
                                         managed.compaction_output_tokens)
        # The answer's own iteration reads the (compacted) prompt; a paused one reads nothing.
        answer_input = 0 if managed.pause else prompt.tokens + search_tokens + fetch_tokens
        usage = Usage(
            input_tokens=answer_input + compaction_in, cached_input_tokens=cache.read_tokens,
            cache_write_tokens=cache.write_5m_tokens + cache.write_1h_tokens,
            cache_write_1h_tokens=cache.write_1h_tokens, image_input_tokens=prompt.image_tokens,
            file_input_tokens=prompt.file_tokens, output_tokens=output + compaction_out,
            reasoning_tokens=thinking,
            web_search_requests=sum(s.results is not None and s.tool == "web_search"
                                    for s in searches),
        )
        # Fast mode's rates hold across the whole window; otherwise a long input may bill at
        # the long-context rates.
        tier = SPEED_FAST if params.fast else TIER_STANDARD
        if not params.fast and long_context is not None and max(
                answer_input, compaction_in) > long_context.above_input_tokens:
            tier = TIER_LONG_CONTEXT
        summary = tuple(THINKING_WORDS[i % len(THINKING_WORDS)]
                        for i in range(math.ceil(thinking / THINKING_TOKENS_PER_SUMMARY_WORD)))
        beyond = dict(managed.beyond_body)
        if search_tokens:
            beyond["web_search_result_tokens"] = search_tokens
        if fetch_tokens:
            beyond["web_fetch_content_tokens"] = fetch_tokens
        return Reply(
            model=str(body["model"]), usage=usage, cost_micros=cost_micros(prices, tier, usage),
            service_tier="standard" if tier == TIER_STANDARD else tier,
            message_id="msg_" + secrets.token_hex(12),
            thinking=(None if params.thinking_budget is None or managed.pause
                      else " ".join(summary) if params.thinking_shown else ""),
            signature=thinking_signature(thinking), searches=tuple(searches),
            text=text, tool_call=tool_call, tool_input=tool_input, stop_reason=stop_reason,
            stop_sequence=stop, search_tokens=search_tokens + fetch_tokens,
            server_tools=tools.web_search or tools.web_fetch, prices=prices, prompt=prompt,
            cache=cache, managed=managed, beyond_body=beyond or None,
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

    def _fetches(self, tools: Tools, request: Request, tool: str | None) -> list[Search]:
        """The pages the model fetches: `X-Stub-Web-Fetches: N`, or one when the tool is forced;
        at most max_uses (the rest refused, unbilled). Each page counts to the tool's
        `max_content_tokens`, or to the setting `web_search_result_tokens` without one."""
        if not tools.web_fetch or tools.choice.kind == "none":
            return []
        asked = header_count(request, "x-stub-web-fetches", 0)
        asked = int(tool == "web_fetch") if asked is None else asked
        limit = tools.web_fetch_max_uses
        run = asked if limit is None else min(asked, limit)
        page_tokens = tools.web_fetch_max_content_tokens or (
            self.app.settings.web_search_result_tokens)
        fetches = []
        for i in range(asked if asked == run else run + 1):
            tool_use_id = "srvtoolu_" + secrets.token_hex(12)
            url = f"https://fetch.stub.invalid/{tool_use_id}"
            page = None
            if i < run:
                page = ({"type": "web_fetch_result", "url": url, "retrieved_at": None,
                         "content": {"type": "document", "title": None, "citations": None,
                                     "source": {"type": "text", "media_type": "text/plain",
                                                "data": "F" * max(
                                                    0, 4 * page_tokens - len(url))}}},)
            fetches.append(Search(tool_use_id, url, page, "web_fetch"))
        return fetches

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
            **_context_management(decided),
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
                                             "output_tokens_details", "iterations")
                       if k in final}
        events.append(_event({"type": "message_delta",
                              "delta": {"stop_reason": decided.stop_reason,
                                        "stop_sequence": decided.stop_sequence},
                              "usage": delta_usage, **_context_management(decided)}))
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
        message.pop("context_management", None)  # reported in message_delta
        return [_event({"type": "message_start", "message": message}), _event({"type": "ping"})]


def _error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def _usage(reply: Reply, *, final: bool = True) -> dict[str, Any]:
    """`usage` of the message, as Anthropic reports it: `input_tokens` is only the input neither
    read from nor written to the cache; `final` False: as message_start reports it."""
    u = reply.usage
    managed = reply.managed
    # The top-level fields are the answer's own iteration; compaction's are in `iterations`.
    uncached = (u.input_tokens - u.cached_input_tokens - u.cache_write_tokens
                - managed.compaction_input_tokens)
    output = u.output_tokens - managed.compaction_output_tokens
    doc: dict[str, Any] = {
        "input_tokens": uncached if final else uncached - reply.search_tokens,
        "cache_creation_input_tokens": u.cache_write_tokens,
        "cache_read_input_tokens": u.cached_input_tokens,
        "cache_creation": {
            "ephemeral_5m_input_tokens": u.cache_write_tokens - u.cache_write_1h_tokens,
            "ephemeral_1h_input_tokens": u.cache_write_1h_tokens,
        },
        # message_start shows the first output token; message_delta the total.
        "output_tokens": output if final else min(1, output),
        "service_tier": "standard",
    }
    if reply.service_tier == SPEED_FAST:
        doc["speed"] = SPEED_FAST
    if managed.compaction_summary is not None and final:
        doc["iterations"] = [
            {"type": "compaction", "input_tokens": managed.compaction_input_tokens,
             "output_tokens": managed.compaction_output_tokens,
             "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
            *([] if managed.pause else [{
                "type": "message", "input_tokens": uncached,
                "output_tokens": output,
                "cache_creation_input_tokens": u.cache_write_tokens,
                "cache_read_input_tokens": u.cached_input_tokens}])]
    if reply.server_tools:
        fetched = sum(s.results is not None and s.tool == "web_fetch" for s in reply.searches)
        doc["server_tool_use"] = {"web_search_requests": u.web_search_requests if final else 0,
                                  "web_fetch_requests": fetched if final else 0}
    if reply.thinking is not None:
        doc["output_tokens_details"] = {"thinking_tokens": u.reasoning_tokens if final else 0}
    return doc


def _context_management(reply: Reply) -> dict[str, Any]:
    """The answer's `context_management`, when the request had any."""
    if reply.managed.applied_edits or reply.managed.compaction_summary is not None:
        return {"context_management": {"applied_edits": reply.managed.applied_edits}}
    return {}


def _content(reply: Reply) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if reply.managed.compaction_summary is not None:
        blocks.append({"type": "compaction", "content": reply.managed.compaction_summary})
    if reply.thinking is not None:
        blocks.append({"type": "thinking", "thinking": reply.thinking,
                       "signature": reply.signature})
    for search in reply.searches:
        if search.tool == "web_fetch":
            fetched: Any = (search.results[0] if search.results is not None else
                            {"type": "web_fetch_tool_result_error",
                             "error_code": "max_uses_exceeded"})
            blocks += [{"type": "server_tool_use", "id": search.tool_use_id, "name": "web_fetch",
                        "input": {"url": search.query}},
                       {"type": "web_fetch_tool_result", "tool_use_id": search.tool_use_id,
                        "content": fetched}]
            continue
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
                       "input": {"text": reply.text} if reply.tool_input is None
                       else reply.tool_input})
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
    elif kind == "compaction":
        start = {"type": "compaction", "content": None}
        deltas = [{"type": "compaction_delta", "content": block["content"]}]
    # A web_search_tool_result arrives whole in its content_block_start.
    return [_event({"type": "content_block_start", "index": index, "content_block": start}),
            *(_event({"type": "content_block_delta", "index": index, "delta": delta})
              for delta in deltas),
            _event({"type": "content_block_stop", "index": index})]
