"""The Gemini API's wire format: what a request is held at, what it refuses, how an answer's and
a stream's usage are read, and its errors' shape. Worst cases are worked out by hand from the
bundled rates (genai-prices, provider google), in micro-dollars per token:

  gemini-2.5-pro    input 1.25 (2.5 above 200K prompt tokens), output 10 (15), cached 0.125
  gemini-2.5-flash  input 0.30, audio input 1.00, output 2.50; window 1,048,576
  gemini-3-pro-preview  input 2 (4), output 12 (18), a search query 14,000
  a grounded prompt on 2.5: 35,000
"""

from __future__ import annotations

import base64
import json
import math
import struct
from fractions import Fraction
from typing import Any

import pytest

from api.errors import STATUS
from core.content import audio_ms_max, json_bytes
from core.errors import FieldUnsupported, InputUnbounded, InvalidRequest, ModelUnbounded
from core.formats import FORMATS, UNROUTED, Api, StreamTally
from core.formats.gemini import (
    BUDGET_PATH,
    CAP_PATH,
    GEMINI,
    GEMINI_STREAM,
    GOOGLE_STATUSES,
    Gemini,
    check_model_id,
)
from core.formats.gemini_tokens import image_size, image_tokens
from core.prices import PriceTable, Usage
from core.prices.bundled import gemini_limits

TABLE = PriceTable()
WINDOW = 1_048_576
CAP_DEFAULT = 4_096
PRO, FLASH, LITE, G3 = ("gemini-2.5-pro", "gemini-2.5-flash", "gemini-2.5-flash-lite",
                        "gemini-3-pro-preview")


def held(plan: Any) -> int:
    spec = plan.spec()
    return TABLE.worst_case_micros(spec.model, spec.input_tokens, spec.output_tokens_max,
                                   spec.choices, media=spec.media,
                                   service_tier=spec.service_tier, provider=spec.provider)


def micros(*terms: tuple[int, str]) -> int:
    """Tokens times rates (USD per 1M tokens = micro-dollars a token), rounded up once."""
    return math.ceil(sum(Fraction(tokens) * Fraction(rate) for tokens, rate in terms))


def user(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "parts": list(parts)}


def body(*parts: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"contents": [user(*(parts or ({"text": "hi"},)))], **fields}


def plan(given: dict[str, Any], model: str = PRO, wire: Gemini = GEMINI) -> Any:
    return wire.plan(given, model, (), CAP_DEFAULT)


def text_bound(given: dict[str, Any]) -> int:
    """The body's bound as forwarded: every turn's JSON and 4 tokens, and the other fields."""
    turns = given["contents"]
    return (sum(4 + json_bytes(t) for t in turns)
            + json_bytes({k: v for k, v in given.items() if k != "contents"}))


def png(width: int, height: int) -> str:
    head = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + struct.pack(
        ">II", width, height) + b"\x08\x02\x00\x00\x00" + b"\x00" * 4
    return base64.b64encode(head + b"\x00" * 64).decode()


def wav(seconds: int, rate: int = 16_000) -> str:
    samples = b"\x00\x00" * rate * seconds
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    riff = (b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data"
            + struct.pack("<I", len(samples)) + samples)
    return base64.b64encode(b"RIFF" + struct.pack("<I", len(riff)) + riff).decode()


def inline(mime: str, data: str) -> dict[str, Any]:
    return {"inlineData": {"mimeType": mime, "data": data}}


# -- hostile requests first ------------------------------------------------------------------


def test_a_tiny_body_referring_to_cached_content_is_held_at_the_window() -> None:
    given = body(cachedContent="cachedContents/huge",
                 generationConfig={"maxOutputTokens": 100})
    call = plan(given)
    assert call.media.referred_field == "cachedContent"
    # A window above 200K: the long-context rates, input and output; thinking on top of the cap.
    assert held(call) == micros((WINDOW, "2.5"), (100 + 32_768, "15"))


def test_a_file_by_uri_is_held_at_the_window_at_the_audio_rate_too() -> None:
    # The request cannot show what the file is: on a model whose audio is dearer than text,
    # the window is held at the audio rate.
    given = body({"text": "what is in it?"},
                 {"fileData": {"mimeType": "text/plain", "fileUri": "files/abc"}},
                 generationConfig={"maxOutputTokens": 100, "thinkingConfig": {
                     "thinkingBudget": 0}})
    call = plan(given, FLASH)
    assert call.media.referred_field == "contents[0].parts[1].fileData"
    assert held(call) == micros((WINDOW, "1"), (100, "2.5"))


@pytest.mark.parametrize("tool", ["urlContext", "codeExecution"])
def test_tools_that_feed_input_the_request_does_not_show_are_held_at_the_window(
        tool: str) -> None:
    call = plan(body(tools=[{tool: {}}], generationConfig={"maxOutputTokens": 10}))
    assert call.media.referred_field == f"tools[0].{tool}"
    assert held(call) == micros((WINDOW, "2.5"), (10 + 32_768, "15"))


