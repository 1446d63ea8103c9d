"""How the stub provider counts input, whatever the API: its text rule, and the tokens of images,
audio and files, read from the media themselves.

- Text: the UTF-8 bytes of text over four, rounded up, plus 4 tokens a message and 3 a reply
  (OpenAI's rule of thumb of ~4 characters a token and its chat framing,
  https://github.com/openai/openai-cookbook/blob/main/examples/How_to_count_tokens_with_tiktoken.ipynb).
  Anthropic publishes no tokenizer: its API is counted by the same rule. Only text counts as
  text: the JSON around an image, audio or file part does not.
- Images: the size from the image's own header (small parsers, no imaging library), then
  OpenAI's tile or patch rule or Anthropic's area rule for the model (image_tokens).
- Audio: the clip's duration, from its headers, times the model's audio tokens per second.
- Files: the stub's own rule, since no provider documents one to the token: the file's bytes
  over four plus, for a PDF, each page as an image of a letter page (both put the text and an
  image of every page in context: https://developers.openai.com/api/docs/guides/pdf-files,
  https://platform.claude.com/docs/en/build-with-claude/pdf-support).
- What the stub cannot fetch (an http(s) image, a file id or URL, a stored item, a stored
  prompt) is sized from the Registry that POST /control fills; an unknown one is refused, as a
  provider refuses what it cannot download.

Every refusal is an InputError (400, not billed), raised before anything is served.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import json
import math
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from fractions import Fraction

from infra.stub_prices import AreaRule, ImageRule, ModelPrices, PatchRule

BYTES_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 4
TOKENS_PER_REPLY = 3
# A PDF page is billed as an image of this size: US letter rendered at 144 dpi.
PAGE_IMAGE_PX = (1224, 1584)
# Walking a request is bounded: one with more messages or parts than this is refused.
ITEMS_MAX = 10_000
# OpenAI refuses an image larger than 20 MB
# (https://developers.openai.com/api/docs/guides/images-vision, "image input requirements"); the
# same cap bounds what the stub decodes of any base64 payload (audio, files).
PAYLOAD_BYTES_MAX = 20 * 1024 * 1024
# Tile rule constants (https://developers.openai.com/api/docs/guides/images-vision):
# fit in 2048 x 2048, then scale the shortest side to 768 px, then count 512 px tiles.
TILE_FIT_PX = 2048
TILE_SHORT_SIDE_PX = 768
TILE_PX = 512
# Patch rule (same page): 32 x 32 px patches.
PATCH_PX = 32
# An image or audio clip with a dimension or duration above these is not a real upload.
IMAGE_SIDE_PX_MAX = 65_535
AUDIO_SECONDS_MAX = 24 * 3600

DATA_URL = re.compile(
    r"data:(?P<mime>[\w.+/-]*)(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,", re.ASCII)


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
    """What the stub knows of content it cannot fetch: images by URL, files by id or URL, and
    OpenAI's stored prompts by id (their tokens)."""

    images: dict[str, tuple[int, int]] = field(default_factory=dict)
    files: dict[str, FileRef] = field(default_factory=dict)
    prompts: dict[str, int] = field(default_factory=dict)


def text_tokens(text_bytes: int) -> int:
    return math.ceil(text_bytes / BYTES_PER_TOKEN)


class Walk:
    """One request's walk, whatever its API: bounded in parts, with the digest of the prompt so
    far chained part by part (what a prompt cache holds a prefix by)."""

    parts_name = "messages and parts"

    def __init__(self, model: ModelPrices, registry: Registry) -> None:
        self.model, self.registry = model, registry
        self.parts = 0
        self.digest = b""

    def count_part(self, where: str) -> None:
        self.parts += 1
        if self.parts > ITEMS_MAX:
            raise InputError(f"more than {ITEMS_MAX} {self.parts_name}", where)

    def chain(self, source: object) -> None:
        canonical = json.dumps(source, sort_keys=True, ensure_ascii=False).encode()
        self.digest = hashlib.sha256(self.digest + canonical).digest()

    def file_tokens(self, ref: FileRef, where: str) -> int:
        """A file's bytes over four, and for a PDF a high-detail image of each page."""
        tokens = text_tokens(ref.size_bytes)
        if ref.pages:
            if self.model.image is None:
                raise InputError(f"{self.model.name} does not accept PDF input", where)
            tokens += ref.pages * image_tokens(self.model.image, *PAGE_IMAGE_PX, "high")
        return tokens


