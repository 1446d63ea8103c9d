"""How many input tokens the stub provider bills for a request, counted as providers document.

- Text: the UTF-8 bytes of the text a message carries over four, rounded up, plus 4 tokens a
  message and 3 a reply (OpenAI's rule of thumb of ~4 characters a token and its chat framing,
  https://github.com/openai/openai-cookbook/blob/main/examples/How_to_count_tokens_with_tiktoken.ipynb).
  Only text counts as text: the JSON around an image, audio or file part does not. Tool
  definitions and response schemas are billed as input by OpenAI, counted by their JSON bytes.
- Images: OpenAI's tile or patch rule for the model (infra.stub_media.image_tokens). The size
  comes from the image itself for a `data:` URL; an http(s) URL, which the stub cannot fetch, is
  resolved through the registry POST /control fills, and an unknown one is refused as OpenAI
  refuses an image it cannot download.
- Audio (`input_audio`): the clip's duration times the model's audio tokens per second.
- Files (`file` parts, `input_file`, `file_id`, `file_url`) and `item_reference`: the stub's own
  rule, since a provider's is not documented to the token: the file's bytes over four plus, for
  a PDF, each page as a high-detail image of a letter page (OpenAI puts both the text and an
  image of every page in context: https://developers.openai.com/api/docs/guides/pdf-files). A
  file referenced by id or URL is sized from the registry; an unknown one is refused.

Every refusal is an InputError (400, not billed), raised before anything is served.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from infra.stub_media import (
    MediaError,
    audio_seconds,
    audio_tokens,
    data_url_bytes,
    decode_base64,
    image_size,
    image_tokens,
    pdf_pages,
)
from infra.stub_prices import ModelPrices

BYTES_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 4
TOKENS_PER_REPLY = 3
# A PDF page is billed as an image of this size: US letter rendered at 144 dpi.
PAGE_IMAGE_PX = (1224, 1584)
# Walking a request is bounded: one with more messages or parts than this is refused.
ITEMS_MAX = 10_000
DETAILS = ("low", "high", "auto")
AUDIO_FORMATS = ("wav", "mp3")
# Responses API tools the stub serves: those the client runs itself. A hosted tool (web search,
# file search...) is billed per call on top of its tokens, which the stub does not model.
CLIENT_TOOL_TYPES = frozenset({"function", "custom"})


class InputError(ValueError):
    """The provider refuses the request as sent: 400, nothing billed."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class FileRef:
    """A file (or stored item) the provider holds, as POST /control describes it."""

    size_bytes: int
    pages: int = 0
    image: tuple[int, int] | None = None  # its width and height, when it is an image


@dataclass
class Registry:
    """What the stub knows of content it cannot fetch: images by URL, files by id or URL."""

    images: dict[str, tuple[int, int]] = field(default_factory=dict)
    files: dict[str, FileRef] = field(default_factory=dict)


@dataclass
class Prompt:
    """A request's input, counted. `prefixes` are the prompt cache's view of it: the digest of
    each prefix that ends at a message boundary, with the tokens up to there."""

    tokens: int = TOKENS_PER_REPLY
    image_tokens: int = 0
    audio_tokens: int = 0
    file_tokens: int = 0
    prefixes: list[tuple[bytes, int]] = field(default_factory=list)


