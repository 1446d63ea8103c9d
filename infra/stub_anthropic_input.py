"""How many input tokens the stub bills for a Messages API request, counted as Anthropic documents.

- Text: the stub's own rule, as on the OpenAI side (infra.stub_input), since Anthropic publishes
  no tokenizer: a block's UTF-8 bytes over four, rounded up, plus 4 tokens a message and 3 for
  the reply. Only text counts as text: the JSON around an image or a document does not.
- Tools: each definition by its JSON bytes (cache_control left out), plus the tool-use system
  prompt Anthropic adds to every call that has tools, by model and `tool_choice` (the model
  table's `tool_prompt_tokens`; https://platform.claude.com/docs/en/agents-and-tools/tool-use/
  overview, "pricing").
- Images: Anthropic's area rule (infra.stub_media.area_tokens). The size comes from the image
  itself for a base64 source, whose bytes must be the `media_type` they claim; a URL, which the
  stub cannot fetch, or a Files API id is sized from the registry POST /control fills, and an
  unknown one is refused as Anthropic refuses an image it cannot download.
- Documents (https://platform.claude.com/docs/en/build-with-claude/pdf-support): a PDF is
  billed for its text and for an image of each page. Its text is the stub's own rule (the
  file's bytes over four, as infra.stub_input bills a file); each page is a letter page image
  (infra.stub_input.PAGE_IMAGE_PX) under the area rule. A plain-text document is its text, a
  content document its blocks.
- Thinking blocks sent back (https://platform.claude.com/docs/en/build-with-claude/
  extended-thinking): the API drops the thinking of earlier turns from the context, and keeps
  the thinking of the turn still in progress (an assistant turn answered only by tool results);
  a model with `keeps_thinking` keeps every turn's. A kept block is billed as input by the text
  the request carries (the stub does not check signatures: a forged block is billed too).
- Web search results sent back: their url, title and encrypted content, by bytes.

The prompt cache's view: Anthropic caches the prefix up to each `cache_control` breakpoint, in
the order tools, system, messages
(https://platform.claude.com/docs/en/build-with-claude/prompt-caching). The counter records the
digest of the prompt at every block boundary with the tokens up to there, and the breakpoints.
Changing `tool_choice` or `thinking` invalidates the cached messages but not the cached tools
and system, as the docs' invalidation table says: they are hashed in between.

Every refusal is an InputError (400, not billed), raised before anything is served.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from infra.stub_input import (
    BYTES_PER_TOKEN,
    ITEMS_MAX,
    PAGE_IMAGE_PX,
    TOKENS_PER_MESSAGE,
    TOKENS_PER_REPLY,
    FileRef,
    InputError,
    Registry,
)
from infra.stub_media import (
    MediaError,
    decode_base64,
    image_media_type,
    image_size,
    image_tokens,
    pdf_pages,
)
from infra.stub_prices import ModelPrices

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
# Prompt caching: at most 4 breakpoints; the two TTLs, in seconds.
CACHE_BREAKPOINTS_MAX = 4
CACHE_TTL_S = {"5m": 300, "1h": 3_600}
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


def _text(value: object, where: str) -> int:
    if not isinstance(value, str):
        raise InputError(f"{where}: expected a string", where)
    return len(value.encode())


def _tokens(text_bytes: int) -> int:
    return math.ceil(text_bytes / BYTES_PER_TOKEN)


class MessagesCounter:
    """Counts one request's blocks in the order Anthropic builds the prompt."""

    def __init__(self, model: ModelPrices, registry: Registry) -> None:
        if model.messages is None:
            raise ValueError(f"{model.name} is not served by the Messages API")
        self.model, self.registry = model, registry
        self.prompt = MessagesPrompt()
        self.parts = 0
        self.images = 0
        self._sides: list[int] = []  # the longest side of each image
        self._digest = b""
        self._cacheable_at: int | None = None  # the last boundary a breakpoint may sit on

    # -- the prompt, block by block ----------------------------------------------------------

    def block(self, source: dict[str, Any], tokens: int, where: str, *,
              cacheable: bool = True) -> None:
        """Add one block's tokens and its boundary; a `cache_control` on it is a breakpoint."""
        self.count_part(where)
        self.prompt.tokens += tokens
        canonical = {k: v for k, v in source.items() if k != "cache_control"}
        self._chain(canonical)
        self.prompt.boundaries.append((self._digest, self.prompt.tokens))
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
        self._chain({"settings": settings})

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

    def count_part(self, where: str) -> None:
        self.parts += 1
        if self.parts > ITEMS_MAX:
            raise InputError(f"more than {ITEMS_MAX} messages and blocks", where)

    def _chain(self, source: object) -> None:
        canonical = json.dumps(source, sort_keys=True, ensure_ascii=False).encode()
        self._digest = hashlib.sha256(self._digest + canonical).digest()

    # -- media -----------------------------------------------------------------------------

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
            try:
                data = decode_base64(_str(source.get("data"), where), "the image",
                                     IMAGE_BYTES_MAX)
                size = image_size(data)
            except MediaError as exc:
                raise InputError(str(exc), where) from exc
            if image_media_type(data) != media_type:
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
            return _tokens(_text(source.get("data"), where)), 0
        if kind == "content":
            content = source.get("content")
            if isinstance(content, str):
                return _tokens(len(content.encode())), 0
            return self.nested(content, f"{where}.content", ("text", "image")), 0
        if kind == "base64":
            if source.get("media_type") != "application/pdf":
                raise InputError("a base64 document's media_type is application/pdf", where)
            try:
                data = decode_base64(_str(source.get("data"), where), "the document")
            except MediaError as exc:
                raise InputError(str(exc), where) from exc
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
        return 0, self.file_tokens(ref, where)

    def file_tokens(self, ref: FileRef, where: str) -> int:
        rule = self.model.image
        if rule is None:
            raise InputError(f"{self.model.name} does not accept PDF input", where)
        tokens = _tokens(ref.size_bytes) + ref.pages * image_tokens(rule, *PAGE_IMAGE_PX, "auto")
        self.prompt.file_tokens += tokens
        return tokens

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
                tokens += _tokens(_text(part.get("text"), at))
            elif kind == "image":
                tokens += self.image(part.get("source"), at)
            else:
                text, files = self.document(part.get("source"), at)
                tokens += text + files
        return tokens