def test_every_candidate_is_held() -> None:
    given = body(generationConfig={"maxOutputTokens": 1_000, "candidateCount": 8})
    call = plan(given)
    assert call.choices == 8
    assert held(call) == micros((text_bound(given), "1.25"), (8 * (1_000 + 32_768), "10"))
    with pytest.raises(InvalidRequest) as refused:
        plan(body(generationConfig={"candidateCount": 9}))
    assert refused.value.details["field"] == "generationConfig.candidateCount"


def test_a_snake_case_thinking_config_as_google_genai_sends_it_is_read_and_sent_camel_case(
        ) -> None:
    """google-genai sends thinkingConfig's fields as snake_case; Google takes both."""
    priced = plan(body(generationConfig={"maxOutputTokens": 100, "thinkingConfig": {
        "thinking_budget": 500, "include_thoughts": True}}), FLASH)
    assert priced.output_tokens_max == 600
    assert priced.body["generationConfig"]["thinkingConfig"] == {
        "thinkingBudget": 500, "includeThoughts": True}
    with pytest.raises(InputUnbounded):
        plan(body(generationConfig={"thinkingConfig": {"thinking_budget": 24_577}}), FLASH)
    with pytest.raises(InvalidRequest):
        plan(body(generationConfig={"thinkingConfig": {"thinking_budget": 5,
                                                       "thinkingBudget": 5}}), FLASH)


def test_a_thinking_budget_above_the_models_is_refused_by_name() -> None:
    with pytest.raises(InputUnbounded) as refused:
        plan(body(generationConfig={"thinkingConfig": {"thinkingBudget": 24_577}}), FLASH)
    assert refused.value.details["field"] == BUDGET_PATH
    assert "24576" in refused.value.message.replace(",", "")
    # At the model's most, it is held.
    call = plan(body(generationConfig={"maxOutputTokens": 10,
                                       "thinkingConfig": {"thinkingBudget": 24_576}}), FLASH)
    assert call.output_tokens_max == 10 + 24_576


def test_grounding_per_query_without_a_bound_is_refused_naming_the_setting() -> None:
    call = plan(body(tools=[{"googleSearch": {}}]), G3)
    assert call.media.web_search_field == "tools[0].googleSearch"
    with pytest.raises(ModelUnbounded) as refused:
        held(call)
    assert "web_searches_max" in refused.value.message
    assert refused.value.details["component"] == "web_search"


def test_grounding_per_prompt_is_one_fee_and_its_results_held_at_the_window() -> None:
    given = body(tools=[{"googleSearch": {}}], generationConfig={"maxOutputTokens": 10})
    call = plan(given, PRO)
    assert call.media.web_searches == 1
    # Two steps (before and after the search), each reading at most the window; the fee once.
    assert held(call) == 35_000 + micros((2 * WINDOW, "2.5"), (10 + 32_768, "15"))


def test_grounding_per_query_with_a_prices_file_bound_holds_that_many(tmp_path: Any) -> None:
    path = tmp_path / "prices.json"
    path.write_text(json.dumps({"models": {G3: {
        "input_usd_per_mtok": "2", "output_usd_per_mtok": "12",
        "usd_per_web_search": "0.014", "web_searches_max": 3,
        "context_window_tokens": 100_000}}}))
    table = PriceTable.from_file(str(path))
    call = plan(body(tools=[{"googleSearch": {}}], generationConfig={"maxOutputTokens": 10,
                "thinkingConfig": {"thinkingLevel": "low"}}), G3)
    spec = call.spec()
    assert table.worst_case_micros(spec.model, spec.input_tokens, spec.output_tokens_max,
                                   media=spec.media, provider=spec.provider) == (
        3 * 14_000 + micros((4 * 100_000, "2"), (10 + 65_536, "12")))


@pytest.mark.parametrize(("given", "field"), [
    ({"contents": [user({"text": "x"})], "generation_config": {}}, "generation_config"),
    ({"contents": [user({"text": "x"})], "model": "models/gemini-2.5-pro"}, "model"),
])
def test_unknown_top_level_fields_are_refused(given: dict[str, Any], field: str) -> None:
    with pytest.raises(FieldUnsupported) as refused:
        GEMINI.check_fields(given, frozenset())
    assert refused.value.details["field"] == field


@pytest.mark.parametrize(("given", "field"), [
    (body(generationConfig={"speechConfig": {}}), "generationConfig.speechConfig"),
    (body(generationConfig={"max_output_tokens": 5}), "generationConfig.max_output_tokens"),
    (body({"inline_data": {"mimeType": "image/png", "data": "AA=="}}),
     "contents[0].parts[0].inline_data"),
    (body(tools=[{"googleMaps": {}}]), "tools[0].googleMaps"),
    (body(tools=[{"functionDeclarations": [], "enterpriseWebSearch": {}}]),
     "tools[0].enterpriseWebSearch"),
    (body(inline("application/zip", "AAAA")), "contents[0].parts[0].inlineData.mimeType"),
    ({"contents": [{"role": "user", "parts": [], "extra": 1}]}, "contents[0].extra"),
])
def test_unknown_nested_fields_parts_tools_and_kinds_are_refused(
        given: dict[str, Any], field: str) -> None:
    with pytest.raises(InputUnbounded) as refused:
        plan(given)
    assert refused.value.details["field"] == field


