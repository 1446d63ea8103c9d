"""What a request's input can be billed as, bounded before the call.

- Text is bounded by the UTF-8 bytes of the JSON that carries it: byte-level BPE tokenizers
  (GPT, Claude, Llama, Gemini families) never produce more tokens than the bytes they encode,
  and escapes and framing only raise the bound.
- Media is not text, and its payload is left out of that count (a 1 MB data URL is not a
  million tokens). An image is billed by a per-image rule of the model, whatever its size or
  URL: it is counted here by detail (Media) and priced with the model's bound (core/prices/),
  so an image URL is bounded without fetching it. Audio is billed by its duration, which is
  read from the bytes sent (a WAV header, or the lowest bitrate MP3 frames can have).
- What the request only refers to (a file by id or URL, a PDF, a reasoning item sent back, an
  item stored with the provider, a document) has a billed size the request cannot show, but the
  model cannot read more than its context window: it is noted in Media.referred_field, and the
  call's input is then held at the model's context window (core/prices/), never at a guess
  below it. What no window bounds (a content part or item type this module does not know) is
  refused with InputUnbounded naming the field.

What every provider API shares is here: the media rules, the bound by bytes, and the walk
(Walk, messages_bound) that copies a request's messages with their media counted and blanked.
Which messages, parts and items an API has, and what each bills, is its wire format's
(core/formats/chat.py, responses.py, messages.py: each holds its walker).
"""

from __future__ import annotations

import binascii
import json
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from core.errors import InputUnbounded, InvalidRequest
from core.limits import TOKENS_MAX

# OpenAI's chat format adds a few tokens per message (role, separators) and per reply (priming).
TOKENS_PER_MESSAGE = 4
TOKENS_PER_REPLY = 3
# A request with more messages (or Responses items) than this is refused rather than walked.
MESSAGES_MAX = 10_000


# -- per-model media rules ------------------------------------------------------------------------


@dataclass(frozen=True)
class ImageBound:
    """The most input tokens one image can be billed as, at each detail level."""

    low_tokens: int
    high_tokens: int


# OpenAI, "Images and vision", calculating costs:
# https://platform.openai.com/docs/guides/images-vision#calculating-costs
# Tile-based models: `detail: low` is billed the base tokens; `high` the base plus a price per
# 512px tile, once the image is scaled to fit 2048 x 2048 and then down until its short side is
# 768. No image tiles larger than 768 x 2048 after that: 2 x 4 tiles.
IMAGE_TILES_MAX = 8
# Patch-based models: the image is covered with 32px patches, at most 1,536 (a larger image is
# scaled down until it fits), each billed as a model's multiplier of tokens. No low-detail rule
# is documented for them, so low detail is held as high.
IMAGE_PATCHES_MAX = 1_536


def _tiled(base_tokens: int, tile_tokens: int) -> ImageBound:
    return ImageBound(base_tokens, base_tokens + tile_tokens * IMAGE_TILES_MAX)


def _patched(tokens_per_patch: str) -> ImageBound:
    tokens = math.ceil(Decimal(tokens_per_patch) * IMAGE_PATCHES_MAX)
    return ImageBound(tokens, tokens)


# Anthropic, "Vision" (https://platform.claude.com/docs/en/build-with-claude/vision): an image is
# billed width x height / 750 tokens, once it is scaled down (its aspect ratio kept) until its long
# edge is at most 1,568 px and it is at most "~1,600 tokens". The docs' table of the largest sizes
# that are not scaled reaches 784 x 1,568 px: 1,639.08 tokens, the bound, rounded up. The JSON
# around an image is counted as text besides, which covers any framing the provider adds per
# image. Later models read larger images, so the bound is theirs only where named below.
CLAUDE_IMAGE_TOKENS_MAX = math.ceil(784 * 1_568 / 750)
_CLAUDE_AREA = ImageBound(CLAUDE_IMAGE_TOKENS_MAX, CLAUDE_IMAGE_TOKENS_MAX)
CLAUDE_AREA_MODELS = (
    "claude-3-haiku", "claude-3-sonnet", "claude-3-opus", "claude-3-5-haiku",
    "claude-3-5-sonnet", "claude-3-7-sonnet", "claude-sonnet-4", "claude-opus-4",
    "claude-opus-4-1", "claude-sonnet-4-5", "claude-haiku-4-5", "claude-opus-4-5",
    "claude-opus-4-6", "claude-sonnet-4-6",
)