def _str(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise InputError("expected a string", where)
    return value


# -- the request ---------------------------------------------------------------------------------


def messages_prompt(body: dict[str, Any], model: ModelPrices, registry: Registry) -> MessagesPrompt:
    """Count `body` (already checked to be an object with a Messages API model)."""
    counter = MessagesCounter(model, registry)
    tools = _tools(counter, body.get("tools"), body.get("tool_choice"))
    counter.prompt.tools = tools
    _system(counter, body.get("system"))
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
        counter.block(tool, _tokens(size), where)
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
            counter.block({"type": "text", "text": system}, _tokens(len(system.encode())),
                          "system")
        return
    if not isinstance(system, list):
        raise InputError("system must be a string or a list of text blocks", "system")
    for i, part in enumerate(system):
        where = f"system[{i}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            raise InputError("system blocks must be text blocks", where)
        counter.block(part, _tokens(_text(part.get("text"), where)), where)


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
        last = i == len(messages) - 1
        if isinstance(content, str):
            if not content and not (last and role == "assistant"):
                raise InputError("messages must have non-empty content except for the optional "
                                 "final assistant message", where)
            blocks: list[Any] = [{"type": "text", "text": content}] if content else []
        elif isinstance(content, list):
            if not content and not (last and role == "assistant"):
                raise InputError("messages must have non-empty content except for the optional "
                                 "final assistant message", where)
            blocks = content
        else:
            raise InputError("content must be a string or a list of blocks", where)
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
        tokens = _tokens(_text(part.get("text"), where))
    elif kind == "image":
        tokens = counter.image(part.get("source"), where)
    elif kind == "document":
        text = sum(_text(part[k], where) for k in ("title", "context") if part.get(k) is not None)
        doc_text, files = counter.document(part.get("source"), where)
        tokens = _tokens(text) + doc_text + files
    elif kind in ("tool_use", "server_tool_use"):
        if not isinstance(part.get("id"), str) or not isinstance(part.get("input"), dict):
            raise InputError(f"a {kind} block needs an id and an input object", where)
        arguments = json.dumps(part["input"], separators=(",", ":"), ensure_ascii=False)
        tokens = _tokens(_text(part.get("name"), where) + len(arguments.encode()))
    elif kind == "tool_result":
        if not isinstance(part.get("tool_use_id"), str):
            raise InputError("a tool_result needs a tool_use_id", where)
        content = part.get("content", "")
        tokens = (_tokens(len(content.encode())) if isinstance(content, str)
                  else counter.nested(content, f"{where}.content", ("text", "image", "document")))
    elif kind in ("thinking", "redacted_thinking"):
        cacheable = False  # Anthropic: thinking blocks cannot carry cache_control
        text_key = "thinking" if kind == "thinking" else "data"
        text_bytes = _text(part.get(text_key), where)
        if kind == "thinking" and not isinstance(part.get("signature"), str):
            raise InputError("a thinking block needs its signature", where)
        tokens = _tokens(text_bytes) if keeps_thinking else 0
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
    return _tokens(size)


def search_result_tokens(results: list[dict[str, Any]]) -> int:
    """The input tokens a list of web search results costs, sent back or fed to the model."""
    return _search_result_tokens({"tool_use_id": "", "content": results}, "web_search")