@pytest.mark.parametrize("model", ["../tunedModels/x", "gemini-2.5-pro:countTokens",
                                   "gemini?key=x", "gemini/../x", "Gemini-2.5-Pro", "",
                                   "a" * 129, "gemini%2F"])
def test_a_model_id_that_could_leave_its_path_segment_is_refused(model: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        plan(body(), model)
    assert refused.value.details["field"] == "model"
    assert check_model_id("gemini-2.5-flash-preview-09-2025") == (
        "gemini-2.5-flash-preview-09-2025")


def test_audio_or_image_output_is_refused() -> None:
    with pytest.raises(InvalidRequest) as refused:
        plan(body(generationConfig={"responseModalities": ["TEXT", "AUDIO"]}))
    assert refused.value.details["field"] == "generationConfig.responseModalities"
    plan(body(generationConfig={"responseModalities": ["TEXT"]}))


# -- what a request is held at ---------------------------------------------------------------


def test_text_is_held_by_its_bytes_with_the_default_cap_and_the_models_thinking() -> None:
    given = body({"text": "é" * 100}, systemInstruction={"parts": [{"text": "be brief"}]},
                 tools=[{"functionDeclarations": [{"name": "f", "description": "d" * 50}]}])
    call = plan(given)
    assert call.bounds_added == ((CAP_PATH, CAP_DEFAULT),)
    assert call.body["generationConfig"]["maxOutputTokens"] == CAP_DEFAULT
    system = 4 + json_bytes(given["systemInstruction"])
    rest = json_bytes({k: v for k, v in given.items()
                       if k not in ("contents", "systemInstruction")})
    assert call.text_tokens_max == 4 + json_bytes(given["contents"][0]) + system + rest
    assert call.output_tokens_max == CAP_DEFAULT + 32_768  # 2.5 Pro thinks dynamically
    assert held(call) == micros((call.text_tokens_max, "1.25"), (CAP_DEFAULT + 32_768, "10"))
    assert call.spec().provider == "google"
    assert not call.stream
    assert plan(body(), wire=GEMINI_STREAM).stream


def test_a_cap_given_is_kept_and_must_be_positive() -> None:
    call = plan(body(generationConfig={"maxOutputTokens": 50}))
    assert call.bounds_added == ()
    assert call.output_tokens_max == 50 + 32_768
    with pytest.raises(InvalidRequest) as refused:
        plan(body(generationConfig={"maxOutputTokens": 0}))
    assert refused.value.details["field"] == CAP_PATH


@pytest.mark.parametrize(("model", "thinking", "tokens"), [
    (LITE, None, 0),  # Flash-Lite does not think unless asked
    (LITE, {"thinkingBudget": -1}, 24_576),
    (LITE, {"includeThoughts": True}, 24_576),
    (LITE, {"includeThoughts": False}, 0),
    (FLASH, None, 24_576),  # dynamic by default: the model's most
    (FLASH, {"thinkingBudget": 0}, 0),
    (FLASH, {"thinkingBudget": 1_024, "includeThoughts": True}, 1_024),
    (PRO, {"thinkingBudget": -1}, 32_768),
    ("gemini-2.5-pro-preview-06-05", None, 32_768),  # a dated name: its family's rule
    (G3, {"thinkingLevel": "low"}, 65_536),  # no token figure for a level: the output limit
    (G3, None, 65_536),
    ("gemini-2.0-flash", None, 0),
    ("gemini-9-ultra", {"thinkingBudget": 500}, 500),  # unknown model, a budget given
])
def test_thinking_is_held_on_top_of_the_cap(model: str, thinking: dict[str, Any] | None,
                                            tokens: int) -> None:
    config: dict[str, Any] = {"maxOutputTokens": 100}
    if thinking is not None:
        config["thinkingConfig"] = thinking
    assert plan(body(generationConfig=config), model).output_tokens_max == 100 + tokens


@pytest.mark.parametrize(("model", "budget", "tokens"), [
    (PRO, 1, 128),  # 2.5 Pro: 128 to 32,768
    (PRO, 127, 128),
    (PRO, 128, 128),
    (PRO, 129, 129),
    (LITE, 1, 512),  # 2.5 Flash-Lite: 512 to 24,576
    (LITE, 511, 512),
    (LITE, 513, 513),
    ("gemini-2.5-flash-lite-preview-09-2025", 100, 512),  # a version: its family's least
    (FLASH, 1, 1),  # 2.5 Flash: 0 to 24,576
    (LITE, 0, 0),  # 0 turns thinking off where Google documents it
])
def test_a_budget_below_the_models_least_is_held_at_that_least(model: str, budget: int,
                                                              tokens: int) -> None:
    """A thinkingBudget Google documents a model as not taking (below its range) may be raised
    to the range's least: held there, so the bill of a raised budget stays within the hold."""
    given = body(generationConfig={"maxOutputTokens": 100,
                                   "thinkingConfig": {"thinkingBudget": budget}})
    assert plan(given, model).output_tokens_max == 100 + tokens


def test_thinking_without_a_documented_bound_or_given_twice_is_refused() -> None:
    with pytest.raises(InputUnbounded) as refused:
        plan(body(), "gemini-9-ultra")
    assert refused.value.details["field"] == BUDGET_PATH
    with pytest.raises(InvalidRequest):
        plan(body(generationConfig={"thinkingConfig": {"thinkingBudget": 10,
                                                       "thinkingLevel": "low"}}), G3)
    with pytest.raises(InvalidRequest):
        plan(body(generationConfig={"thinkingConfig": {"thinkingBudget": -2}}))


def test_a_prompt_above_200k_tokens_is_held_at_the_long_context_rates() -> None:
    given = body({"text": "a" * 210_000}, generationConfig={"maxOutputTokens": 10})
    call = plan(given)
    assert call.text_tokens_max > 200_000
    assert held(call) == micros((call.text_tokens_max, "2.5"), (10 + 32_768, "15"))


def test_images_by_googles_tiles_and_a_later_models_image_at_the_window() -> None:
    assert image_tokens(384, 384) == 258
    # Tiles of min side / 1.5 = 333 px: 4 x 2 of them.
    assert image_tokens(1_000, 500) == 8 * 258
    # A long thin image: tiles no smaller than 256 px.
    assert image_tokens(10_000, 300) == 40 * 2 * 258
    given = body({"text": "x"}, inline("image/png", png(1_000, 500)),
                 inline("image/png", png(100, 100)),
                 generationConfig={"maxOutputTokens": 10,
                                   "thinkingConfig": {"thinkingBudget": 0}})
    call = plan(given, FLASH)
    blanked = body({"text": "x"}, {"inlineData": {"mimeType": "image/png", "data": ""}},
                   {"inlineData": {"mimeType": "image/png", "data": ""}},
                   generationConfig=given["generationConfig"])
    assert call.text_tokens_max == text_bound(blanked) + 8 * 258 + 258
    assert held(call) == micros((call.text_tokens_max, "0.3"), (10, "2.5"))
    later = plan(body(inline("image/png", png(10, 10))), G3)
    assert later.media.referred_field == "contents[0].parts[0].inlineData"


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def test_image_sizes_are_read_from_png_jpeg_and_webp_headers() -> None:
    assert image_size(png(1_000, 500), "f") == (1_000, 500)
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00" + b"\x00" * 9
    sof0 = b"\xff\xc0" + struct.pack(">HBHH", 17, 8, 600, 800) + b"\x00" * 10
    assert image_size(b64(b"\xff\xd8" + app0 + sof0 + b"\x00" * 16), "f") == (800, 600)
    vp8x = (b"VP8X" + struct.pack("<I", 10) + b"\x00" * 4 + (1_999).to_bytes(3, "little")
            + (999).to_bytes(3, "little"))
    assert image_size(b64(b"RIFF" + struct.pack("<I", 30) + b"WEBP" + vp8x), "f") == (
        2_000, 1_000)
    bits = (300 - 1) | (200 - 1) << 14
    vp8l = b"VP8L" + struct.pack("<I", 5) + b"\x2f" + struct.pack("<I", bits)
    assert image_size(b64(b"RIFF" + struct.pack("<I", 30) + b"WEBP" + vp8l + b"\x00" * 8),
                      "f") == (300, 200)


def test_an_image_whose_size_cannot_be_read_is_refused_or_held_at_the_window() -> None:
    junk = base64.b64encode(b"GIF89a" + b"\x01\x00\x01\x00" + b"\x00" * 64).decode()
    with pytest.raises(InputUnbounded) as refused:
        plan(body(inline("image/gif", junk)), FLASH)
    assert refused.value.details["field"] == "contents[0].parts[0].inlineData.data"
    heic = plan(body(inline("image/heic", junk)), FLASH)
    assert heic.media.referred_field == "contents[0].parts[0].inlineData"


def test_audio_by_its_duration_at_the_audio_rate() -> None:
    data = wav(2)
    given = body(inline("audio/wav", data), generationConfig={
        "maxOutputTokens": 10, "thinkingConfig": {"thinkingBudget": 0}})
    call = plan(given, FLASH)
    ms = audio_ms_max(data, "wav", "x")
    assert 2_000 <= ms < 2_100
    assert call.media.audio_ms == ms
    audio_tokens = -(-ms * 32 // 1_000)
    blanked = body({"inlineData": {"mimeType": "audio/wav", "data": ""}},
                   generationConfig=given["generationConfig"])
    assert held(call) == micros((text_bound(blanked), "0.3"), (audio_tokens, "1"), (10, "2.5"))


@pytest.mark.parametrize("mime", ["video/mp4", "application/pdf", "audio/ogg"])
def test_media_its_bytes_do_not_bound_is_held_at_the_window(mime: str) -> None:
    call = plan(body(inline(mime, "AAAA")), FLASH)
    assert call.media.referred_field == "contents[0].parts[0].inlineData"


def test_a_text_file_by_its_decoded_bytes() -> None:
    data = base64.b64encode(b"x" * 3_000).decode()
    call = plan(body(inline("text/plain", data)))
    blanked = body({"inlineData": {"mimeType": "text/plain", "data": ""}},
                   generationConfig=call.body["generationConfig"])
    assert call.text_tokens_max == text_bound(blanked) + 3_000


def test_a_thought_signature_sent_back_is_held_at_the_models_output_limit() -> None:
    given = {"contents": [user({"text": "q"}), {"role": "model", "parts": [
        {"functionCall": {"name": "f", "args": {}}, "thoughtSignature": "c2ln" * 10}]},
        user({"functionResponse": {"name": "f", "response": {"ok": True}}})],
        "generationConfig": {"maxOutputTokens": 10}}
    call = plan(given, PRO)
    assert call.media.thinking_blocks == 1
    assert call.media.thinking_field == "contents[1].parts[0].thoughtSignature"
    # 65,536 more input tokens: above 200K? No: the long-context rates stay off.
    assert held(call) == micros((call.text_tokens_max + 65_536, "1.25"), (10 + 32_768, "10"))


# -- the clamp, countTokens ------------------------------------------------------------------


def test_a_clamped_body_keeps_the_cap_and_thinking_within_the_clamp() -> None:
    call = plan(body(generationConfig={"maxOutputTokens": 5_000}), PRO)
    clamped = call.clamped(1_000)
    config = clamped.body["generationConfig"]
    assert config["maxOutputTokens"] + config["thinkingConfig"]["thinkingBudget"] == 1_000
    level = plan(body(generationConfig={"thinkingConfig": {"thinkingLevel": "high"}}), G3)
    config = level.clamped(600).body["generationConfig"]
    assert "thinkingLevel" not in config["thinkingConfig"]
    assert config["maxOutputTokens"] + config["thinkingConfig"]["thinkingBudget"] == 600
    off = plan(body(generationConfig={"thinkingConfig": {"thinkingBudget": 0}}), FLASH)
    assert off.clamped(300).body["generationConfig"]["maxOutputTokens"] == 300


@pytest.mark.parametrize("clamp", [256, 400, 512, 513, 700, 1_023, 1_024, 5_000])
@pytest.mark.parametrize("thinking", [None, {"thinkingBudget": 2_000}, {"thinkingBudget": -1}])
def test_a_clamped_budget_is_off_or_at_least_any_known_models_least(
        clamp: int, thinking: dict[str, Any] | None) -> None:
    """The clamp splits its cap without knowing the model: a budget below Flash-Lite's least
    (512) may be raised there, past the clamp. So the budget is 0 (thinking off, or refused
    unbilled by a model that cannot turn it off) or at least 512, the cap the rest."""
    config: dict[str, Any] = {"maxOutputTokens": 5_000}
    if thinking is not None:
        config["thinkingConfig"] = thinking
    clamped = plan(body(generationConfig=config), LITE).clamped(clamp).body["generationConfig"]
    budget = clamped["thinkingConfig"]["thinkingBudget"]
    assert budget == 0 or budget >= 512
    assert clamped["maxOutputTokens"] >= 1
    assert clamped["maxOutputTokens"] + budget == clamp


def test_a_count_request_names_only_known_fields() -> None:
    GEMINI.count_checked({"generateContentRequest": {"model": "models/x", "contents": []}},
                         (), frozenset())
    with pytest.raises(InputUnbounded):
        GEMINI.count_checked({"generateContentRequest": {"labels": {}}}, (), frozenset())
    with pytest.raises(InvalidRequest):
        plan(body(generateContentRequest={}))


# -- usage ------------------------------------------------------------------------------------

# Shaped as Google's answers are (https://ai.google.dev/api/generate-content#v1beta.
# GenerateContentResponse): thoughts beside the candidates, cached content inside the prompt.
ANSWER = {
    "candidates": [{"content": {"parts": [{"text": "An answer."}], "role": "model"},
                    "finishReason": "STOP", "index": 0}],
    "usageMetadata": {"promptTokenCount": 11, "candidatesTokenCount": 335,
                      "totalTokenCount": 1334, "thoughtsTokenCount": 988,
                      "promptTokensDetails": [{"modality": "TEXT", "tokenCount": 11}]},
    "modelVersion": "gemini-2.5-pro",
    "responseId": "mAitaLmkHPPlz7IPvtfUqQ4",
}


def test_an_answers_usage_counts_thoughts_as_output() -> None:
    usage = GEMINI.answer_usage(ANSWER)
    assert usage == Usage(11, 335 + 988)
    assert TABLE.cost_micros(PRO, usage, "google") == micros((11, "1.25"), (1_323, "10"))


def test_cached_tool_use_and_audio_tokens_are_each_at_their_rate() -> None:
    usage = GEMINI.usage_of({
        "promptTokenCount": 1_000, "cachedContentTokenCount": 600,
        "toolUsePromptTokenCount": 50, "candidatesTokenCount": 20,
        "thoughtsTokenCount": 30, "totalTokenCount": 1_100,
        "promptTokensDetails": [{"modality": "TEXT", "tokenCount": 700},
                                {"modality": "AUDIO", "tokenCount": 300}],
        "cacheTokensDetails": [{"modality": "TEXT", "tokenCount": 600}]})
    assert usage == Usage(1_050, 50, 600, input_audio_tokens=300)
    # Of the 600 cache reads, the split that costs more: 600 text reads, 150 text at the input
    # rate, 300 audio at the audio rate (flash: 0.3, cached 0.03, audio 1).
    assert TABLE.cost_micros(FLASH, usage, "google") == micros(
        (150, "0.3"), (600, "0.03"), (300, "1"), (50, "2.5"))


def test_a_total_above_the_parts_is_output_left_out() -> None:
    usage = GEMINI.usage_of({"promptTokenCount": 10, "candidatesTokenCount": 5,
                             "totalTokenCount": 40})
    assert usage == Usage(10, 30)


@pytest.mark.parametrize("given", [None, "x", {"promptTokenCount": -1},
                                   {"promptTokenCount": 5, "cachedContentTokenCount": 6},
                                   {"promptTokenCount": 5, "promptTokensDetails": "x"}])
def test_a_usage_that_cannot_be_read_is_none(given: object) -> None:
    assert GEMINI.usage_of(given) is None


def grounded(model: str, queries: list[str]) -> dict[str, Any]:
    answer: dict[str, Any] = json.loads(json.dumps(ANSWER))
    answer["modelVersion"] = model
    answer["candidates"][0]["groundingMetadata"] = {
        "webSearchQueries": queries, "searchEntryPoint": {"renderedContent": "<div></div>"},
        "groundingChunks": [{"web": {"uri": "https://example.com", "title": "example.com"}}]}
    return answer


def searches(answer: dict[str, Any]) -> int:
    usage = GEMINI.answer_usage(answer)
    assert usage is not None
    return usage.web_search_requests


def test_search_fees_per_grounded_prompt_or_per_query() -> None:
    two = ["who won euro 2024", "euro 2024 final score"]
    assert searches(grounded("gemini-2.5-flash", two)) == 1
    assert searches(grounded("gemini-3-pro-preview", two)) == 2
    # No model named: per query, the reading that costs more.
    assert searches(grounded("", two)) == 2
    assert searches(ANSWER) == 0


# -- streams ------------------------------------------------------------------------------------


def chunk(doc: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\r\n\r\n"


STREAM = [
    {"candidates": [{"content": {"parts": [{"text": "The"}], "role": "model"}, "index": 0}],
     "usageMetadata": {"promptTokenCount": 8, "totalTokenCount": 8},
     "modelVersion": "gemini-2.5-flash"},
    {"candidates": [{"content": {"parts": [{"text": " answer"}], "role": "model"},
                     "index": 0}],
     "usageMetadata": {"promptTokenCount": 8, "totalTokenCount": 8},
     "modelVersion": "gemini-2.5-flash"},
    {"candidates": [{"content": {"parts": [{"text": "."}], "role": "model"},
                     "finishReason": "STOP", "index": 0}],
     "usageMetadata": {"promptTokenCount": 8, "candidatesTokenCount": 3,
                       "thoughtsTokenCount": 40, "totalTokenCount": 51},
     "modelVersion": "gemini-2.5-flash"},
]


def test_a_stream_is_complete_on_a_finish_reason_with_its_last_usage() -> None:
    tally = StreamTally(plan(body(), FLASH, GEMINI_STREAM))
    out = tally.feed(b"".join(chunk(d) for d in STREAM[:2]))
    assert out.count(b"data: ") == 2  # the client gets every chunk
    assert not tally.finished
    assert tally.usage is None
    tally.feed(chunk(STREAM[2])[:20])
    assert not tally.finished
    tally.feed(chunk(STREAM[2])[20:])
    assert tally.finished
    assert tally.usage == Usage(8, 43)


def test_a_stream_cut_before_its_finish_reason_is_not_complete() -> None:
    tally = StreamTally(plan(body(), FLASH, GEMINI_STREAM))
    tally.feed(b"".join(chunk(d) for d in STREAM[:2]))
    assert not tally.finished


def test_a_stream_of_candidates_is_complete_only_when_each_has_finished() -> None:
    tally = StreamTally(plan(body(generationConfig={"candidateCount": 2}), FLASH,
                             GEMINI_STREAM))
    first = {"candidates": [{"content": {"parts": [{"text": "a"}], "role": "model"},
                             "finishReason": "STOP", "index": 0}],
             "usageMetadata": {"promptTokenCount": 8, "totalTokenCount": 8}}
    tally.feed(chunk(first))
    assert not tally.finished  # the second candidate's tokens are not counted yet
    last = {"candidates": [{"content": {"parts": [{"text": "b"}], "role": "model"},
                            "finishReason": "STOP", "index": 1}],
            "usageMetadata": {"promptTokenCount": 8, "candidatesTokenCount": 6,
                              "thoughtsTokenCount": 10, "totalTokenCount": 24}}
    tally.feed(chunk(last))
    assert tally.finished
    assert tally.usage == Usage(8, 16)


def test_a_blocked_prompt_ends_the_stream_with_its_usage() -> None:
    tally = StreamTally(plan(body(), FLASH, GEMINI_STREAM))
    tally.feed(chunk({"promptFeedback": {"blockReason": "SAFETY"},
                      "usageMetadata": {"promptTokenCount": 8, "totalTokenCount": 8}}))
    assert tally.finished
    assert tally.usage == Usage(8, 0)


def test_a_grounded_streams_searches_are_counted() -> None:
    tally = StreamTally(plan(body(tools=[{"googleSearch": {}}]), G3, GEMINI_STREAM))
    last = json.loads(json.dumps(STREAM[2]))
    last["modelVersion"] = G3
    last["candidates"][0]["groundingMetadata"] = {"webSearchQueries": ["a", "b", "c"]}
    tally.feed(chunk(STREAM[0]) + chunk(last))
    assert tally.usage is not None
    assert tally.usage.web_search_requests == 3


# -- errors, and where the formats are registered ------------------------------------------------


def test_errors_in_googles_shape_with_the_gateways_code_as_the_reason() -> None:
    error = {"type": "budget_error", "code": "budget_exceeded", "message": "no room",
             "budget_id": "team:a", "remaining_micros": 5}
    shaped = GEMINI.error_body(dict(error))
    assert shaped["error"]["status"] == "FAILED_PRECONDITION"  # not a retryable rate limit
    assert shaped["error"]["code"] == 400
    assert shaped["error"]["message"] == "no room"
    info = shaped["error"]["details"][0]
    assert info["reason"] == "budget_exceeded"
    assert info["metadata"] == {"budget_id": "team:a", "remaining_micros": "5"}
    event = GEMINI_STREAM.error_event(dict(error))
    assert event.startswith(b"data: ")
    assert event.endswith(b"\n\n")
    assert json.loads(event[6:]) == shaped
    rate = GEMINI.error_body({"type": "x", "code": "rate_limited", "message": "slow down"})
    assert rate["error"]["status"] == "RESOURCE_EXHAUSTED"


def test_every_gateway_error_code_has_a_google_status() -> None:
    assert set(STATUS) <= set(GOOGLE_STATUSES)


def test_the_gemini_formats_are_routed() -> None:
    assert FORMATS[Api.GEMINI] is GEMINI
    assert FORMATS[Api.GEMINI_STREAM] is GEMINI_STREAM
    assert Api.GEMINI not in UNROUTED
    assert GEMINI.model_in_path
    assert GEMINI.key_query == "key"
    assert GEMINI.key_header == "x-goog-api-key"
    assert "{model:path}" in GEMINI.route  # `<upstream>/<model>` holds a slash
    assert "{model}" in str(GEMINI.count_path)
    assert GEMINI_STREAM.api.value.endswith(":streamGenerateContent?alt=sse")
    assert GEMINI.body_schema["type"] == "object"
    assert "maxOutputTokens" in GEMINI.body_schema["properties"]["generationConfig"][
        "properties"]


def test_grounding_per_query_is_held_for_every_candidate(tmp_path: Any) -> None:
    """Google bills a query of any candidate: three candidates may run three times the
    prices file's bound."""
    path = tmp_path / "prices.json"
    path.write_text(json.dumps({"models": {G3: {
        "input_usd_per_mtok": "2", "output_usd_per_mtok": "12",
        "usd_per_web_search": "0.014", "web_searches_max": 3,
        "context_window_tokens": 100_000}}}))
    table = PriceTable.from_file(str(path))

    def searches_micros(candidates: int) -> int:
        spec = plan(body(tools=[{"googleSearch": {}}], generationConfig={
            "maxOutputTokens": 10, "candidateCount": candidates,
            "thinkingConfig": {"thinkingLevel": "low"}}), G3).spec()
        searched = table.worst_case_micros(spec.model, spec.input_tokens,
                                           spec.output_tokens_max, media=spec.media,
                                           provider=spec.provider)
        spec = plan(body(generationConfig={
            "maxOutputTokens": 10, "candidateCount": candidates,
            "thinkingConfig": {"thinkingLevel": "low"}}), G3).spec()
        return searched - table.worst_case_micros(spec.model, spec.input_tokens,
                                                  spec.output_tokens_max, media=spec.media,
                                                  provider=spec.provider)

    assert searches_micros(3) - searches_micros(1) >= 2 * 3 * 14_000


# -- models by exact name or family: a family is a name and Google's version suffixes ---------

IMPOSTORS = ["gemini-2.5-flash-evil", "gemini-2.5-pro-anything", "gemini-2.5-pro2",
             "gemini-2.5-proevil", "gemini-2.5-flash-image-preview", "gemini-2.5-flash-001-x",
             "gemini-2.5-flash-preview", "gemini-2.5-flash-preview-9-2025",
             "gemini-3-pro-preview-evil", "gemini-2.0-flash-lite-preview-02-05x"]


@pytest.mark.parametrize("model", IMPOSTORS)
def test_a_name_that_only_begins_as_a_known_models_takes_none_of_its_rules(model: str) -> None:
    """A name a family's name begins but Google's version suffixes do not end is a model of
    its own: its thinking is held at the budget its request gives (refused without one), its
    images at the window, its grounding per query, and it has no bundled limits."""
    with pytest.raises(InputUnbounded) as refused:
        plan(body(generationConfig={"maxOutputTokens": 10}), model)
    assert refused.value.details["field"] == BUDGET_PATH
    budgeted = {"maxOutputTokens": 10, "thinkingConfig": {"thinkingBudget": 40_000}}
    assert plan(body(generationConfig=budgeted), model).output_tokens_max == 10 + 40_000
    image = plan(body(inline("image/png", png(10, 10)), generationConfig=budgeted), model)
    assert image.media.referred_field == "contents[0].parts[0].inlineData"
    search = plan(body(tools=[{"googleSearch": {}}], generationConfig=budgeted), model)
    assert search.media.web_searches == 0  # per query: web_searches_max bounds it
    assert gemini_limits(model) is None
    assert searches(grounded(model, ["a", "b"])) == 2


@pytest.mark.parametrize(("model", "family"), [
    ("gemini-2.5-flash", FLASH),
    ("gemini-2.5-flash-preview-09-2025", FLASH),
    ("gemini-2.5-flash-preview-05-20", FLASH),
    ("gemini-2.5-flash-lite-preview-09-2025", LITE),
    ("gemini-2.5-flash-latest", FLASH),
    ("gemini-2.5-pro-preview-06-05", PRO),
    ("gemini-2.5-pro-exp-03-25", PRO),
    ("gemini-2.0-flash-001", "gemini-2.0-flash"),
    ("gemini-2.0-flash-exp", "gemini-2.0-flash"),
    ("gemini-2.0-flash-lite-preview-02-05", "gemini-2.0-flash-lite"),
    ("gemini-3-pro-preview-11-2025", G3),
])
def test_a_documented_version_of_a_family_takes_its_rules(model: str, family: str) -> None:
    config = {"maxOutputTokens": 10}
    assert plan(body(generationConfig=config), model).output_tokens_max == plan(
        body(generationConfig=config), family).output_tokens_max
    assert gemini_limits(model) == gemini_limits(family) is not None


def test_image_tiles_and_grounding_per_prompt_by_a_familys_versions() -> None:
    tiled = plan(body(inline("image/png", png(10, 10)),
                      generationConfig={"thinkingConfig": {"thinkingBudget": 0}}),
                 "gemini-2.5-flash-preview-09-2025")
    assert not tiled.media.referred_field
    assert tiled.text_tokens_max > 258
    assert searches(grounded("gemini-2.5-flash-001", ["a", "b"])) == 1
    assert searches(grounded("models/gemini-2.5-flash", ["a", "b"])) == 1


# -- media resolution -----------------------------------------------------------------------


@pytest.mark.parametrize("level", [None, "MEDIA_RESOLUTION_UNSPECIFIED", "MEDIA_RESOLUTION_LOW",
                                   "MEDIA_RESOLUTION_MEDIUM"])
def test_a_resolution_at_most_medium_keeps_a_25_image_at_its_tiles(level: str | None) -> None:
    """Google: low 64 tokens an image, medium 256 (GenerationConfig.mediaResolution), each
    below the 258 of a tile."""
    config: dict[str, Any] = {"thinkingConfig": {"thinkingBudget": 0}}
    if level is not None:
        config["mediaResolution"] = level
    call = plan(body(inline("image/png", png(1_000, 500)), generationConfig=config), FLASH)
    assert not call.media.referred_field
    assert call.text_tokens_max > 8 * 258


@pytest.mark.parametrize(("config", "part", "field"), [
    ({"mediaResolution": "MEDIA_RESOLUTION_HIGH"}, {}, "contents[0].parts[0].inlineData"),
    ({}, {"mediaResolution": {"level": "MEDIA_RESOLUTION_HIGH"}},
     "contents[0].parts[0].inlineData"),
    ({}, {"mediaResolution": {"level": "MEDIA_RESOLUTION_ULTRA_HIGH"}},
     "contents[0].parts[0].inlineData"),
])
def test_a_high_resolution_holds_a_25_image_at_the_window(
        config: dict[str, Any], part: dict[str, Any], field: str) -> None:
    """High is "zoomed reframing with 256 tokens", a count Google does not bound by the
    image's tiles: held at the window, as a Gemini 3 image is."""
    given = body({**inline("image/png", png(100, 100)), **part},
                 generationConfig={**config, "thinkingConfig": {"thinkingBudget": 0}})
    assert plan(given, FLASH).media.referred_field == field


@pytest.mark.parametrize(("config", "part", "field"), [
    ({"mediaResolution": "MEDIA_RESOLUTION_ENORMOUS"}, {}, "generationConfig.mediaResolution"),
    ({"mediaResolution": 3}, {}, "generationConfig.mediaResolution"),
    ({}, {"mediaResolution": "MEDIA_RESOLUTION_LOW"}, "contents[0].parts[0].mediaResolution"),
    ({}, {"mediaResolution": {"level": "x"}}, "contents[0].parts[0].mediaResolution"),
    ({}, {"mediaResolution": {"level": ["x"]}}, "contents[0].parts[0].mediaResolution"),
    ({"mediaResolution": {"level": "MEDIA_RESOLUTION_LOW"}}, {},
     "generationConfig.mediaResolution"),
    ({}, {"mediaResolution": {"level": "MEDIA_RESOLUTION_LOW", "more": 1}},
     "contents[0].parts[0].mediaResolution"),
])
def test_a_resolution_google_does_not_name_is_refused(
        config: dict[str, Any], part: dict[str, Any], field: str) -> None:
    given = body({**inline("image/png", png(100, 100)), **part}, generationConfig=config)
    with pytest.raises(InvalidRequest) as refused:
        plan(given, FLASH)
    assert refused.value.details["field"] == field