# -- payloads ----------------------------------------------------------------------------------


class MediaError(ValueError):
    """The payload is not what it claims to be; the provider refuses it (400, not billed)."""


@contextlib.contextmanager
def read_at(where: str) -> Iterator[None]:
    """Media that does not read is the request's error at `where`."""
    try:
        yield
    except MediaError as exc:
        raise InputError(str(exc), where) from exc


def decode_base64(data: str, what: str, bytes_max: int = PAYLOAD_BYTES_MAX) -> bytes:
    if len(data) > bytes_max * 4 // 3 + 4:
        raise MediaError(f"{what} is larger than {bytes_max} bytes")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"{what} is not valid base64") from exc


def data_url_bytes(url: str, what: str) -> tuple[str, bytes]:
    """The media type and decoded bytes of a base64 `data:` URL."""
    match = DATA_URL.match(url)
    if match is None or not match.group("b64"):
        raise MediaError(f"{what} must be a base64 data: URL")
    return match.group("mime"), decode_base64(url[match.end():], what)


# -- images ----------------------------------------------------------------------------------


def image_size(data: bytes) -> tuple[str, tuple[int, int]]:
    """The media type and (width, height) of a PNG, JPEG, GIF or WEBP, from its header."""
    for media_type, read in (("image/png", _png), ("image/gif", _gif), ("image/webp", _webp),
                             ("image/jpeg", _jpeg)):
        size = read(data)
        if size is not None:
            width, height = size
            if not (0 < width <= IMAGE_SIDE_PX_MAX and 0 < height <= IMAGE_SIDE_PX_MAX):
                raise MediaError(f"the image's size {width}x{height} is not valid")
            return media_type, size
    raise MediaError("the image is not a PNG, JPEG, GIF or WEBP the stub can read")


def _png(data: bytes) -> tuple[int, int] | None:
    # Signature, then the IHDR chunk: length, "IHDR", width, height (big-endian).
    if data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and len(data) >= 24:
        width, height = struct.unpack(">II", data[16:24])
        return int(width), int(height)
    return None


def _gif(data: bytes) -> tuple[int, int] | None:
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        width, height = struct.unpack("<HH", data[6:10])
        return int(width), int(height)
    return None