# The most output tokens one call of a model writes (Anthropic, "Models overview": each model's
# max output; with the output-128k beta, Claude 3.7 Sonnet's 128K), thinking included: so the
# most one thinking block sent back can carry. Holding thinking sent back at this many tokens a
# block (never above the context window) is far tighter than the window for a model whose
# window is 1M.
CLAUDE_OUTPUT_TOKENS_MAX: dict[str, int] = {
    "claude-3-7-sonnet": 128_000, "claude-sonnet-4": 64_000, "claude-opus-4": 32_000,
    "claude-opus-4-1": 32_000, "claude-sonnet-4-5": 64_000, "claude-haiku-4-5": 64_000,
    "claude-opus-4-5": 64_000, "claude-opus-5-5": 128_000,
}

# Where the documented rules disagree, the larger bound is kept: gpt-4.1 is listed among the
# tile models (85 + 170 a tile) and among those billed by patches (1 a patch, 1,536 at most);
# gpt-5's tiles (70 + 140 a tile) are also described as capped at 1,536 tokens.
_GPT_4O_TILES = _tiled(85, 170)
IMAGE_BOUNDS: dict[str, ImageBound] = {
    "gpt-4o": _GPT_4O_TILES,
    "chatgpt-4o-latest": _GPT_4O_TILES,
    "gpt-4-turbo": _GPT_4O_TILES,
    "gpt-4.5-preview": _GPT_4O_TILES,
    "gpt-4.1": ImageBound(IMAGE_PATCHES_MAX, IMAGE_PATCHES_MAX),
    "gpt-4o-mini": _tiled(2_833, 5_667),
    "gpt-5": ImageBound(70, max(_tiled(70, 140).high_tokens, IMAGE_PATCHES_MAX)),
    "gpt-5-chat-latest": ImageBound(70, max(_tiled(70, 140).high_tokens, IMAGE_PATCHES_MAX)),
    "o1": _tiled(75, 150),
    "o1-pro": _tiled(75, 150),
    "o3": _tiled(75, 150),
    "computer-use-preview": _tiled(65, 129),
    "gpt-4.1-mini": _patched("1.62"),
    "gpt-4.1-nano": _patched("2.46"),
    "o4-mini": _patched("1.72"),
    "gpt-5-mini": _patched("1.62"),
    "gpt-5-nano": _patched("2.46"),
    **dict.fromkeys(CLAUDE_AREA_MODELS, _CLAUDE_AREA),
}

# OpenAI, "Realtime API: managing costs": "Audio tokens in user messages are 1 token per 100 ms
# of audio" (https://developers.openai.com/api/docs/guides/realtime-costs); the same audio
# models serve chat completions.
OPENAI_AUDIO_INPUT_TOKENS_PER_S = 10
# Google, "Audio understanding": "Gemini represents each second of audio as 32 tokens"
# (https://ai.google.dev/gemini-api/docs/audio). Every model named gemini-*.
GEMINI_AUDIO_INPUT_TOKENS_PER_S = 32
AUDIO_INPUT_TOKENS_PER_S: dict[str, int] = {
    "gpt-4o-audio-preview": OPENAI_AUDIO_INPUT_TOKENS_PER_S,
    "gpt-4o-mini-audio-preview": OPENAI_AUDIO_INPUT_TOKENS_PER_S,
    "gpt-audio": OPENAI_AUDIO_INPUT_TOKENS_PER_S,
    "gpt-audio-mini": OPENAI_AUDIO_INPUT_TOKENS_PER_S,
}

