"""Content bounds: text by its bytes, images counted by detail, audio by its duration, and every
input the request only names refused with the field that names it."""

from __future__ import annotations

import base64
import io
import struct
import wave
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.content import (
    MP3_BYTES_PER_S_MIN,
    NO_MEDIA,
    ImageBound,
    Media,
    audio_input_tokens_per_s,
    audio_ms_max,
    image_bound,
)
from core.errors import InputUnbounded, InvalidRequest
from core.formats.chat import chat_input
from core.formats.messages import messages_input
from core.formats.responses import responses_input
from tests.support import examples

# 1 MB of base64 "image": as text it would be ~1.3 million tokens.
BIG_PNG = "data:image/png;base64," + "A" * 1_300_000


def wav(seconds: float, rate: int = 16_000, channels: int = 1, width: int = 2) -> str:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(b"\0" * int(seconds * rate) * channels * width)
    return base64.b64encode(out.getvalue()).decode()


def user(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def image(url: str = "https://example.com/cat.png", **fields: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **fields}}


def audio(data: str, audio_format: str = "wav") -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": data, "format": audio_format}}


def refused(messages: Any) -> str:
    with pytest.raises(InputUnbounded) as info:
        chat_input(messages)
    assert info.value.code == "input_unbounded"
    return str(info.value.details["field"])


# -- the bundled per-model rules ------------------------------------------------------------------


def test_image_bounds_are_the_documented_maxima() -> None:
    # Tile models: base, and base + 8 tiles (a 768 x 2048 image) at high detail.
    assert image_bound("gpt-4o") == image_bound("GPT-4o-2024-08-06")
    assert (image_bound("gpt-4o").low_tokens, image_bound("gpt-4o").high_tokens) == (
        85, 85 + 170 * 8)  # type: ignore[union-attr]
    mini = image_bound("gpt-4o-mini")
    assert mini is not None
    assert (mini.low_tokens, mini.high_tokens) == (2_833, 48_169)
    o3 = image_bound("o3")
    assert o3 is not None
    assert o3.high_tokens == 75 + 150 * 8 == 1_275
    # Patch models: 1,536 patches times the multiplier, rounded up, at any detail.
    for model, tokens in (("gpt-4.1-mini", 2_489), ("o4-mini", 2_642), ("gpt-4.1-nano", 3_779)):
        bound = image_bound(model)
        assert bound is not None
        assert (bound.low_tokens, bound.high_tokens) == (tokens, tokens)
    # Claude (Anthropic's area rule): 784 x 1,568 px / 750 = 1,639.08 tokens, the largest an
    # image is billed as once scaled; a dated snapshot follows its model.
    for model in ("claude-sonnet-4-5", "claude-sonnet-4-5-20250929", "claude-3-5-haiku-20241022",
                  "claude-opus-4-1"):
        assert image_bound(model) == ImageBound(1_640, 1_640), model
    # Models with no documented rule, or a look-alike of a model that has one: no bound. Later
    # Claude models read larger images than the area rule above allows.
    for model in ("gpt-4o-audio-preview", "gpt-5.1", "claude-opus-4-7", "gpt-4o-mini-x",
                  "claude-sonnet-4-5-x"):
        assert image_bound(model) is None


def test_audio_rates_are_the_documented_ones() -> None:
    assert audio_input_tokens_per_s("gpt-audio") == 10
    assert audio_input_tokens_per_s("gpt-4o-audio-preview-2025-06-03") == 10
    assert audio_input_tokens_per_s("gemini-2.5-flash") == 32
    assert audio_input_tokens_per_s("gpt-4o") is None


# -- text and images ------------------------------------------------------------------------------


def test_text_is_bounded_by_its_bytes_and_a_base64_image_is_not_text() -> None:
    short = chat_input([{"role": "user", "content": "hi"}])
    longer = chat_input([{"role": "user", "content": "hi" * 100}])
    assert 0 < short.text_tokens < longer.text_tokens
    assert longer.text_tokens >= 200
    assert short.media is NO_MEDIA
    bound = chat_input(user(text("what is this?"), image(BIG_PNG)))
    assert bound.text_tokens < 200  # the framing of two parts, not the megabyte
    assert bound.media == Media(images_high=1, image_field="messages[0].content[1].image_url.url")


