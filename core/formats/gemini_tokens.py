"""Google's token rules for what a Gemini request carries besides its text: its media (an
image by its tiles, read from its PNG, JPEG or WebP header; audio by the duration its WAV or MP3
bytes bound, read in core/content.py; the kinds held at the window) and each model's most
thinking tokens (GEMINI_THINKING). The format that applies them is core/formats/gemini.py.
"""

from __future__ import annotations

import binascii
import struct
from typing import NamedTuple

from core.errors import InputUnbounded, InvalidRequest

# -- models -----------------------------------------------------------------------------------

# The Gemini models before Gemini 3, by name (https://ai.google.dev/gemini-api/docs/models); a
# version of one (gemini-2.5-flash-preview-09-2025, gemini-2.0-flash-001) is matched by
# core/prices/bundled.py's gemini_family, and no other name is.
GEMINI_BEFORE_3 = frozenset({
    "gemini-1.5-pro", "gemini-1.5-flash", "gemini-1.5-flash-8b", "gemini-2.0-flash",
    "gemini-2.0-flash-lite", "gemini-2.0-pro", "gemini-2.5-pro", "gemini-2.5-flash",
    "gemini-2.5-flash-lite",
})

# -- media ------------------------------------------------------------------------------------

# Google, "Understand and count tokens" (https://ai.google.dev/gemini-api/docs/tokens) and
# Vertex AI's "Image understanding": an image of at most 384 px a side is 258 tokens; a larger
# one is cut into tiles of min(width, height) / 1.5 px, kept within 256 to 768 px, each scaled
# to 768 x 768 and billed 258 tokens. The rule is documented for Gemini 1.5 to 2.5; any other
# model's image (Gemini 3 bills one by its media resolution) is held at the window.
IMAGE_TILE_MODELS = GEMINI_BEFORE_3
IMAGE_TOKENS_SMALL = 258
IMAGE_SMALL_PX_MAX = 384
IMAGE_TILE_TOKENS = 258
IMAGE_TILE_PX_MIN, IMAGE_TILE_PX_MAX = 256, 768
# Media resolution (generationConfig.mediaResolution, or a part's {"level": ...} on Gemini 3):
# Google names these levels (GenerationConfig.mediaResolution, https://ai.google.dev/api/
# generate-content#MediaResolution; https://ai.google.dev/gemini-api/docs/media-resolution). On
# the tiled models low is 64 tokens an image and medium 256, each within a tile's 258, so the
# tiles bound them; high is "256 + Pan & Scan (~2048)" (the media resolution page's "Token
# counts") and ultra high Gemini 3's, counts the tiles do not bound: an image asked for at
# either is held at the window.
MEDIA_RESOLUTIONS = frozenset({
    "MEDIA_RESOLUTION_UNSPECIFIED", "MEDIA_RESOLUTION_LOW", "MEDIA_RESOLUTION_MEDIUM",
    "MEDIA_RESOLUTION_HIGH", "MEDIA_RESOLUTION_ULTRA_HIGH",
})
MEDIA_RESOLUTIONS_BEYOND_TILES = frozenset({"MEDIA_RESOLUTION_HIGH",
                                            "MEDIA_RESOLUTION_ULTRA_HIGH"})
# An image's header is looked for in its first bytes only (a JPEG's frame header may follow
# metadata: EXIF thumbnails stay within 64 KiB).
IMAGE_HEADER_BYTES_MAX = 256 * 1_024
# Images Google takes whose size the gateway does not read (https://ai.google.dev/gemini-api/
# docs/image-understanding: PNG, JPEG, WebP, HEIC, HEIF): held at the window.
REFERRED_IMAGE_TYPES = frozenset({"image/heic", "image/heif"})
# Audio whose duration the gateway reads from its bytes (core/content.py), by MIME type.
AUDIO_FORMATS = {"audio/wav": "wav", "audio/x-wav": "wav", "audio/wave": "wav",
                 "audio/mp3": "mp3", "audio/mpeg": "mp3"}
# Media billed by a size its bytes do not bound cheaply: a video's duration (Google: 263 tokens
# a second), a PDF's pages (258 a page, up to 1,000 pages), other audio formats (32 a second).
# Held at the window, with the audio rate where the model has a dearer one.
REFERRED_MIME_PREFIXES = ("video/", "audio/", "application/pdf")
TEXT_MIME_PREFIX = "text/"