class Counter:
    """Counts one request's segments (tools, instructions, messages) in order."""

    def __init__(self, model: ModelPrices, registry: Registry) -> None:
        self.model, self.registry = model, registry
        self.prompt = Prompt()
        self.parts = 0
        self._digest = b""  # of the prompt so far, chained segment by segment
        self._cacheable = True

    def segment(self, source: object, text_bytes: int, media_tokens: int = 0, *,
                framed: bool = True, audio: bool = False) -> None:
        """Add one segment: its text, its media tokens, and a message's framing if `framed`."""
        tokens = math.ceil(text_bytes / BYTES_PER_TOKEN) + media_tokens
        self.prompt.tokens += tokens + (TOKENS_PER_MESSAGE if framed else 0)
        # The cache holds exact prefixes; audio is not cached, and nothing after it is either.
        if audio:
            self._cacheable = False
        if self._cacheable:
            canonical = json.dumps(source, sort_keys=True, ensure_ascii=False).encode()
            self._digest = hashlib.sha256(self._digest + canonical).digest()
            self.prompt.prefixes.append((self._digest, self.prompt.tokens))

    def json_segment(self, source: object) -> None:
        """Tool definitions or a schema: billed by their JSON bytes, with no message framing."""
        if source:
            size = len(json.dumps(source, separators=(",", ":"), ensure_ascii=False).encode())
            self.segment(source, size, framed=False)

    def count_part(self, where: str) -> None:
        self.parts += 1
        if self.parts > ITEMS_MAX:
            raise InputError(f"more than {ITEMS_MAX} messages and parts", where)

    # -- media -----------------------------------------------------------------------------

    def image(self, where: str, url: object, file_id: object, detail: object) -> int:
        rule = self.model.image
        if rule is None:
            raise InputError(f"{self.model.name} does not accept image input", where)
        detail = "auto" if detail is None else detail
        if detail not in DETAILS:
            raise InputError(f"detail must be one of {', '.join(DETAILS)}", where)
        if isinstance(file_id, str) and url is None:
            ref = self.registry.files.get(file_id)
            if ref is None or ref.image is None:
                raise InputError(f"no image file with id {file_id!r}", where)
            size = ref.image
        elif isinstance(url, str) and url.startswith("data:"):
            try:
                mime, data = data_url_bytes(url, "the image")
                size = image_size(data)
            except MediaError as exc:
                raise InputError(str(exc), where) from exc
            if not mime.startswith("image/"):
                raise InputError(f"an image data: URL must be image/*, not {mime!r}", where)
        elif isinstance(url, str) and url.startswith(("http://", "https://")):
            known = self.registry.images.get(url)
            if known is None:
                raise InputError(f"the image at {url} could not be downloaded", where)
            size = known
        else:
            raise InputError("an image needs a data: or http(s) URL or a file id", where)
        return image_tokens(rule, size[0], size[1], str(detail))

    def audio(self, where: str, audio: object) -> int:
        if self.model.standard.audio_input is None:
            raise InputError(f"{self.model.name} does not accept audio input", where)
        if not isinstance(audio, dict) or not isinstance(audio.get("data"), str):
            raise InputError("input_audio needs data (base64) and format", where)
        audio_format = audio.get("format")
        if audio_format not in AUDIO_FORMATS:
            raise InputError(f"input_audio.format must be one of {', '.join(AUDIO_FORMATS)}",
                             where)
        try:
            seconds = audio_seconds(decode_base64(audio["data"], "input_audio.data"),
                                    str(audio_format))
        except MediaError as exc:
            raise InputError(str(exc), where) from exc
        return audio_tokens(seconds, self.model.audio_input_tokens_per_s)

    def file(self, where: str, file_id: object, file_data: object, file_url: object) -> int:
        given = [v for v in (file_id, file_data, file_url) if v is not None]
        if len(given) != 1 or not isinstance(given[0], str):
            raise InputError("a file needs one of file_id, file_data or file_url", where)
        if isinstance(file_data, str):
            try:
                data = (data_url_bytes(file_data, "file_data")[1] if file_data.startswith("data:")
                        else decode_base64(file_data, "file_data"))
            except MediaError as exc:
                raise InputError(str(exc), where) from exc
            ref = FileRef(len(data), pdf_pages(data))
        else:
            key = str(given[0])
            known = self.registry.files.get(key)
            if known is None:
                raise InputError(f"no file {key!r}", where)
            ref = known
        return self.file_tokens(where, ref)

    def file_tokens(self, where: str, ref: FileRef) -> int:
        tokens = math.ceil(ref.size_bytes / BYTES_PER_TOKEN)
        if ref.pages:
            if self.model.image is None:
                raise InputError(f"{self.model.name} does not accept PDF input", where)
            tokens += ref.pages * image_tokens(self.model.image, *PAGE_IMAGE_PX, "high")
        return tokens


def _text(value: object, where: str) -> int:
    if not isinstance(value, str):
        raise InputError("expected a string", where)
    return len(value.encode())


def _function_text(call: object, where: str) -> int:
    """A tool call the model made earlier, fed back as input: its name and arguments."""
    if not isinstance(call, dict):
        raise InputError("a tool call must be an object", where)
    function = call.get("function", call)
    if not isinstance(function, dict):
        raise InputError("a tool call needs a function", where)
    return sum(_text(function.get(k, ""), where) for k in ("name", "arguments"))


# -- chat completions --------------------------------------------------------------------------


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
        text_bytes = _text(message.get("name", ""), where)
        text_bytes += sum(_function_text(c, f"{where}.tool_calls")
                          for c in message.get("tool_calls") or ())
        if message.get("function_call") is not None:
            text_bytes += _function_text(message["function_call"], f"{where}.function_call")
        media = [0, 0, 0]  # image, audio, file tokens
        content = message.get("content")
        if isinstance(content, str):
            text_bytes += len(content.encode())
        elif isinstance(content, list):
            for j, part in enumerate(content):
                text_bytes += _chat_part(counter, part, f"{where}.content[{j}]", media)
        elif content is not None:
            raise InputError("content must be a string or a list of parts", where)
        _add_media(counter, message, text_bytes, media)
    return counter.prompt