@pytest.mark.parametrize(("detail", "low", "high"), [
    ("low", 1, 0), ("high", 0, 1), ("auto", 0, 1), (None, 0, 1)])
def test_each_image_counts_at_its_detail_and_auto_counts_as_high(
    detail: str | None, low: int, high: int
) -> None:
    part = image() if detail is None else image(detail=detail)
    media = chat_input(user(part, part)).media
    assert (media.images_low, media.images_high) == (2 * low, 2 * high)


def test_an_image_url_counts_whatever_its_length_and_a_bare_url_string_too() -> None:
    url = "https://example.com/" + "x" * 5_000
    media = chat_input(user({"type": "image_url", "image_url": url})).media
    assert media.images_high == 1


@pytest.mark.parametrize(("part", "field"), [
    (image(detail="original"), "messages[0].content[0].image_url.detail"),
    (image("data:application/pdf;base64,JVBERi0="), "messages[0].content[0].image_url.url"),
    (image(file_id="file-1"), "messages[0].content[0].image_url.file_id"),
    ({"type": "image_url", "image_url": 7}, "messages[0].content[0].image_url"),
    ({"type": "video_url", "video_url": {"url": "https://x/v.mp4"}}, "messages[0].content[0]"),
    ("a bare string part", "messages[0].content[0]"),
    ({"type": ["text"], "text": "x"}, "messages[0].content[0].type"),
])
def test_parts_the_gateway_cannot_bound_are_refused_by_name(part: Any, field: str) -> None:
    assert refused(user(part)) == field


@pytest.mark.parametrize("part", [
    {"type": "file", "file": {"file_id": "file-1"}},
    {"type": "file", "file": {"file_data": "JVBERi0=" * 10_000, "filename": "a.pdf"}},
])
def test_a_file_is_noted_as_referred_input_its_payload_not_counted(part: Any) -> None:
    bound = chat_input(user(part))
    assert bound.media.referred_field == "messages[0].content[0].file"
    assert bound.text_tokens < 100


def test_the_field_is_named_where_it_is() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "user", "content": [text("see"), {"type": "file", "file": {"file_id": "f"}}]},
        {"role": "user", "content": [{"type": "file", "file": {"file_id": "g"}}]},
    ]
    assert chat_input(messages).media.referred_field == "messages[2].content[1].file"


def test_an_earlier_audio_answer_by_id_and_content_of_no_known_shape_are_refused() -> None:
    assert refused([{"role": "assistant", "audio": {"id": "audio_1"}}]) == "messages[0].audio"
    assert refused([{"role": "user", "content": {"type": "text", "text": "x"}}]) == (
        "messages[0].content")


def test_messages_must_be_a_list_of_objects_of_valid_text() -> None:
    for bad in ([], "hello", [1], None, [{"role": "user"}] * 10_001):
        with pytest.raises(InvalidRequest):
            chat_input(bad)
    with pytest.raises(InvalidRequest):
        chat_input([{"role": "user", "content": "\ud800"}])


# -- audio ------------------------------------------------------------------------------------