# A dated snapshot of a model (gpt-4o-2024-08-06, claude-sonnet-4-5-20250929) follows its model's
# rule; nothing else does: a new model (gpt-5.1, gpt-4o-audio-preview) may bill images or audio
# by other rules.
_SNAPSHOT_SUFFIX = re.compile(r"-(\d{4}-\d{2}-\d{2}|\d{8})$")


def _by_model(model: str, table: dict[str, Any]) -> Any:
    name = model.lower()
    found = table.get(name)
    return table.get(_SNAPSHOT_SUFFIX.sub("", name)) if found is None else found


def image_bound(model: str) -> ImageBound | None:
    """The bundled per-image bound of a model; None where no documented rule is known."""
    return _by_model(model, IMAGE_BOUNDS)  # type: ignore[no-any-return]


def output_tokens_max(model: str) -> int | None:
    """The bundled most output tokens a call of a model writes; None where it is not known."""
    return _by_model(model, CLAUDE_OUTPUT_TOKENS_MAX)  # type: ignore[no-any-return]


def audio_input_tokens_per_s(model: str) -> int | None:
    """The bundled audio tokenization of a model; None where no documented rate is known."""
    found = _by_model(model, AUDIO_INPUT_TOKENS_PER_S)
    if found is None and model.lower().startswith("gemini-"):
        return GEMINI_AUDIO_INPUT_TOKENS_PER_S
    return found  # type: ignore[no-any-return]


# -- audio duration from the bytes sent ------------------------------------------------------------

AUDIO_FORMATS = ("wav", "mp3")
# The fewest bytes any MPEG audio frame takes for a second of sound, so bytes / this bounds a
# stream's duration. The lowest bitrate in the tables is 8 kbit/s (MPEG-2 and 2.5; ISO/IEC
# 13818-3), but a frame's length is its share of that rate rounded down, and its padding byte is
# the encoder's to leave out: at 11,025 or 22,050 Hz, 8 kbit/s frames of 576 samples are 52 or
# 26 bytes, 995.3 bytes a second, not 1,000. Rounded down again here. Free-format streams, whose
# bitrate is outside the tables, are refused (see _check_mp3).
MP3_BYTES_PER_S_MIN = 995
# A WAV header is looked for in the first bytes only: the chunks before `data` are small.
WAV_HEADER_BYTES_MAX = 4_096
# PCM beyond these is not audio anyone sends a model; a header that claims it is refused.
WAV_SAMPLE_RATE_MAX = 384_000
WAV_CHANNELS_MAX = 16
WAV_BITS = frozenset({8, 16, 24, 32, 64})
# WAVE_FORMAT_PCM, WAVE_FORMAT_IEEE_FLOAT, and WAVE_FORMAT_EXTENSIBLE carrying one of them.
WAV_FORMATS = frozenset({1, 3})
WAV_FORMAT_EXTENSIBLE = 0xFFFE