def _webp(data: bytes) -> tuple[int, int] | None:
    # https://developers.google.com/speed/webp/docs/riff_container
    if data[:4] != b"RIFF" or data[8:12] != b"WEBP":
        return None
    chunk = data[12:16]
    if chunk == b"VP8X" and len(data) >= 30:  # extended: 24-bit width - 1 and height - 1
        return (int.from_bytes(data[24:27], "little") + 1,
                int.from_bytes(data[27:30], "little") + 1)
    if chunk == b"VP8L" and len(data) >= 25 and data[20] == 0x2F:
        # Lossless: a signature byte, then 14-bit width - 1 and 14-bit height - 1.
        bits = int.from_bytes(data[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8 " and len(data) >= 30 and data[23:26] == b"\x9d\x01\x2a":
        # Lossy: after the key frame's start code, 14-bit width and height.
        width, height = struct.unpack("<HH", data[26:30])
        return int(width) & 0x3FFF, int(height) & 0x3FFF
    return None


def _jpeg(data: bytes) -> tuple[int, int] | None:
    # Walk the markers to the first start-of-frame: SOF0-SOF15 but DHT (C4), JPG (C8), DAC (CC).
    if data[:2] != b"\xff\xd8":
        return None
    at = 2
    while at + 9 <= len(data):
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # no length field
            at += 2
            continue
        (length,) = struct.unpack(">H", data[at + 2:at + 4])
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            height, width = struct.unpack(">HH", data[at + 5:at + 9])
            return int(width), int(height)
        if length < 2:
            return None
        at += 2 + length
    return None


def image_tokens(rule: ImageRule, width: int, height: int, detail: str) -> int:
    """The input tokens a provider bills for one image of this size on a model with `rule`.

    OpenAI's tile and patch rules: https://developers.openai.com/api/docs/guides/images-vision
    ("calculating costs"); `auto` is billed as `high` (the model may choose it, and the witness
    bills what it may). Anthropic's area rule takes no detail (see area_tokens)."""
    if isinstance(rule, AreaRule):
        return area_tokens(rule, width, height)
    if isinstance(rule, PatchRule):
        # Patch models take no detail setting: every image is counted by its patches.
        return math.ceil(patches(width, height, rule.patches_max) * rule.multiplier)
    if detail == "low":
        return rule.base_tokens
    return rule.base_tokens + rule.tile_tokens * tiles(width, height)


def tiles(width: int, height: int) -> int:
    """512 px tiles of the image once scaled to fit 2048 x 2048 and to a 768 px shortest side.

    Neither step scales up; sizes stay exact fractions, so no rounding decides a tile."""
    w, h = Fraction(width), Fraction(height)
    if max(w, h) > TILE_FIT_PX:
        scale = TILE_FIT_PX / max(w, h)
        w, h = w * scale, h * scale
    if min(w, h) > TILE_SHORT_SIDE_PX:
        scale = TILE_SHORT_SIDE_PX / min(w, h)
        w, h = w * scale, h * scale
    return math.ceil(w / TILE_PX) * math.ceil(h / TILE_PX)


def patches(width: int, height: int, patches_max: int) -> int:
    """32 px patches covering the image; above `patches_max` the image is scaled down to fit.

    The documented steps: shrink by sqrt(32^2 * max / (w * h)), then shrink again so the
    width (or height) is a whole number of patches, then count the patches of the result."""
    count = math.ceil(width / PATCH_PX) * math.ceil(height / PATCH_PX)
    if count <= patches_max:
        return count
    shrink = math.sqrt(PATCH_PX * PATCH_PX * patches_max / (width * height))
    # A side shorter than one patch after shrinking keeps its one patch and sets no fit.
    sides = [side * shrink / PATCH_PX for side in (width, height)]
    shrink *= min(math.floor(s) / s for s in sides if s >= 1)
    w = max(1, math.floor(width * shrink))
    h = max(1, math.floor(height * shrink))
    return min(patches_max, math.ceil(w / PATCH_PX) * math.ceil(h / PATCH_PX))


def area_size(rule: AreaRule, width: int, height: int) -> tuple[int, int]:
    """The size Anthropic bills an image at: scaled down, aspect ratio kept, until its long edge
    and its area are within the rule's limits; never scaled up.

    Integer arithmetic throughout, so no float rounding decides a pixel: the long edge is fitted
    first (the short side rounded down), then both sides are shrunk by sqrt(max / area), each
    rounded down, as floor(sqrt(side^2 x max / area)) = isqrt(side x max // other side)."""
    long_edge = max(width, height)
    if long_edge > rule.long_edge_px_max:
        width = max(1, width * rule.long_edge_px_max // long_edge)
        height = max(1, height * rule.long_edge_px_max // long_edge)
    if width * height > rule.pixels_max:
        width, height = (max(1, math.isqrt(width * rule.pixels_max // height)),
                         max(1, math.isqrt(height * rule.pixels_max // width)))
    return width, height


def area_tokens(rule: AreaRule, width: int, height: int) -> int:
    """Anthropic's image tokens: width x height / 750 of the billed size, rounded up
    (https://platform.claude.com/docs/en/build-with-claude/vision, "calculate image costs")."""
    billed_width, billed_height = area_size(rule, width, height)
    return math.ceil(Fraction(billed_width * billed_height, rule.pixels_per_token))


# -- audio -----------------------------------------------------------------------------------


def audio_seconds(data: bytes, audio_format: str) -> Fraction:
    """The duration of a WAV or MP3 clip, from its headers."""
    if audio_format == "wav":
        seconds = _wav_seconds(data)
    elif audio_format == "mp3":
        seconds = _mp3_seconds(data)
    else:
        raise MediaError(f"audio format {audio_format!r} is not served: give wav or mp3")
    if not 0 < seconds <= AUDIO_SECONDS_MAX:
        raise MediaError("the audio clip has no duration the stub can read")
    return seconds


def _wav_seconds(data: bytes) -> Fraction:
    # RIFF chunks: "fmt " gives the byte rate (bytes per second), "data" the sample bytes.
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise MediaError("the audio is not a RIFF/WAVE file")
    at, byte_rate, data_bytes = 12, 0, None
    while at + 8 <= len(data):
        chunk, size = data[at:at + 4], int.from_bytes(data[at + 4:at + 8], "little")
        if chunk == b"fmt " and size >= 16:
            byte_rate = int.from_bytes(data[at + 16:at + 20], "little")
        elif chunk == b"data":
            # A streamed WAV may say 0 or 0xFFFFFFFF: the samples run to the end of the file.
            data_bytes = min(size, len(data) - at - 8) if size else len(data) - at - 8
            break
        at += 8 + size + (size & 1)
    if not byte_rate or data_bytes is None:
        raise MediaError("the WAV file has no fmt or data chunk")
    return Fraction(data_bytes, byte_rate)


# MPEG audio frame header tables (ISO/IEC 11172-3 and 13818-3), layer III only.
_MP3_BITRATES_KBPS = {
    1: (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),  # MPEG-1
    2: (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),  # MPEG-2 and 2.5
}
_MP3_SAMPLE_RATES = {3: (44_100, 48_000, 32_000), 2: (22_050, 24_000, 16_000),
                     0: (11_025, 12_000, 8_000)}  # by the version bits: 3 MPEG-1, 2 MPEG-2, 0 2.5


def _mp3_seconds(data: bytes) -> Fraction:
    """Walk the layer III frames and add up their samples; an ID3v2 tag in front is skipped."""
    at = 0
    if data[:3] == b"ID3" and len(data) >= 10:
        at = 10 + ((data[6] << 21) | (data[7] << 14) | (data[8] << 7) | data[9])
    seconds, frames = Fraction(0), 0
    while at + 4 <= len(data):
        header = int.from_bytes(data[at:at + 4], "big")
        version_bits, layer_bits = (header >> 19) & 3, (header >> 17) & 3
        bitrate_index, rate_index = (header >> 12) & 0xF, (header >> 10) & 3
        if (header >> 21) != 0x7FF or version_bits == 1 or layer_bits != 1 or \
                bitrate_index in (0, 15) or rate_index == 3:
            if frames:
                break  # trailing tags (ID3v1, APE) after the last frame
            raise MediaError("the audio is not an MPEG layer III (mp3) stream")
        mpeg1 = version_bits == 3
        bitrate = _MP3_BITRATES_KBPS[1 if mpeg1 else 2][bitrate_index] * 1000
        sample_rate = _MP3_SAMPLE_RATES[version_bits][rate_index]
        samples = 1152 if mpeg1 else 576
        padding = (header >> 9) & 1
        at += samples // 8 * bitrate // sample_rate + padding
        seconds += Fraction(samples, sample_rate)
        frames += 1
    if not frames:
        raise MediaError("the mp3 stream has no frames")
    return seconds


# -- files -----------------------------------------------------------------------------------

_PDF_PAGE = re.compile(rb"/Type\s*/Page(?![a-zA-Z])")


def pdf_pages(data: bytes) -> int:
    """Page objects in a PDF (0 for anything else): each is billed as an image of the page."""
    return len(_PDF_PAGE.findall(data)) if data[:5] == b"%PDF-" else 0