def test_a_wav_clip_is_bounded_by_its_header() -> None:
    clip = wav(2.0)  # 16 kHz, mono, 16-bit: 32,000 bytes a second
    assert len(base64.b64decode(clip)) == 44 + 64_000
    # 64,044 bytes (header included) / 32,000 bytes a second = 2.001375 s, rounded up.
    assert audio_ms_max(clip, "wav", "a") == 2_002
    media = chat_input(user(text("transcribe"), audio(clip))).media
    assert (media.audio_ms, media.audio_field) == (2_002, "messages[0].content[1].input_audio")
    # Padded base64: 3,244 bytes (0.1 s and the header) are 4,328 characters, counted as
    # 4,328 / 4 x 3 = 3,246 bytes, the padding included: 101.4 ms, rounded up.
    assert audio_ms_max(wav(0.1), "wav", "a") == 102
    # 8 kHz, 8-bit: 8,000 bytes a second, so the same bytes are four times as long.
    assert audio_ms_max(wav(1.0, rate=8_000, width=1), "wav", "a") == -(-8_044 * 1_000 // 8_000)


def test_an_mp3_clip_is_bounded_at_the_lowest_bitrate() -> None:
    frame = bytes([0xFF, 0xFB, 0x90, 0x64])  # MPEG-1 Layer III, 128 kbit/s, 44.1 kHz
    tag = b"ID3\x04\x00\x00" + bytes([0, 0, 1, 0]) + b"\0" * 128  # a 128-byte ID3v2 tag
    data = base64.b64encode(tag + frame + b"\0" * 9_857).decode()
    # 9,999 bytes (138 of tag, 4 of frame header; a multiple of 3, so base64 pads nothing) at
    # 995 bytes a second (8 kbit/s frames at 11,025 Hz, unpadded): 10.04925 s, rounded up.
    assert MP3_BYTES_PER_S_MIN == 995
    assert audio_ms_max(data, "mp3", "a") == 10_050


def test_the_smallest_mp3_frames_are_within_the_bound() -> None:
    # MPEG-2.5 Layer III, 8 kbit/s, 11,025 Hz, no padding: 72 x 8,000 / 11,025 = 52.2, so every
    # decoder reads 52-byte frames of 576 samples. 1,000 frames are 52,000 bytes of 52.245 s.
    frames = (bytes([0xFF, 0xE3, 0x10, 0xC0]) + bytes(48)) * 1_000
    seconds = 1_000 * 576 / 11_025
    assert audio_ms_max(base64.b64encode(frames).decode(), "mp3", "a") >= seconds * 1_000


@pytest.mark.parametrize(("data", "audio_format", "field"), [
    (base64.b64encode(bytes([0xFF, 0xFB, 0x04, 0x64]) + b"\0" * 96).decode(), "mp3",
     "a.data"),  # free format: no lowest bitrate
    (base64.b64encode(b"\0" * 100).decode(), "mp3", "a.data"),
    (base64.b64encode(b"RIFF\0\0\0\0WAVEdata" + b"\0" * 100).decode(), "wav", "a.data"),
    (wav(1.0), "flac", "a.format"),
])
def test_audio_whose_duration_cannot_be_read_is_refused(
    data: str, audio_format: str, field: str
) -> None:
    with pytest.raises(InputUnbounded) as info:
        audio_ms_max(data, audio_format, "a")
    assert info.value.details["field"] == field


def test_a_wav_header_whose_fields_disagree_is_refused() -> None:
    raw = bytearray(base64.b64decode(wav(1.0)))
    struct.pack_into("<I", raw, 28, 1_000_000)  # byte rate: a much shorter clip
    with pytest.raises(InputUnbounded):
        audio_ms_max(base64.b64encode(bytes(raw)).decode(), "wav", "a")
    raw = bytearray(base64.b64decode(wav(1.0)))
    struct.pack_into("<H", raw, 20, 2)  # ADPCM, not PCM
    with pytest.raises(InputUnbounded):
        audio_ms_max(base64.b64encode(bytes(raw)).decode(), "wav", "a")


def test_a_wav_whose_readers_could_disagree_on_its_length_is_refused() -> None:
    raw = base64.b64decode(wav(1.0))
    fmt = raw[12:36]  # 'fmt ', its size, its 16 bytes
    slow = fmt[:8] + struct.pack("<HHIIHH", 1, 1, 8_000, 8_000, 1, 8)  # 4 x as long
    # A second format chunk before the samples: the first is read here, the last by some.
    two = raw[:36] + slow + raw[36:]
    # The samples before their format chunk; a format chunk and no samples in the header.
    late = raw[:12] + b"data" + struct.pack("<I", 4) + bytes(4) + raw[12:]
    far = raw[:36] + b"JUNK" + struct.pack("<I", 8_000) + bytes(8_000) + raw[36:]
    for clip in (two, late, far):
        with pytest.raises(InputUnbounded):
            audio_ms_max(base64.b64encode(clip).decode(), "wav", "a")
    # Chunks after the samples are not walked: readers take the format that precedes them.
    tail = raw + slow
    assert audio_ms_max(base64.b64encode(tail).decode(), "wav", "a") == -(
        -len(tail) * 1_000 // 32_000)


def test_audio_that_is_not_base64_or_not_from_the_user_is_refused() -> None:
    with pytest.raises(InvalidRequest):
        audio_ms_max("not base64!", "wav", "a")
    assert refused([{"role": "assistant", "content": [audio(wav(0.1))]}]) == (
        "messages[0].content[0]")
    assert refused(user({"type": "input_audio", "input_audio": {
        "data": wav(0.1), "format": "wav", "url": "https://x"}})) == (
        "messages[0].content[0].input_audio")


# -- the Responses API ----------------------------------------------------------------------------


def test_responses_input_takes_a_string_messages_and_function_calls() -> None:
    assert responses_input("hi").text_tokens == chat_input(
        [{"role": "user", "content": "hi"}]).text_tokens
    bound = responses_input([
        {"role": "user", "content": [
            {"type": "input_text", "text": "what is this?"},
            {"type": "input_image", "image_url": BIG_PNG, "detail": "low"}]},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "a cat", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_image", "image_url": "https://example.com/x.png"}]},
    ])
    assert bound.text_tokens < 600
    assert bound.media == Media(images_low=1, images_high=1,
                                image_field="input[0].content[1].image_url")


def test_an_image_stored_with_the_provider_is_held_at_the_per_image_bound() -> None:
    items = [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]
    assert responses_input(items).media == Media(images_high=1,
                                                 image_field="input[0].content[0].file_id")


@pytest.mark.parametrize(("items", "field"), [
    ([{"role": "user", "content": [{"type": "input_file", "file_url": "https://x/a.pdf"}]}],
     "input[0].content[0]"),
    ([{"role": "user", "content": "hi"}, {"type": "item_reference", "id": "msg_1"}], "input[1]"),
    ([{"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "E" * 50_000}],
     "input[0]"),
    ([{"type": "reasoning", "id": "rs_1", "summary": []}], "input[0]"),
    ([{"type": "web_search_call", "id": "ws_1", "status": "completed"}], "input[0]"),
    ([{"type": "compaction", "encrypted_content": "E"}], "input[0]"),
])
def test_responses_input_it_only_refers_to_is_noted_its_payload_not_counted(
    items: list[dict[str, Any]], field: str
) -> None:
    bound = responses_input(items)
    assert bound.media.referred_field == field
    assert bound.text_tokens < 100


@pytest.mark.parametrize(("items", "field"), [
    ([{"type": "mcp_approval_response", "approve": True}], "input[0]"),
    ([{"type": "brand_new_item", "id": "x"}], "input[0]"),
    ([{"type": {"a": 1}, "content": "x"}], "input[0].type"),
    ([{"content": "no role, no type"}], "input[0].type"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/a.png",
                                    "detail": "original"}]}], "input[0].content[0].detail"),
])
def test_responses_input_it_cannot_bound_is_refused_by_name(
    items: list[dict[str, Any]], field: str
) -> None:
    with pytest.raises(InputUnbounded) as info:
        responses_input(items)
    assert info.value.details["field"] == field