def _chat_part(counter: Counter, part: object, where: str, media: list[int]) -> int:
    counter.count_part(where)
    if not isinstance(part, dict):
        raise InputError("a content part must be an object", where)
    kind = part.get("type")
    if kind == "text":
        return _text(part.get("text"), where)
    if kind == "refusal":
        return _text(part.get("refusal"), where)
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


def _add_media(counter: Counter, source: object, text_bytes: int, media: list[int],
               *, framed: bool = True) -> None:
    image, audio, files = media
    counter.prompt.image_tokens += image
    counter.prompt.audio_tokens += audio
    counter.prompt.file_tokens += files
    counter.segment(source, text_bytes, image + audio + files, framed=framed, audio=audio > 0)


# -- responses -------------------------------------------------------------------------------


def responses_prompt(body: dict[str, Any], model: ModelPrices, registry: Registry,
                     previous_tokens: int = 0) -> Prompt:
    """The input of a Responses call; `previous_tokens` is the stored conversation that
    `previous_response_id` adds in front of it."""
    counter = Counter(model, registry)
    tools = body.get("tools") or []
    if not isinstance(tools, list) or any(
        not isinstance(t, dict) or t.get("type") not in CLIENT_TOOL_TYPES for t in tools
    ):
        raise InputError("the stub serves function and custom tools only", "tools")
    counter.json_segment(tools)
    text = body.get("text")
    if isinstance(text, dict) and isinstance(text.get("format"), dict):
        counter.json_segment(text["format"].get("schema"))
    if previous_tokens:
        counter.segment({"previous_response_tokens": previous_tokens}, 0, previous_tokens,
                        framed=False)
    instructions = body.get("instructions")
    if instructions is not None:
        counter.segment({"instructions": instructions}, _text(instructions, "instructions"))
    given = body.get("input")
    items = [{"role": "user", "content": given}] if isinstance(given, str) else given
    if not isinstance(items, list) or not items:
        raise InputError("input must be a string or a non-empty list of items", "input")
    for i, item in enumerate(items):
        _responses_item(counter, item, f"input[{i}]")
    return counter.prompt


def _responses_item(counter: Counter, item: object, where: str) -> None:
    counter.count_part(where)
    if not isinstance(item, dict):
        raise InputError("an input item must be an object", where)
    kind = item.get("type", "message")
    media = [0, 0, 0]
    text_bytes = 0
    if kind == "message":
        content = item.get("content")
        if isinstance(content, str):
            text_bytes = len(content.encode())
        elif isinstance(content, list):
            for j, part in enumerate(content):
                text_bytes += _responses_part(counter, part, f"{where}.content[{j}]", media)
        else:
            raise InputError("content must be a string or a list of parts", where)
    elif kind == "function_call":
        text_bytes = _function_text(item, where)
    elif kind in ("function_call_output", "custom_tool_call_output"):
        output = item.get("output")
        if isinstance(output, list):
            for j, part in enumerate(output):
                text_bytes += _responses_part(counter, part, f"{where}.output[{j}]", media)
        else:
            text_bytes = _text(output, where)
    elif kind == "custom_tool_call":
        text_bytes = _text(item.get("name", ""), where) + _text(item.get("input", ""), where)
    elif kind == "reasoning":
        summary = item.get("summary") or []
        text_bytes = sum(_text(s.get("text") if isinstance(s, dict) else s, where)
                         for s in summary)
    elif kind == "item_reference":
        ref = counter.registry.files.get(str(item.get("id")))
        if ref is None:
            raise InputError(f"no stored item {item.get('id')!r}", where)
        media[2] += counter.file_tokens(where, ref)
    else:
        raise InputError(f"input item type {kind!r} is not served", where)
    _add_media(counter, item, text_bytes, media)


def _responses_part(counter: Counter, part: object, where: str, media: list[int]) -> int:
    counter.count_part(where)
    if not isinstance(part, dict):
        raise InputError("a content part must be an object", where)
    kind = part.get("type")
    if kind in ("input_text", "output_text"):
        return _text(part.get("text"), where)
    if kind == "refusal":
        return _text(part.get("refusal"), where)
    if kind == "input_image":
        media[0] += counter.image(where, part.get("image_url"), part.get("file_id"),
                                  part.get("detail"))
    elif kind == "input_file":
        media[2] += counter.file(where, part.get("file_id"), part.get("file_data"),
                                 part.get("file_url"))
    else:
        raise InputError(f"content part type {kind!r} is not served", where)
    return 0