def _b64_head(data: str, field: str) -> bytes:
    chunk = data[:IMAGE_HEADER_BYTES_MAX // 3 * 4]
    try:
        return binascii.a2b_base64(chunk, strict_mode=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequest(f"{field} is not base64", field=field) from exc


def _jpeg_size(head: bytes) -> tuple[int, int] | None:
    pos = 2
    while pos + 9 <= len(head):
        if head[pos] != 0xFF:
            return None
        marker = head[pos + 1]
        if marker == 0xFF:  # fill bytes before a marker
            pos += 1
            continue
        length = int.from_bytes(head[pos + 2:pos + 4], "big")
        # Start-of-frame markers (baseline, progressive, lossless...): not DHT, JPG, DAC.
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            height, width = struct.unpack(">HH", head[pos + 5:pos + 9])
            return width, height
        pos += 2 + length
    return None


def image_size(data: str, field: str) -> tuple[int, int]:
    """An image's width and height, read from the header of base64 `data` (PNG, JPEG, WebP,
    the kinds Google takes but HEIC and HEIF); InputUnbounded for another kind or a header it
    cannot read."""
    head = _b64_head(data, field)
    size: tuple[int, int] | None = None
    if head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR":
        size = struct.unpack(">II", head[16:24])
    elif head[:2] == b"\xff\xd8":
        size = _jpeg_size(head)
    elif head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        kind = head[12:16]
        if kind == b"VP8X":
            size = (int.from_bytes(head[24:27], "little") + 1,
                    int.from_bytes(head[27:30], "little") + 1)
        elif kind == b"VP8L" and len(head) >= 25:
            bits = int.from_bytes(head[21:25], "little")
            size = ((bits & 0x3FFF) + 1, (bits >> 14 & 0x3FFF) + 1)
        elif kind == b"VP8 " and len(head) >= 30:
            width, height = struct.unpack("<HH", head[26:30])
            size = (width & 0x3FFF, height & 0x3FFF)
    if size is None or not (size[0] > 0 and size[1] > 0):
        raise InputUnbounded(
            f"{field}: an image whose size cannot be read from its header (PNG, JPEG and WebP "
            "are read), so its tiles cannot be counted", field=field)
    return size


def image_tokens(width: int, height: int) -> int:
    """What Gemini 1.5 to 2.5 bill an image of this size as (IMAGE_TILE_MODELS)."""
    if width <= IMAGE_SMALL_PX_MAX and height <= IMAGE_SMALL_PX_MAX:
        return IMAGE_TOKENS_SMALL
    tile = min(max(min(width, height) * 2 // 3, IMAGE_TILE_PX_MIN), IMAGE_TILE_PX_MAX)
    return -(-width // tile) * -(-height // tile) * IMAGE_TILE_TOKENS


# -- thinking ---------------------------------------------------------------------------------

class ThinkingRange(NamedTuple):
    """A model's documented thinking: the budgets it takes and whether it thinks unasked."""

    most: int  # the largest budget, and what dynamic thinking (-1) may spend
    least: int  # the smallest positive budget; one below it may be raised to it
    by_default: bool  # thinks, dynamically, when the request says nothing


# Google, "Gemini thinking" (https://ai.google.dev/gemini-api/docs/thinking, "Set budgets"): each
# model's range of thinkingBudget and whether it thinks when the request says nothing. 2.5 Pro:
# 128 to 32,768, dynamic by default, cannot turn thinking off; 2.5 Flash: 0 to 24,576, dynamic by
# default; 2.5 Flash-Lite: 512 to 24,576 (0 turns it off), no thinking by default; -1 is dynamic
# thinking on each, the model deciding how much within its range. What a budget below the range
# does Google does not document (refused, or raised to the range's least): unknown means held, so
# a positive budget is held at least at the range's least. Gemini 3 takes thinkingLevel (high by
# default) and publishes no token figure for a level: held at the model's output limit (65,536),
# the most one call writes. 2.0 models do not think. A version of a model here
# (gemini-2.5-pro-preview-06-05) takes its rule (gemini_family); any other model, whatever its
# name begins with, is held at the budget its request gives, and refused without one.
GEMINI_THINKING: dict[str, ThinkingRange] = {
    "gemini-2.0-flash": ThinkingRange(0, 0, False),
    "gemini-2.0-flash-lite": ThinkingRange(0, 0, False),
    "gemini-2.5-pro": ThinkingRange(32_768, 128, True),
    "gemini-2.5-flash": ThinkingRange(24_576, 0, True),
    "gemini-2.5-flash-lite": ThinkingRange(24_576, 512, False),
    "gemini-3-pro-preview": ThinkingRange(65_536, 0, True),
    "gemini-3-flash-preview": ThinkingRange(65_536, 0, True),
}
# The largest least any known model has (Flash-Lite's 512): a clamp splits its cap without the
# model at hand, so a budget it sets is 0 or at least this, never one a model may raise.
THINKING_LEAST_MAX = max(rule.least for rule in GEMINI_THINKING.values())