# -- properties -----------------------------------------------------------------------------------

TEXTS = st.text(max_size=40)
PARTS = st.one_of(
    TEXTS.map(text),
    st.sampled_from(["low", "high", "auto"]).map(lambda d: image(BIG_PNG[:200], detail=d)),
)


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["user", "system", "assistant"]),
                          st.one_of(TEXTS, st.lists(PARTS, max_size=4))), min_size=1, max_size=5))
def test_the_text_bound_covers_every_byte_of_text_and_counts_every_image(
    messages: list[tuple[str, Any]],
) -> None:
    docs = [{"role": role, "content": content} for role, content in messages]
    bound = chat_input(docs)
    texts = [c for _, c in messages if isinstance(c, str)] + [
        p["text"] for _, c in messages if isinstance(c, list) for p in c if p["type"] == "text"]
    assert bound.text_tokens >= sum(len(t.encode()) for t in texts)
    images = sum(1 for _, c in messages if isinstance(c, list) for p in c
                 if p["type"] == "image_url")
    assert bound.media.images_low + bound.media.images_high == images


# -- Anthropic's Messages API -------------------------------------------------------------------


def anthropic_image(source: dict[str, Any]) -> dict[str, Any]:
    return {"type": "image", "source": source}


def test_messages_text_is_bounded_by_its_bytes_and_images_are_counted_not_read() -> None:
    text = messages_input([{"role": "user", "content": "hello"}])
    assert text.media is NO_MEDIA
    assert text.text_tokens > len(b"hello")
    payload = "A" * 1_000_000
    sources = [{"type": "base64", "media_type": "image/png", "data": payload},
               {"type": "url", "url": "https://example.com/cat.png"},
               {"type": "file", "file_id": "file_011"}]
    bound = messages_input(user(*(anthropic_image(s) for s in sources),
                                {"type": "text", "text": "what are these?"}))
    assert bound.media.images_high == 3
    assert bound.media.image_field == "messages[0].content[0].source"
    assert bound.text_tokens < 1_000  # the payload is not text
    # Inside a tool's result and a content document too.
    nested = messages_input(user(
        {"type": "tool_result", "tool_use_id": "t1", "content": [anthropic_image(sources[1])]},
        {"type": "document", "source": {"type": "content", "content": [
            {"type": "text", "text": "page"}, anthropic_image(sources[0])]}}))
    assert nested.media.images_high == 2
    assert nested.media.image_field == "messages[0].content[0].content[0].source"