def _b64_slice(data: str, start: int, end: int, field: str) -> bytes:
    """Bytes [start, end) of base64 `data`, decoding only the characters that hold them."""
    first = start // 3 * 4
    chunk = data[first:-(-end // 3) * 4]
    try:
        raw = binascii.a2b_base64(chunk, strict_mode=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequest(f"{field} is not base64", field=field) from exc
    offset = start - first // 4 * 3
    return raw[offset:offset + end - start]


def _unreadable(field: str, why: str) -> InputUnbounded:
    return InputUnbounded(f"{field}: {why}, so the audio's duration cannot be bounded",
                          field=field)


def _wav_format_bytes_per_s(fmt: bytes, field: str) -> int:
    """The byte rate of a `fmt ` chunk's payload, once its fields are checked."""
    if len(fmt) < 16:
        raise _unreadable(field, "its WAV format chunk is too short")
    kind, channels, rate, byte_rate, block_align, bits = struct.unpack_from("<HHIIHH", fmt)
    if kind == WAV_FORMAT_EXTENSIBLE and len(fmt) >= 26:
        kind = int.from_bytes(fmt[24:26], "little")
    # A decoder reads samples by these fields; they must agree with each other, or the
    # duration it finds could be other than the one bounded here.
    if (kind not in WAV_FORMATS or bits not in WAV_BITS
            or not 1 <= channels <= WAV_CHANNELS_MAX
            or not 1 <= rate <= WAV_SAMPLE_RATE_MAX
            or block_align != channels * bits // 8 or byte_rate != rate * block_align):
        raise _unreadable(field, "the WAV header is not plain PCM with consistent fields")
    return int(byte_rate)


def _wav_bytes_per_s(data: str, field: str) -> int:
    """The byte rate of the one format chunk before the samples.

    Chunks are walked up to `data`, where the samples start: the format must come before it, and
    only once. With two, readers differ in which one they believe (ffmpeg the first; a reader
    that keeps the last one it walked past, as the stub provider does, the last): a first that
    says 49 MB a second before a second that says 1 byte would bound the clip at a sliver of
    what such a reader hears."""
    head = _b64_slice(data, 0, WAV_HEADER_BYTES_MAX, field)
    if head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        raise _unreadable(field, "not a RIFF/WAVE file")
    byte_rate: int | None = None
    pos = 12
    while pos + 8 <= len(head):
        chunk_id, size = head[pos:pos + 4], int.from_bytes(head[pos + 4:pos + 8], "little")
        if chunk_id == b"data":
            if byte_rate is None:
                raise _unreadable(field, "its samples come before its WAV format chunk")
            return byte_rate
        if chunk_id == b"fmt ":
            if byte_rate is not None:
                raise _unreadable(field, "it has two WAV format chunks, which readers read "
                                         "differently")
            byte_rate = _wav_format_bytes_per_s(head[pos + 8:pos + 8 + size], field)
        pos += 8 + size + (size & 1)
    raise _unreadable(field, f"no WAV format chunk and data chunk in its first "
                             f"{WAV_HEADER_BYTES_MAX} bytes")


def _check_mp3(data: str, field: str) -> None:
    """Refuse what does not start (after an ID3v2 tag) with an MPEG audio frame of a bitrate
    in the tables."""
    start = 0
    tag = _b64_slice(data, 0, 10, field)
    if tag[:3] == b"ID3" and len(tag) == 10:
        if any(b & 0x80 for b in tag[6:10]):
            raise _unreadable(field, "its ID3 tag size is malformed")
        size = tag[6] << 21 | tag[7] << 14 | tag[8] << 7 | tag[9]  # 7 bits a byte ("syncsafe")
        start = 10 + size + (10 if tag[5] & 0x10 else 0)  # a footer repeats the header
    frame = _b64_slice(data, start, start + 4, field)
    if len(frame) < 4 or frame[0] != 0xFF or frame[1] & 0xE0 != 0xE0:
        raise _unreadable(field, "no MPEG audio frame where the first one belongs")
    version, layer = frame[1] >> 3 & 3, frame[1] >> 1 & 3
    bitrate_index, rate_index = frame[2] >> 4, frame[2] >> 2 & 3
    if version == 1 or layer == 0 or rate_index == 3 or bitrate_index == 15:
        raise _unreadable(field, "its first MPEG frame header is invalid")
    if bitrate_index == 0:
        raise _unreadable(field, "it is a free-format stream, whose bitrate has no lower bound")


def audio_ms_max(data: object, audio_format: object, field: str) -> int:
    """An upper bound on the duration of base64 `data` in `audio_format`, in milliseconds."""
    if not isinstance(data, str) or not data or not data.isascii():
        raise InvalidRequest(f"{field}.data must be base64 audio", field=f"{field}.data")
    if audio_format == "wav":
        bytes_per_s = _wav_bytes_per_s(data, f"{field}.data")
    elif audio_format == "mp3":
        _check_mp3(data, f"{field}.data")
        bytes_per_s = MP3_BYTES_PER_S_MIN
    else:
        raise InputUnbounded(
            f"{field}.format must be one of {', '.join(AUDIO_FORMATS)}: the duration of other "
            "formats cannot be bounded from their bytes", field=f"{field}.format")
    # Every 4 characters decode to at most 3 bytes, whatever the padding.
    decoded_bytes_max = (len(data) + 3) // 4 * 3
    return -(-decoded_bytes_max * 1_000 // bytes_per_s)


# -- walking a request's input ------------------------------------------------------------------


@dataclass(frozen=True)
class Media:
    """The images and audio of a request, and the web searches it lets the provider run (at
    most), to be priced with its model's rules. The fields name the first of each as a JSON
    path, for a refusal when the model has no rule for it."""

    images_low: int = 0
    images_high: int = 0
    audio_ms: int = 0
    image_field: str = ""
    audio_field: str = ""
    web_searches: int = 0
    web_search_field: str = ""
    # The answers that each may run as many searches as the prices file's web_searches_max
    # bounds (Gemini's candidateCount, billed per query across every candidate).
    web_search_runs: int = 1
    # The first input the request only refers to (a JSON path): the call's input is then held
    # at the model's context window, or at `window_tokens` where the request opened a larger one.
    referred_field: str = ""
    window_tokens: int = 0
    # A request that lets the provider compact its context (a summarizing step before the
    # answer): one more step, reading at most the window and writing at most the output cap.
    compaction_field: str = ""
    # Whether the provider may bill 1-hour cache writes: only where the request asks for them
    # (Anthropic's `cache_control` with `ttl: "1h"`); a format that cannot tell says so.
    cache_1h: bool = True
    # Thinking blocks sent back, each billed as the thinking its signature carries: at most what
    # one call of the model writes (core/prices/), and the first one's JSON path.
    thinking_blocks: int = 0
    thinking_field: str = ""


NO_MEDIA = Media()


@dataclass(frozen=True)
class InputBound:
    text_tokens: int
    media: Media = NO_MEDIA


def encodable(text: str) -> bool:
    """Whether `text` can be sent as UTF-8: a JSON body can carry lone surrogates it cannot."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


# json.dumps(value, ensure_ascii=False) without a new encoder for each value: json_bytes runs
# for every message of every call.
_JSON_TEXT_ENCODER = json.JSONEncoder(ensure_ascii=False)


def json_bytes(value: object) -> int:
    """UTF-8 bytes of `value` as JSON: the token bound of the text it carries."""
    try:
        return len(_JSON_TEXT_ENCODER.encode(value).encode())
    except UnicodeEncodeError as exc:
        raise InvalidRequest("the request's text is not valid Unicode (a lone surrogate)") from exc


class Walk:
    """One request's media, counted while its content is copied with their payloads blanked.

    A format's walker (core/formats/) copies each message or item with Walk's help: what every
    API sends alike (a list of content parts, an image by URL, audio input, a reference to input
    the request does not hold) is read here; what differs (which parts and items exist) is the
    format's."""

    def __init__(self) -> None:
        self.images_low = self.images_high = self.audio_ms = self.thinking_blocks = 0
        self.image_field = self.audio_field = self.referred_field = self.thinking_field = ""

    def media(self) -> Media:
        if not (self.images_low or self.images_high or self.audio_ms or self.referred_field
                or self.thinking_blocks):
            return NO_MEDIA
        return Media(self.images_low, self.images_high, self.audio_ms, self.image_field,
                     self.audio_field, referred_field=self.referred_field,
                     thinking_blocks=self.thinking_blocks, thinking_field=self.thinking_field)

    def refer(self, field: str) -> None:
        """Note input the request only refers to, at `field` (the first one is named)."""
        self.referred_field = self.referred_field or field

    def content(self, content: object, field: str, role: object, walk_part: PartWalk) -> object:
        """A message's content: a string as it is, or a list of content parts, each an object
        with a type, copied by `walk_part`."""
        if content is None or isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise InputUnbounded(f"{field} must be a string or a list of content parts",
                                 field=field)
        parts = []
        for j, part in enumerate(content):
            where = f"{field}[{j}]"
            if not isinstance(part, dict):
                raise InputUnbounded(f"{where} must be a content part object", field=where)
            kind = part.get("type")
            if not isinstance(kind, str):
                raise InputUnbounded(f"{where}.type must name the content part's type",
                                     field=f"{where}.type")
            parts.append(walk_part(self, part, kind, where, role))
        return parts

    def image(self, url: object, url_field: str, detail: object, detail_field: str) -> None:
        if not isinstance(url, str) or not url or not encodable(url):
            raise InvalidRequest(f"{url_field} must be an image URL", field=url_field)
        # A data URL of another type (a PDF, a video) would be billed by other rules.
        if url[:5].lower() == "data:" and url[5:11].lower() != "image/":
            raise InputUnbounded(f"{url_field} is a data URL of something other than an image",
                                 field=url_field)
        if detail in (None, "auto", "high"):  # auto lets the provider pick high
            self.images_high += 1
        elif detail == "low":
            self.images_low += 1
        else:
            raise InputUnbounded(
                f"{detail_field} {detail!r} has no known bound: give low, high or auto",
                field=detail_field)
        self.image_field = self.image_field or url_field

    def audio(self, part: dict[str, Any], field: str, role: object) -> dict[str, Any]:
        """An `input_audio` part (OpenAI's APIs), its duration bounded from its bytes."""
        # Audio in other roles' messages is billed at other rates (an assistant's, twice as
        # many tokens a second); chat takes audio input in user messages only.
        if role != "user":
            raise InputUnbounded(f"{field}: audio input is taken in user messages only",
                                 field=field)
        given = part.get("input_audio")
        if not isinstance(given, dict) or any(key not in ("data", "format") for key in given):
            raise InputUnbounded(f"{field}.input_audio must be an object of data and format",
                                 field=f"{field}.input_audio")
        self.audio_ms += audio_ms_max(given.get("data"), given.get("format"),
                                      f"{field}.input_audio")
        self.audio_field = self.audio_field or f"{field}.input_audio"
        return {**part, "input_audio": {**given, "data": ""}}


def unknown_part(kind: str, field: str) -> InputUnbounded:
    """A content part of a type the format does not know: input the gateway cannot bound."""
    return InputUnbounded(
        f"{field} is a content part of type {kind!r}, which the gateway cannot bound",
        field=field)


# Copies one content part (an object, its type, its JSON path, its message's role) with its media
# counted into the walk and blanked.
PartWalk = Callable[[Walk, dict[str, Any], str, str, object], object]
# Copies a message (at its JSON path) with its media counted into the walk and blanked.
MessageWalk = Callable[[Walk, dict[str, Any], str], dict[str, Any]]


def _checked(tokens: int, field: str) -> int:
    if tokens > TOKENS_MAX:
        raise InvalidRequest(f"{field} is larger than any model's context", field=field)
    return tokens


def messages_bound(messages: Any, walk_message: MessageWalk, field: str = "messages",
                   shape: str = f"a list of 1 to {MESSAGES_MAX} messages",
                   item: str = "message", least: int = 1) -> InputBound:
    """The input bound of a list of messages (or a Responses input's items, `field`): each by
    the JSON bytes of its copy without media (every string and structure the provider may
    tokenize), with the chat framing's tokens."""
    if not isinstance(messages, list) or not least <= len(messages) <= MESSAGES_MAX:
        raise InvalidRequest(f"{field} must be {shape}", field=field)
    walk = Walk()
    tokens = TOKENS_PER_REPLY
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(f"each {item} must be an object", field=field)
        tokens += TOKENS_PER_MESSAGE + json_bytes(walk_message(walk, message, f"{field}[{i}]"))
    return InputBound(_checked(tokens, field), walk.media())