def test_messages_turns_sent_back_are_text_bounded_by_all_their_bytes() -> None:
    turns = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "x" * 5_000}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": "sunny"}]},
    ]
    bound = messages_input(turns)
    assert bound.media is NO_MEDIA
    assert bound.text_tokens > 5_000


@pytest.mark.parametrize("block", [
    {"type": "thinking", "thinking": "", "signature": "S" * 50},
    {"type": "redacted_thinking", "data": "R" * 50},
])
def test_thinking_sent_back_is_counted_by_blocks_not_its_text(block: Any) -> None:
    """Billed as the thinking its signature carries, which neither the text it shows (a summary,
    or nothing under display: omitted) nor its bytes are documented to bound: counted, to be
    held at the model's output maximum a block (core/prices/)."""
    turns = [{"role": "user", "content": "weather?"},
             {"role": "assistant", "content": [block, block, {"type": "tool_use", "id": "t1",
                                                              "name": "weather", "input": {}}]}]
    media = messages_input(turns).media
    assert (media.thinking_blocks, media.thinking_field) == (2, "messages[1].content[0]")
    assert not media.referred_field


@pytest.mark.parametrize(("block", "field"), [
    ({"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                     "data": "JVBERi0=" * 10_000}},
     "messages[0].content[0].source"),
    ({"type": "document", "source": {"type": "url", "url": "https://example.com/a.pdf"}},
     "messages[0].content[0].source"),
    ({"type": "document", "source": {"type": "file", "file_id": "file_1"}},
     "messages[0].content[0].source"),
    ({"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"},
      "citations": {"enabled": True}}, "messages[0].content[0].citations"),
    ({"type": "container_upload", "file_id": "file_1"}, "messages[0].content[0]"),
    ({"type": "mcp_tool_result", "tool_use_id": "m1", "content": "x"}, "messages[0].content[0]"),
    ({"type": "tool_result", "tool_use_id": "t1", "content": [
        {"type": "document", "source": {"type": "file", "file_id": "f"}}]},
     "messages[0].content[0].content[0].source"),
])
def test_messages_input_the_request_only_refers_to_is_noted(block: Any, field: str) -> None:
    bound = messages_input(user(block))
    assert bound.media.referred_field == field
    assert bound.text_tokens < 200


@pytest.mark.parametrize(("block", "field"), [
    ({"type": "image", "source": {"type": "base64", "media_type": "application/pdf",
                                  "data": "JVBERi0="}},
     "messages[0].content[0].source.media_type"),
    ({"type": "document", "source": {"type": "video", "url": "x"}},
     "messages[0].content[0].source"),
    ({"type": "brand_new_block"}, "messages[0].content[0]"),
])
def test_messages_input_nothing_bounds_is_refused(block: Any, field: str) -> None:
    with pytest.raises(InputUnbounded) as refused:
        messages_input(user(block))
    assert refused.value.details["field"] == field


def test_messages_text_documents_are_text() -> None:
    data = "x" * 10_000
    bound = messages_input(user({"type": "document", "title": "a",
                                 "source": {"type": "text", "media_type": "text/plain",
                                            "data": data}}))
    assert bound.media is NO_MEDIA
    assert bound.text_tokens > len(data)
