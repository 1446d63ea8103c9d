"""The stub provider is the witness the proof trusts: it must bill what a provider would.

Every figure here is worked by hand from the providers' documentation (cited beside it), never
computed by the code under test, and this module imports nothing from `core`: the witness is
checked against the documents, not against the service it judges. This module covers what every
route shares (the price table, faults, /control, the bill, the process) and OpenAI's two routes;
tests/infra/test_stub_anthropic.py covers the Messages API. Calls go through the real `openai`
SDK where a client would use it; raw httpx where a test reads the wire itself.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infra.stub_bill import Bill, CallRecord
from infra.stub_provider import StubProvider, StubProviderProcess, fetch_bill, reset_bill
from tests.infra.conftest import start_fresh
from tests.infra.media import b64, data_url, gif, jpeg, mp3, pdf, png, wav, webp
from tests.support import examples

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
ANTHROPIC = {"anthropic-version": "2023-06-01"}
HELLO = [{"role": "user", "content": "hello"}]
# "hello": 5 UTF-8 bytes -> ceil(5 / 4) = 2 tokens, + 4 for the message, + 3 for the reply.
HELLO_TOKENS = 9
# Test models, priced by this test's own table (the stub's format), not by any service's.
TABLE = {"models": {
    # A prompt-cache write rate, as Anthropic-style providers charge it.
    "stub-cw": {"input_usd_per_mtok": "1.00", "output_usd_per_mtok": "4.00",
                "cached_input_usd_per_mtok": "0.10", "cache_write_usd_per_mtok": "1.25"},
    # A fee per request on top of the tokens.
    "stub-fee": {"input_usd_per_mtok": "1.00", "output_usd_per_mtok": "4.00",
                 "request_usd": "0.01"},
}}
# One call a route, "hello" in, and what 100 tokens out cost: 9 in at gpt-4o's $2.50 and 100 out
# at $10 (developers.openai.com/api/docs/pricing) = 1,022.5 -> 1,023; 9 at Claude Sonnet 4.5's $3
# and 100 at $15 (platform.claude.com/docs/en/about-claude/pricing) = 1,527.
ROUTES = {
    "chat": (CHAT, {"model": "gpt-4o", "messages": HELLO, "max_tokens": 200}, {}, 1_023),
    "responses": (RESPONSES, {"model": "gpt-4o", "input": "hello", "max_output_tokens": 200}, {},
                  1_023),
    "messages": (MESSAGES, {"model": "claude-sonnet-4-5", "messages": HELLO, "max_tokens": 200},
                 ANTHROPIC, 1_527),
}
# The events that end a Responses or Messages stream (a chat choice ends with a finish_reason).
TERMINAL_EVENTS = ("response.completed", "response.incomplete", "message_stop")


@pytest.fixture(scope="module")
def provider() -> Iterator[StubProvider]:
    with StubProvider(seed=3, latency_ms_min=0, latency_ms_max=5, prices=TABLE) as stub:
        yield stub


@pytest.fixture(autouse=True)
def fresh_bill(http: httpx.Client) -> None:
    start_fresh(http, {"images": {}, "files": {}, "prompt_cache": True,
                       "default_service_tier": "default",
                       "upstream_fields": "openai"})


def bill_of(http: httpx.Client) -> Bill:
    return Bill.from_json(http.get("/billing").json())


def only_call(http: httpx.Client) -> CallRecord:
    [call] = bill_of(http).log
    return call


def forced(tokens: int, **more: str) -> dict[str, str]:
    return {"X-Stub-Output-Tokens": str(tokens), **more}


def sse_data(http: httpx.Client, path: str, body: dict[str, Any],
             headers: dict[str, str] | None = None) -> tuple[list[Any], bool]:
    """The JSON of each `data:` event read, and whether the stream ended cleanly."""
    events, clean = [], True
    with http.stream("POST", path, json=body, headers=headers) as response:
        assert response.status_code == 200
        try:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line.removeprefix("data: ")))
        except httpx.RemoteProtocolError:
            clean = False
    return events, clean


def image_message(url: str, detail: str | None = "high") -> list[dict[str, Any]]:
    image: dict[str, Any] = {"url": url} | ({"detail": detail} if detail else {})
    # "what is this?": 13 bytes -> 4 tokens; the image part's JSON is not text.
    return [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                         {"type": "image_url", "image_url": image}]}]


# Prompt tokens of image_message around an image of N tokens: 4 text + 4 message + 3 reply.
IMAGE_FRAME_TOKENS = 11


# -- the price table ---------------------------------------------------------------------------


def test_a_callers_table_prices_its_own_models_from_a_dict_or_a_file(tmp_path: Path) -> None:
    table = {"models": {"my-model": {"input_usd_per_mtok": "3.00",
                                     "output_usd_per_mtok": "7.00"}}}
    path = tmp_path / "stub-table.json"
    path.write_text(json.dumps(table))
    for prices in (table, str(path)):
        with StubProvider(latency_ms_min=0, latency_ms_max=0, prices=prices) as stub:
            for model in ("my-model", "gpt-4o"):
                httpx.post(stub.url + CHAT, json={"model": model, "messages": HELLO},
                           headers=forced(10)).raise_for_status()
            # 9 x 3 + 10 x 7 = 97; the default table still prices gpt-4o: 22.5 + 100 -> 123.
            assert {m: t.cost_micros for m, t in fetch_bill(stub.url).by_model.items()} == {
                "my-model": 97, "gpt-4o": 123}


# A model's rates, and an Anthropic model's section, each well formed.
RATES = {"input_usd_per_mtok": "1", "output_usd_per_mtok": "1"}
SECTION = {"context_window_tokens": 1000, "output_tokens_max": 100, "cache_tokens_min": 10,
           "tool_prompt_tokens": {"auto": 1, "any": 1}, "keeps_thinking": False}


@pytest.mark.parametrize(("table", "why"), [
    ({"models": {"m": {"input_usd_per_mtok": "1"}}}, "output_usd_per_mtok is required"),
    ({"models": {"m": {"input_usd_per_mtok": 1, "output_usd_per_mtok": "1"}}}, "decimal string"),
    ({"models": {"m": RATES | {"colour": "x"}}}, "unknown fields"),
    ({"models": {"m": {"input_usd_per_mtok": "-1", "output_usd_per_mtok": "1"}}}, "negative"),
    ({"models": {"m": RATES | {"image": {"rule": "tile", "base_tokens": 85}}}}, "tile rule"),
    ({"m": {}}, "models"),
    ({"models": {"m": RATES | {"web_search_usd_per_call": 0.01}}}, "decimal string"),
    ({"models": {}, "openrouter": {"web_plugin_usd_per_1k_results": "4.00"}}, "openrouter"),
    ({"models": {"m": RATES | {"anthropic": {**SECTION, "colour": 1}}}}, "exactly"),
    ({"models": {"m": RATES | {"anthropic": {**SECTION, "tool_prompt_tokens": {"auto": 1}}}}},
     "auto, any"),
    ({"models": {"m": RATES | {"anthropic": {**SECTION, "cache_tokens_min": 0}}}}, "positive"),
    ({"models": {"m": RATES | {"web_search_usd_per_1k": "10"}}}, "Anthropic's"),
    ({"models": {"m": RATES | {"anthropic": SECTION, "long_context": {"beta": "b"}}}},
     "long_context needs"),
    ({"models": {"m": RATES | {"image": {"rule": "area", "pixels_per_token": 0}}}}, "area rule"),
    ({"models": {"m": RATES | {"aliases": ["m"]}}}, "given twice"),
    ({"models": {"m": RATES | {"context_window_tokens": 0}}}, "positive"),
    ({"models": {"m": RATES | {"web_search_content_tokens": "8000"}}}, "positive"),
    ({"models": {}, "openai_tools": {"web_search_usd_per_1k_calls": "10.00"}}, "openai_tools"),
    ({"models": {"m": RATES | {"long_context": {"above_input_tokens": 1, "beta": "b",
                                                "context_window_tokens": 2, **RATES}}}},
     "takes no beta"),
])
def test_a_bad_table_is_refused(table: dict[str, Any], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        StubProvider(prices=table).app()


# -- billing rules, each worked by hand --------------------------------------------------------

# id: (path, body, /control settings, output tokens forced, (cost, output, reasoning, tier)).
RULES: dict[str, tuple[str, dict[str, Any], dict[str, Any], int, tuple[int, int, int, str]]] = {
    # The rates, rounded up once a call: 9 x 2.5 + 100 x 10 = 1,022.5; at gpt-4o-mini's $0.15
    # in and $0.60 out, 9 x 0.15 + 7 x 0.6 = 5.55.
    "rates": (CHAT, {"model": "gpt-4o", "messages": HELLO}, {}, 100, (1_023, 100, 0, "default")),
    "rates-mini": (CHAT, {"model": "gpt-4o-mini", "messages": HELLO}, {}, 7,
                   (6, 7, 0, "default")),
    # A fee per request, once a call whatever its choices: 9 x 1 + 20 x 4 + $0.01.
    "request-fee": (CHAT, {"model": "stub-fee", "messages": HELLO, "n": 2}, {}, 10,
                    (10_089, 20, 0, "default")),
    # Each of n choices is output: 9 x 2.5 + 30 x 10 = 322.5.
    "n-choices": (CHAT, {"model": "gpt-4o", "messages": HELLO, "n": 3}, {}, 10,
                  (323, 30, 0, "default")),
    # Priority gpt-4o: $4.25 in, $17.00 out (openai.com/api-priority-processing):
    # 9 x 4.25 + 100 x 17 = 1,738.25; `auto` is served at the project's default tier.
    "priority": (CHAT, {"model": "gpt-4o", "messages": HELLO, "service_tier": "priority"}, {},
                 100, (1_739, 100, 0, "priority")),
    "auto-at-the-default-tier": (CHAT, {"model": "gpt-4o", "messages": HELLO,
                                        "service_tier": "auto"},
                                 {"default_service_tier": "priority"}, 10,
                                 (209, 10, 0, "priority")),
    # o3: $2 in, $8 out; reasoning is output, half the answer at medium effort (the default), a
    # quarter at low, within the cap: 9 x 2 + 100 x 8 = 818, and 18 + 40 x 8 = 338.
    "reasoning": (CHAT, {"model": "o3", "messages": HELLO}, {}, 100, (818, 100, 50, "default")),
    "reasoning-low": (CHAT, {"model": "o3", "messages": HELLO, "reasoning_effort": "low"}, {},
                      100, (818, 100, 25, "default")),
    "reasoning-capped": (CHAT, {"model": "o3", "messages": HELLO, "max_completion_tokens": 40},
                         {}, 100, (338, 40, 20, "default")),
    # o4-mini, $1.10 in and $4.40 out, high effort (3/4) within a 40 cap:
    # 9 x 1.1 + 40 x 4.4 = 185.9.
    "responses-reasoning": (RESPONSES, {"model": "o4-mini", "input": "hello",
                                        "max_output_tokens": 40,
                                        "reasoning": {"effort": "high"}}, {}, 100,
                            (186, 40, 30, "default")),
    # Predicted output it did not use is output (developers.openai.com/api/docs/guides/
    # predicted-outputs): 400 bytes, 100 tokens, on top of 10: 22.5 + 110 x 10.
    "rejected-prediction": (CHAT, {"model": "gpt-4o", "messages": HELLO, "prediction": {
        "type": "content", "content": "x" * 400}}, {}, 10, (1_123, 110, 0, "default")),
    # gpt-4o-audio-preview: text $2.50 in; audio $80 out
    # (developers.openai.com/api/docs/models/gpt-4o-audio-preview): 22.5 + 10 x 80.
    "audio-output": (CHAT, {"model": "gpt-4o-audio-preview", "messages": HELLO,
                            "modalities": ["text", "audio"]}, {}, 10, (823, 10, 0, "default")),
}


@pytest.mark.parametrize(("path", "body", "control", "tokens", "billed"), RULES.values(),
                         ids=RULES)
def test_each_billing_rule_prices_a_call_as_worked_by_hand(
    http: httpx.Client, path: str, body: dict[str, Any], control: dict[str, Any], tokens: int,
    billed: tuple[int, int, int, str],
) -> None:
    http.post("/control", json=control).raise_for_status()
    response = http.post(path, json=body, headers=forced(tokens))
    assert response.status_code == 200, response.text
    call = only_call(http)
    assert call.usage is not None
    assert (call.cost_micros, call.usage.output_tokens, call.usage.reasoning_tokens,
            call.service_tier) == billed
    assert response.json()["service_tier"] == billed[3]


@pytest.mark.parametrize(("kwargs", "reported"), [
    # (completion tokens, reasoning, audio, rejected prediction) as completion_tokens_details.
    ({"model": "o3", "max_completion_tokens": 500}, (100, 50, 0, 0)),
    ({"model": "gpt-4o-audio-preview", "modalities": ["text", "audio"],
      "audio": {"voice": "alloy", "format": "wav"}}, (100, 0, 100, 0)),
    ({"model": "gpt-4o", "prediction": {"type": "content", "content": "x" * 400}},
     (200, 0, 0, 100)),
])
def test_a_chat_answer_reports_every_part_it_bills(
    sdk: openai.OpenAI, kwargs: dict[str, Any], reported: tuple[int, int, int, int]
) -> None:
    answer = sdk.chat.completions.create(messages=HELLO, extra_headers=forced(100),  # type: ignore[call-overload]
                                         **kwargs)
    usage = answer.usage
    assert usage is not None
    assert usage.completion_tokens_details is not None
    details = usage.completion_tokens_details
    assert (usage.prompt_tokens, usage.completion_tokens, details.reasoning_tokens,
            details.audio_tokens, details.rejected_prediction_tokens) == (HELLO_TOKENS, *reported)
    # The words shown are the answer less its reasoning.
    shown = answer.choices[0].message.audio.transcript if details.audio_tokens else (  # type: ignore[union-attr]
        answer.choices[0].message.content)
    assert len((shown or "").split()) == 100 - (details.reasoning_tokens or 0)


def test_reasoning_can_be_all_of_an_answer(sdk: openai.OpenAI) -> None:
    answer = sdk.chat.completions.create(
        model="o3", messages=HELLO, max_completion_tokens=64,  # type: ignore[arg-type]
        extra_headers=forced(64, **{"X-Stub-Reasoning-Tokens": "64"}))
    assert answer.usage is not None
    assert (answer.choices[0].message.content, answer.usage.completion_tokens) == ("", 64)


@pytest.mark.parametrize("cap_field", ["max_tokens", "max_completion_tokens"])
def test_output_is_drawn_each_choice_and_never_exceeds_the_cap(
    sdk: openai.OpenAI, cap_field: str
) -> None:
    for _ in range(10):
        answer = sdk.chat.completions.create(model="gpt-4o", messages=HELLO, n=3,  # type: ignore[call-overload]
                                             **{cap_field: 40})
        lengths = [len(c.message.content.split(" ")) for c in answer.choices]
        assert answer.usage.completion_tokens == sum(lengths)
        assert all(1 <= n <= 40 for n in lengths)
        assert [c.finish_reason for c in answer.choices] == [
            "length" if n == 40 else "stop" for n in lengths]
    drawn = sdk.chat.completions.create(model="gpt-4o", messages=HELLO, max_tokens=4_000, n=4)
    assert len({len((c.message.content or "").split()) for c in drawn.choices}) > 1


# -- input -------------------------------------------------------------------------------------


def test_text_and_tool_definitions_are_counted_by_their_bytes(sdk: openai.OpenAI) -> None:
    tools: Any = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    messages: Any = [
        {"role": "system", "content": "Be brief."},  # 9 bytes -> 3, + 4
        {"role": "user", "content": [{"type": "text", "text": "Grüße, 世界"}]},  # 16 -> 4, + 4
        {"role": "assistant", "content": None, "tool_calls": [  # "look" + "{}" = 6 -> 2, + 4
            {"id": "c1", "type": "function", "function": {"name": "look", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},  # 5 -> 2, + 4
    ]
    answer = sdk.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=5,
                                         tools=tools)
    # The tools by their JSON bytes, without message framing.
    size = len(json.dumps(tools, separators=(",", ":")).encode())
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == 3 + 4 + 4 + 4 + 2 + 4 + 2 + 4 + 3 + -(-size // 4)


@pytest.mark.parametrize(("model", "image", "detail", "tokens"), [
    # https://developers.openai.com/api/docs/guides/images-vision, "calculating costs".
    # 1024 x 1024 high: fits 2048; shortest side 1024 -> 768: 768 x 768 = 2 x 2 tiles;
    # 85 + 4 x 170 = 765, the guide's own example.
    ("gpt-4o", png(1024, 1024), "high", 765),
    ("gpt-4o", png(1024, 1024), "auto", 765),  # auto is billed as high
    ("gpt-4o", png(1024, 1024), None, 765),  # no detail is auto
    ("gpt-4o", png(1024, 1024), "low", 85),  # low: the base, whatever the size
    # 2048 x 4096 high: fit to 1024 x 2048, shortest side to 768: 768 x 1536 = 2 x 3 tiles;
    # 85 + 6 x 170 = 1,105, the guide's second example.
    ("gpt-4o", png(2048, 4096), "high", 1_105),
    # 4096 x 1024: fit to 2048 x 512; the shortest side, 512, is not scaled up: 4 x 1 tiles.
    ("gpt-4o", png(4096, 1024), "high", 85 + 4 * 170),
    ("gpt-4o", png(300, 200), "high", 255),  # never scaled up: 1 tile
    ("gpt-4o-mini", png(1024, 1024), "high", 2_833 + 4 * 5_667),
    ("o3", png(1024, 1024), "high", 75 + 4 * 150),
    ("gpt-5", png(1024, 1024), "high", 70 + 4 * 140),
    # Patch rule: 32 x 32 = 1,024 patches x 1.62 = 1,658.88 -> 1,659; detail does not apply.
    ("gpt-4.1-mini", png(1024, 1024), "low", 1_659),
    # 1800 x 2400: 57 x 75 = 4,275 patches > 1,536: shrink by sqrt(1024 x 1536 / 4,320,000),
    # then to whole patches across: 1,056 x 1,408 = 33 x 44 = 1,452 patches (the guide's
    # example); x 1.62 = 2,352.24 -> 2,353.
    ("gpt-4.1-mini", png(1800, 2400), "high", 2_353),
    ("o4-mini", png(1024, 1024), "high", 1_762),  # 1,024 x 1.72 = 1,761.28 -> 1,762
    ("gpt-5-mini", png(64, 64), "high", 7),  # 2 x 2 patches x 1.62 = 6.48 -> 7
    # Every format the stub reads gives its size.
    ("gpt-4o", jpeg(1024, 1024), None, 765),
    ("gpt-4o", gif(1024, 1024), None, 765),
    ("gpt-4o", webp(1024, 1024, "VP8X"), None, 765),
    ("gpt-4o", webp(1024, 1024, "VP8L"), None, 765),
    ("gpt-4o", webp(1024, 1024, "VP8 "), None, 765),
])
def test_an_image_is_billed_by_the_models_documented_rule(
    sdk: openai.OpenAI, http: httpx.Client, model: str, image: bytes, detail: str | None,
    tokens: int,
) -> None:
    cap = {"max_completion_tokens": 5} if model.startswith(("o", "gpt-5")) else {"max_tokens": 5}
    answer = sdk.chat.completions.create(
        model=model, messages=image_message(data_url("image/png", image), detail), **cap,  # type: ignore[arg-type]
    )
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == IMAGE_FRAME_TOKENS + tokens
    assert bill_of(http).total.image_input_tokens == tokens


@pytest.mark.parametrize(("clip", "audio_format", "audio_tokens"), [
    # 2.5 s of 16 kHz mono 16-bit PCM (80,000 bytes at 32,000 bytes/s) x 10 tokens/s = 25.
    (wav(250), "wav", 25),
    (wav(125), "wav", 13),  # 1.25 s -> 12.5 -> 13
    # 100 frames x 1,152 samples / 44,100 Hz = 2.612 s -> 26.12 -> 27.
    (mp3(100), "mp3", 27),
])
def test_audio_input_is_billed_by_duration_at_the_audio_rate(
    sdk: openai.OpenAI, http: httpx.Client, clip: bytes, audio_format: str, audio_tokens: int,
) -> None:
    messages: Any = [{"role": "user", "content": [
        {"type": "text", "text": "transcribe"},  # 10 bytes -> 3 tokens
        {"type": "input_audio", "input_audio": {"data": b64(clip), "format": audio_format}}]}]
    answer = sdk.chat.completions.create(model="gpt-4o-audio-preview", messages=messages,
                                         max_tokens=50, extra_headers=forced(10))
    assert answer.usage is not None
    assert answer.usage.prompt_tokens_details is not None
    assert answer.usage.prompt_tokens == 3 + 4 + 3 + audio_tokens
    assert answer.usage.prompt_tokens_details.audio_tokens == audio_tokens
    # Text $2.50 in, $10 out; audio $40 in per million tokens.
    assert only_call(http).cost_micros == -(-(10 * 25 + audio_tokens * 400 + 10 * 100) // 10)


def test_files_images_and_items_are_billed_from_the_body_or_the_registry(
    sdk: openai.OpenAI, http: httpx.Client
) -> None:
    url = "https://images.example/cat.png"
    http.post("/control", json={"images": {url: [2048, 4096]}, "files": {
        "file-big": {"bytes": 400_000}, "https://files.example/r.pdf": {"bytes": 4, "pages": 1},
        "msg_stored": {"bytes": 40_000}, "file-img": {"bytes": 10, "image": [1024, 1024]},
    }}).raise_for_status()
    document = pdf(2)
    inline: Any = [{"role": "user", "content": [{"type": "file", "file": {
        "filename": "a.pdf", "file_data": data_url("application/pdf", document)}}]}]
    # A PDF: its bytes over four, and each page a 1224 x 1584 image: shortest side to 768 ->
    # 768 x 993.9 = 2 x 2 tiles = 765.
    file_tokens = -(-len(document) // 4) + 2 * 765
    by_id: Any = [{"role": "user", "content": [{"type": "file", "file": {"file_id": "file-big"}}]}]
    parts: Any = [{"type": "input_file", "file_url": "https://files.example/r.pdf"},
                  {"type": "input_image", "file_id": "file-img", "detail": "low"}]
    items: Any = [{"role": "user", "content": parts}, {"type": "item_reference",
                                                       "id": "msg_stored"}]
    prompts = [
        sdk.chat.completions.create(model="gpt-4o", messages=inline, max_tokens=5).usage,
        sdk.chat.completions.create(model="gpt-4o", messages=by_id, max_tokens=5).usage,
        sdk.chat.completions.create(model="gpt-4o", messages=image_message(url),  # type: ignore[arg-type]
                                    max_tokens=5).usage,
    ]
    response = sdk.responses.create(model="gpt-4o", input=items, max_output_tokens=5)
    assert [u.prompt_tokens for u in prompts if u is not None] == [
        4 + 3 + file_tokens, 7 + 100_000, IMAGE_FRAME_TOKENS + 1_105]
    assert response.usage is not None
    # File: 4 bytes -> 1 + one page 765; image low: 85; framing 4 + 4 + 3; item 10,000.
    assert response.usage.input_tokens == 1 + 765 + 85 + 4 + 4 + 3 + 10_000
    assert bill_of(http).total.file_input_tokens == file_tokens + 100_000 + 1 + 765 + 10_000


# -- the prompt cache (https://developers.openai.com/api/docs/guides/prompt-caching) -----------


def long_prompt(text: str = "x" * 5_000) -> list[dict[str, str]]:
    # 5,000 bytes -> 1,250 tokens + 4 + 3 = 1,257.
    return [{"role": "user", "content": text}]


def cached(sdk: openai.OpenAI, messages: Any, model: str = "gpt-4o",
           **headers: str) -> tuple[int, int, int]:
    """(prompt tokens, cached tokens, cache-write tokens) of a call."""
    usage = sdk.chat.completions.create(model=model, messages=messages, max_tokens=10,
                                        extra_headers=forced(10, **headers)).usage
    assert usage is not None
    assert usage.prompt_tokens_details is not None
    details = usage.prompt_tokens_details
    return (usage.prompt_tokens, details.cached_tokens or 0,
            getattr(details, "cache_write_tokens", None) or 0)


def test_the_prompt_cache_reads_whole_prefixes_in_128_token_steps(
    sdk: openai.OpenAI, http: httpx.Client
) -> None:
    assert cached(sdk, long_prompt()) == (1_257, 0, 0)  # the first call writes the cache
    # 1,257 tokens read as 1,024 + 128 = 1,152 (the next step, 1,280, is more than the prefix).
    assert cached(sdk, long_prompt()) == (1_257, 1_152, 0)
    longer = [*long_prompt(), {"role": "user", "content": "more"}]  # + 1 + 4
    assert cached(sdk, longer) == (1_262, 1_152, 0)
    assert cached(sdk, long_prompt(), model="gpt-4o-mini") == (1_257, 0, 0)  # a cache per model
    assert cached(sdk, long_prompt("y" * 3_000)) == (757, 0, 0)  # below 1,024: never cached
    # Cached tokens at $1.25: 105 x 2.5 + 1,152 x 1.25 + 10 x 10 = 262.5 + 1,440 + 100.
    assert bill_of(http).log[1].cost_micros == 1_803


def test_a_cache_write_rate_and_forced_cached_tokens_are_billed(
    sdk: openai.OpenAI, http: httpx.Client
) -> None:
    # A model with a cache-write rate reports and bills the tokens a call wrote.
    assert cached(sdk, long_prompt(), "stub-cw") == (1_257, 0, 1_152)
    assert cached(sdk, long_prompt(), "stub-cw") == (1_257, 1_152, 0)
    assert cached(sdk, long_prompt(), **{"X-Stub-Cached-Tokens": "1000"})[1] == 1_000
    http.post("/control", json={"cached_tokens": 5, "calls": 1}).raise_for_status()
    assert cached(sdk, HELLO)[1] == 5
    http.post("/control", json={"prompt_cache": False}).raise_for_status()
    cached(sdk, long_prompt())
    assert cached(sdk, long_prompt())[1] == 0  # the cache turned off
    # Writes at $1.25: 105 x 1 + 1,152 x 1.25 + 40 = 1,585; reads at $0.10: 105 + 115.2 + 40;
    # forced at gpt-4o's $1.25: 257 x 2.5 + 1,000 x 1.25 + 100 = 1,992.5; 4 x 2.5 + 6.25 + 100.
    assert [c.cost_micros for c in bill_of(http).log][:4] == [1_585, 261, 1_993, 117]


# -- the wire: chat, Responses, streams ----------------------------------------------------------


def test_chat_streams_its_choices_and_the_usage_when_asked(
    sdk: openai.OpenAI, http: httpx.Client
) -> None:
    chunks = list(sdk.chat.completions.create(
        model="gpt-4o", messages=HELLO, max_tokens=50, n=2, stream=True,
        stream_options={"include_usage": True}, extra_headers=forced(20)))
    *content, last = chunks
    text = {0: "", 1: ""}
    for chunk in content:
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
    assert [len(t.split(" ")) for t in text.values()] == [20, 20]
    assert all(c.usage is None for c in content)
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.completion_tokens == 40
    # Without include_usage no chunk carries it, and the call is billed all the same.
    assert all(c.usage is None and c.choices for c in sdk.chat.completions.create(
        model="gpt-4o", messages=HELLO, max_tokens=50, stream=True))
    assert [(c.stream, c.billed) for c in bill_of(http).log] == [(True, True)] * 2


@pytest.mark.parametrize("how", ["header", "stream_options"])
def test_continuous_usage_puts_the_usage_so_far_in_every_chunk(
    http: httpx.Client, how: str
) -> None:
    options = {"include_usage": True} | ({"continuous_usage_stats": True}
                                          if how == "stream_options" else {})
    headers = forced(40) | ({"X-Stub-Continuous-Usage": "1"} if how == "header" else {})
    events, clean = sse_data(http, CHAT, {"model": "gpt-4o", "messages": HELLO, "max_tokens": 50,
                                          "stream": True, "stream_options": options}, headers)
    assert clean
    seen = [e["usage"]["completion_tokens"] for e in events]
    assert (seen[0], seen[-1], seen == sorted(seen)) == (0, 40, True)
    assert {e["usage"]["prompt_tokens"] for e in events} == {HELLO_TOKENS}


def test_a_required_tool_is_answered_with_a_call(sdk: openai.OpenAI) -> None:
    tools: Any = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    answer = sdk.chat.completions.create(model="gpt-4o", messages=HELLO, max_tokens=50,
                                         tools=tools, tool_choice="required",
                                         extra_headers=forced(5))
    [call] = answer.choices[0].message.tool_calls or []
    assert (call.function.name, answer.choices[0].finish_reason) == ("lookup", "tool_calls")  # type: ignore[union-attr]


def test_responses_answers_and_streams_in_openais_format(sdk: openai.OpenAI) -> None:
    response = sdk.responses.create(model="gpt-4o", input="hello", instructions="Be brief.",
                                    max_output_tokens=100, extra_headers=forced(30))
    assert (response.status, response.object, response.service_tier) == (
        "completed", "response", "default")
    assert len(response.output_text.split()) == 30
    assert response.usage is not None
    # "Be brief." 9 bytes -> 3 + 4; "hello" 2 + 4; + 3 for the reply.
    assert (response.usage.input_tokens, response.usage.output_tokens,
            response.usage.total_tokens) == (16, 30, 46)
    events = list(sdk.responses.create(model="gpt-4o", input="hello", max_output_tokens=100,
                                       stream=True, extra_headers=forced(40)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert len(text.split()) == 40
    assert events[-1].response.usage.output_tokens == 40  # type: ignore[union-attr]
    with sdk.responses.stream(model="gpt-4o", input="hello", max_output_tokens=100,
                              extra_headers=forced(40)) as stream:
        assert stream.get_final_response().output_text == text


def test_responses_stops_at_its_cap_as_incomplete(sdk: openai.OpenAI) -> None:
    response = sdk.responses.create(model="o4-mini", input="hello", max_output_tokens=40,
                                    reasoning={"effort": "high"}, extra_headers=forced(100))
    assert (response.status, [item.type for item in response.output]) == (
        "incomplete", ["reasoning", "message"])
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    capped = list(sdk.responses.create(model="gpt-4o", input="hello", max_output_tokens=20,
                                       stream=True, extra_headers=forced(40)))
    assert capped[-1].type == "response.incomplete"


def test_responses_serves_function_tools_and_bills_a_previous_response_as_input(
    sdk: openai.OpenAI,
) -> None:
    tools: Any = [{"type": "function", "name": "lookup", "parameters": {}}]
    first = sdk.responses.create(model="gpt-4o", input="hello", tools=tools,
                                 tool_choice="required", max_output_tokens=50)
    [call] = first.output
    assert (call.type, call.name) == ("function_call", "lookup")  # type: ignore[union-attr]
    items: Any = [{"type": "function_call", "call_id": "c1", "name": "lookup",
                   "arguments": "{}"},  # 8 bytes -> 2, + 4
                  {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]  # 2 + 4
    second = sdk.responses.create(model="gpt-4o", input=items, max_output_tokens=50)
    assert second.usage is not None
    assert second.usage.input_tokens == 2 + 4 + 2 + 4 + 3
    stored = sdk.responses.create(model="gpt-4o", input="hello", max_output_tokens=50,
                                  extra_headers=forced(20))
    third = sdk.responses.create(model="gpt-4o", input="hello", max_output_tokens=50,
                                 previous_response_id=stored.id)
    assert third.usage is not None
    # The stored conversation: its 9 input tokens and 20 output tokens, before the new input.
    assert third.usage.input_tokens == 9 + 20 + 9


# -- search models and OpenRouter's fields -----------------------------------------------------

# The stub's own table, read here for its rates: the figures the tests below work from.
STUB_TABLE = json.loads((Path(__file__).parents[2] / "infra" / "stub_prices.json").read_text())
# OpenAI: the chat search models' web search, $10 per 1,000 calls; OpenRouter: its web plugin,
# $4 per 1,000 results, 5 results by default.
SEARCH_FEE_MICROS = 10_000
WEB_RESULT_MICROS = 4_000
WEB_PLUGIN_FEE_MICROS = 5 * WEB_RESULT_MICROS


def token_micros(model: str, call: CallRecord) -> int:
    """What the call's tokens cost at `model`'s rates in the stub's table, rounded up."""
    rates = STUB_TABLE["models"][model]
    assert call.usage is not None
    assert not call.usage.cached_input_tokens
    return math.ceil(call.usage.input_tokens * Fraction(rates["input_usd_per_mtok"])
                     + call.usage.output_tokens * Fraction(rates["output_usd_per_mtok"]))


@pytest.mark.parametrize(("path", "stream", "model", "table_model"), [
    (CHAT, False, "gpt-4o-search-preview", "gpt-4o-search-preview"),
    (CHAT, True, "gpt-4o-mini-search-preview-2025-03-11", "gpt-4o-mini-search-preview"),
    (RESPONSES, False, "gpt-5-search-api", "gpt-5-search-api"),
    (RESPONSES, True, "gpt-4o-search-preview-2025-03-11", "gpt-4o-search-preview"),
])
def test_a_search_model_bills_its_search_fee_once_a_call_on_top_of_its_tokens(
    http: httpx.Client, path: str, stream: bool, model: str, table_model: str
) -> None:
    prompt: dict[str, Any] = {"messages": HELLO, "n": 2, "web_search_options": {
        "search_context_size": "high", "user_location": {"type": "approximate"}}} \
        if path == CHAT else {"input": "hello"}
    body = {"model": model, "stream": stream, **prompt}
    if stream:
        sse_data(http, path, body, forced(30))
    else:
        http.post(path, json=body, headers=forced(30)).raise_for_status()
    call = only_call(http)
    assert call.usage is not None
    assert call.usage.web_search_calls == 1
    assert call.cost_micros == token_micros(table_model, call) + SEARCH_FEE_MICROS
    bill = bill_of(http)
    assert (bill.total.web_search_calls, bill.by_model[model].web_search_calls) == (1, 1)


# OpenRouter's fields, sent to gpt-4o-mini: its web plugin and fallbacks dearer and cheaper.
OPENROUTER_FIELDS = {"plugins": [{"id": "web"}],
                     "models": ["not-priced-here", "gpt-4o", "gpt-4.1-nano"]}


def test_the_openrouter_mode_bills_the_web_plugin_and_the_dearest_fallback(
    http: httpx.Client
) -> None:
    base = {"model": "gpt-4o-mini", "messages": HELLO}
    # Outside the mode its fields change nothing.
    ignored = http.post(CHAT, json={**base, **OPENROUTER_FIELDS}, headers=forced(10)).json()
    http.post("/control", json={"upstream_fields": "openrouter"}).raise_for_status()
    http.post(CHAT, json=base, headers=forced(10)).raise_for_status()
    http.post(CHAT, json={**base, "plugins": [{"id": "web"}]}, headers=forced(10))
    http.post(RESPONSES, json={"model": "gpt-4o-mini", "input": "hello", "plugins": [
        {"id": "web", "max_results": 2}]}, headers=forced(10)).raise_for_status()
    answer = http.post(CHAT, json={**base, **OPENROUTER_FIELDS}, headers=forced(10)).json()
    # The dearest is the requested model; a search model's fee makes a fallback dearer.
    http.post(CHAT, json={"model": "gpt-4o", "messages": HELLO, "models": ["gpt-4o-mini"]},
              headers=forced(10))
    http.post(CHAT, json={**base, "models": ["gpt-4o-mini-search-preview"]}, headers=forced(10))
    outside, plain, web, web_2, fallback, kept, search = bill_of(http).log
    assert (ignored["model"], outside.model, outside.model_requested) == (
        "gpt-4o-mini", "gpt-4o-mini", None)
    assert outside.cost_micros == plain.cost_micros == token_micros("gpt-4o-mini", plain)
    assert web.cost_micros == plain.cost_micros + WEB_PLUGIN_FEE_MICROS
    assert web_2.cost_micros == token_micros("gpt-4o-mini", web_2) + 2 * WEB_RESULT_MICROS
    assert answer["model"] == fallback.model == "gpt-4o"
    assert fallback.model_requested == "gpt-4o-mini"
    assert fallback.cost_micros == token_micros("gpt-4o", fallback) + WEB_PLUGIN_FEE_MICROS
    assert (kept.model, kept.model_requested) == ("gpt-4o", None)
    assert search.model == "gpt-4o-mini-search-preview"
    assert search.cost_micros == token_micros("gpt-4o-mini-search-preview",
                                              search) + SEARCH_FEE_MICROS
    bill = bill_of(http)
    assert bill.total.web_plugin_results == 5 + 2 + 5
    assert bill.by_model["gpt-4o"].calls == 2
    # A plugin it cannot price is refused, unbilled.
    for plugins in ([{"id": "file-parser"}], [{"id": "web", "engine": "native"}], "web"):
        assert http.post(CHAT, json={**base, "plugins": plugins}).status_code == 400
    assert bill_of(http).total.calls == 7


# -- what it refuses ---------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "body", "status", "why"), [
    (CHAT, {"model": "no-such-model-anywhere", "messages": HELLO}, 404, "does not exist"),
    (CHAT, {"model": "gpt-4o", "messages": HELLO, "n": 0}, 400, "n must be"),
    (CHAT, {"model": "gpt-4o", "messages": []}, 400, "messages must be"),
    (CHAT, {"model": "gpt-4o", "messages": HELLO, "max_tokens": 0}, 400, "positive integer"),
    (CHAT, {"model": "gpt-4o", "messages": HELLO, "web_search_options": {}}, 400,
     "for search models"),
    (CHAT, {"model": "gpt-4o-search-preview", "messages": HELLO,
            "web_search_options": {"search_context_size": "huge"}}, 400, "search_context_size"),
    # A reasoning model's cap must cover its reasoning: max_completion_tokens, not max_tokens.
    (CHAT, {"model": "o3", "messages": HELLO, "max_tokens": 50}, 400, "max_tokens"),
    (CHAT, {"model": "gpt-4o", "messages": HELLO, "reasoning_effort": "high"}, 400,
     "not supported"),
    # gpt-5-nano has no priority row; flex is not modelled.
    (CHAT, {"model": "gpt-5-nano", "messages": HELLO, "service_tier": "priority"}, 400,
     "not available"),
    (CHAT, {"model": "gpt-5-nano", "messages": HELLO, "service_tier": "flex"}, 400,
     "not available"),
    (CHAT, {"model": "gpt-4o-audio-preview", "messages": image_message(
        data_url("image/png", png(8, 8)))}, 400, "does not accept image input"),
    (CHAT, {"model": "gpt-4o", "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": b64(wav(100)), "format": "wav"}}]}]},
     400, "does not accept audio input"),
    (CHAT, {"model": "gpt-4o", "messages": image_message("data:image/png;base64,AAAA")}, 400,
     "not a PNG, JPEG"),
    (CHAT, {"model": "gpt-4o", "messages": image_message(
        "data:text/plain;base64," + b64(png(8, 8)))}, 400, "must be image"),
    (CHAT, {"model": "gpt-4o", "messages": image_message("ftp://x/y.png")}, 400, "needs a data"),
    (CHAT, {"model": "gpt-4o", "messages": image_message("https://images.example/cat.png")},
     400, "could not be downloaded"),
    (CHAT, {"model": "gpt-4o", "messages": [{"role": "user", "content": [
        {"type": "video", "video": {}}]}]}, 400, "not served"),
    (CHAT, {"model": "gpt-4o", "messages": [{"role": "user", "content": [
        {"type": "file", "file": {"file_id": "file-nope"}}]}]}, 400, "no file"),
    (CHAT, {"model": "gpt-4o", "messages": [{"role": "user", "content": [
        {"type": "file", "file": {"file_id": "f", "file_data": "AAAA"}}]}]}, 400, "one of"),
    (RESPONSES, {"model": "gpt-4o", "input": "hi", "tools": [{"type": "file_search"}]}, 400,
     "the stub serves function, custom and namespace tools"),
    (RESPONSES, {"model": "gpt-4o", "input": [{"type": "computer_call_output", "output": {}}]},
     400, "not served"),
    (RESPONSES, {"model": "gpt-4o", "input": "hi", "n": 2}, 400, "not a Responses parameter"),
    (RESPONSES, {"model": "gpt-4o", "input": "hi", "previous_response_id": "resp_nope"}, 400,
     "not found"),
])
def test_what_it_cannot_serve_is_refused_unbilled(
    http: httpx.Client, path: str, body: dict[str, Any], status: int, why: str
) -> None:
    response = http.post(path, json=body)
    assert response.status_code == status
    assert why in response.json()["error"]["message"]
    bill = bill_of(http)
    assert [(c.status, c.billed) for c in bill.log] == [(status, False)]


# -- faults, on every route --------------------------------------------------------------------


def fault_call(http: httpx.Client, route: str, headers: dict[str, str] | None = None,
               timeout_s: float = 10.0) -> httpx.Response:
    path, body, route_headers, _ = ROUTES[route]
    return http.post(path, json=body, headers=route_headers | (headers or {}), timeout=timeout_s)


@pytest.mark.parametrize("route", ROUTES)
def test_a_fault_before_serving_bills_nothing(http: httpx.Client, route: str) -> None:
    response = fault_call(http, route, {"X-Stub-Fail-Status": "503"})
    assert (response.status_code, "stub failure 503" in response.text) == (503, True)
    with pytest.raises(httpx.ReadTimeout):
        fault_call(http, route, {"X-Stub-Hang": "1"}, timeout_s=0.3)
    bill = bill_of(http)
    assert (bill.requests, bill.total.calls, bill.total.cost_micros) == (2, 0, 0)
    assert (bill.log[0].status, bill.log[0].billed) == (503, False)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(("header", "value", "status"), [
    ("X-Stub-Fail-After-Billing", "500", 500), ("X-Stub-Fail-After-Billing", "529", 529),
    ("X-Stub-Fail-After-Billing", "524", 524), ("X-Stub-Hang-After-Billing", "1", 0),
    ("X-Stub-Break-After-Events", "0", 200),  # a body broken off: half of it, then nothing
])
def test_a_fault_after_billing_bills_the_call_in_full(
    http: httpx.Client, route: str, header: str, value: str, status: int
) -> None:
    if status in (0, 200):
        with pytest.raises((httpx.ReadTimeout, httpx.RemoteProtocolError)):
            fault_call(http, route, forced(100, **{header: value}), timeout_s=0.3)
    else:
        assert fault_call(http, route, forced(100, **{header: value})).status_code == status
    call = only_call(http)
    fault = header.removeprefix("X-Stub-").lower().replace("-", "_")
    assert (call.status, call.billed, call.cost_micros, call.fault) == (
        status, True, ROUTES[route][3], fault)


@pytest.mark.parametrize("route", ROUTES)
def test_a_broken_stream_is_billed_in_full_and_never_ends(http: httpx.Client, route: str) -> None:
    path, body, headers, cost = ROUTES[route]
    events, clean = sse_data(http, path, {**body, "stream": True},
                             headers | forced(100, **{"X-Stub-Break-After-Events": "5"}))
    assert (clean, len(events)) == (False, 5)
    assert [e for e in events if e.get("type") in TERMINAL_EVENTS
            or any(c.get("finish_reason") for c in e.get("choices", []))] == []
    call = only_call(http)
    assert (call.billed, call.cost_micros, call.fault) == (True, cost, "break_after_events")


def test_a_broken_chat_stream_carries_the_partial_usage_so_far(http: httpx.Client) -> None:
    # 0 is a count, not "off": the connection drops before the first event.
    http.post("/control", json={"break_after_events": 0, "calls": 1}).raise_for_status()
    body = {"model": "gpt-4o", "messages": HELLO, "max_tokens": 200, "stream": True,
            "stream_options": {"include_usage": True}}
    assert sse_data(http, CHAT, body, forced(60)) == ([], False)
    headers = forced(100, **{"X-Stub-Break-After-Events": "3", "X-Stub-Continuous-Usage": "1"})
    events, clean = sse_data(http, CHAT, body, headers)
    assert (clean, len(events)) == (False, 3)
    assert events[-1]["usage"]["completion_tokens"] == 32  # two 16-token deltas, of 100
    assert [c.cost_micros for c in bill_of(http).log] == [623, 1_023]  # all of each


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(("fault", "status", "billed"), [
    ({"fail_status": 502}, 502, False), ({"fail_after_billing": 524}, 524, True),
])
def test_the_control_route_faults_the_next_calls_then_recovers(
    http: httpx.Client, route: str, fault: dict[str, Any], status: int, billed: bool
) -> None:
    http.post("/control", json={**fault, "calls": 2}).raise_for_status()
    assert [fault_call(http, route).status_code for _ in range(3)] == [status, status, 200]
    assert http.get("/control").json()["calls"] == 0
    bill = bill_of(http)
    assert [(c.status, c.billed) for c in bill.log] == [(status, billed)] * 2 + [(200, True)]


def test_the_control_route_hangs_until_cleared(http: httpx.Client) -> None:
    http.post("/control", json={"hang": True}).raise_for_status()
    for route in ROUTES:
        with pytest.raises(httpx.ReadTimeout):
            fault_call(http, route, timeout_s=0.3)
    http.post("/control", json={}).raise_for_status()
    assert fault_call(http, "chat").status_code == 200
    bill = bill_of(http)
    assert (bill.requests, bill.total.calls) == (4, 1)


@pytest.mark.parametrize("body", [
    {"fail_status": 200}, {"hang": True, "fail_status": 500}, {"calls": 0, "hang": True},
    {"other": 1}, {"fail_after_billing": 503, "break_after_events": 2},
    {"images": {"https://x/y.png": [0, 10]}}, {"files": {"f": {"bytes": -1}}},
    {"prompt_cache": "yes"}, {"upstream_fields": "anthropic"}, {"web_search_result_tokens": 10},
    {"clock_offset_s": -1}, {"web_searches": "many"},
])
def test_the_control_route_refuses_nonsense(http: httpx.Client, body: Any) -> None:
    assert http.post("/control", json=body).status_code == 400


# -- the bill and the process ------------------------------------------------------------------


def test_reset_starts_a_new_bill_which_reads_with_or_without_its_log(
    provider: StubProvider, http: httpx.Client
) -> None:
    http.post(CHAT, json={"model": "gpt-4o", "messages": HELLO}).raise_for_status()
    bill = fetch_bill(provider.url, with_log=False)
    assert (bill.total.calls, list(bill.log)) == (1, [])
    reset_bill(provider.url)
    bill = fetch_bill(provider.url)
    assert (bill.requests, bill.total.calls, bill.total.cost_micros, bill.by_model,
            list(bill.log)) == (0, 0, 0, {}, [])


def test_a_seed_makes_sequential_calls_reproducible() -> None:
    def draws(seed: int) -> list[int]:
        with (StubProvider(seed=seed, latency_ms_min=0, latency_ms_max=0) as stub,
              httpx.Client(base_url=stub.url) as client):
            return [client.post(CHAT, json={"model": "gpt-4o", "messages": HELLO,
                                            "max_tokens": 4_000}).json()["usage"]
                    ["completion_tokens"] for _ in range(8)]

    assert draws(11) == draws(11)
    assert draws(11) != draws(12)


def test_a_required_api_key_is_checked_before_billing_on_every_route() -> None:
    with StubProvider(api_key="sk-upstream", latency_ms_min=0, latency_ms_max=0) as stub:
        for path, body, headers, _ in ROUTES.values():
            assert httpx.post(stub.url + path, json=body, headers=headers).status_code == 401
            # A bearer token on every route; Anthropic's x-api-key on its own.
            for key in ({"Authorization": "Bearer sk-upstream"}, {"x-api-key": "sk-upstream"}):
                right = httpx.post(stub.url + path, json=body, headers=headers | key)
                assert right.status_code == (200 if path == MESSAGES or "Authorization" in key
                                             else 401)
        bill = fetch_bill(stub.url)
        assert (bill.requests, bill.total.calls) == (9, 4)


def test_it_runs_as_its_own_process() -> None:
    """`python -m infra.stub_provider`, with a table of its own, as StubProviderProcess runs it."""
    table = {"models": {"proc-m": {"input_usd_per_mtok": "1.00", "output_usd_per_mtok": "1.00"}}}
    with StubProviderProcess(seed=5, latency_ms_min=0, latency_ms_max=0, prices=table) as stub:
        response = httpx.post(stub.url + CHAT, json={"model": "proc-m", "messages": HELLO},
                              headers=forced(5))
        assert response.status_code == 200
        assert fetch_bill(stub.url).total.cost_micros == 14  # 9 + 5
        process = stub.process
    assert process is not None
    assert process.poll() is not None  # stopped, and reaped, by its pid


def test_the_stub_shares_nothing_with_the_service() -> None:
    """The witness imports no part of what it judges (nor the price data the service uses)."""
    code = ("import sys, infra.stub_provider; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('core', 'api', 'genai_prices')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.stdout.strip() == "[]"


# -- whatever a client sends -------------------------------------------------------------------

KEYS = ("type", "text", "image_url", "url", "detail", "input_audio", "data", "format", "file",
        "file_id", "file_data", "file_url", "role", "content", "name", "tool_calls", "function",
        "arguments", "id", "output", "summary", "include_usage", "effort", "refusal", "source",
        "media_type", "cache_control", "ttl", "input", "tool_use_id", "thinking", "signature",
        "budget_tokens", "input_schema", "max_uses", "title", "encrypted_content", "tools",
        "variables", "action", "query")
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3_000) | st.sampled_from(
        ["text", "image_url", "input_image", "input_audio", "file", "input_file", "user",
         "function_call", "item_reference", "low", "wav", "mp3", "data:image/png;base64,AA==",
         "https://x.example/a.png", "priority", "auto", "required", "audio", "image", "document",
         "tool_use", "tool_result", "thinking", "base64", "url", "ephemeral", "1h", "5m",
         "assistant", "web_search_20250305", "web_search", "enabled", "disabled", "object",
         "application/pdf", "image/png", "any", "tool", "none", b64(png(20, 20)),
         "web_search_result", "server_tool_use", "namespace", "web_search_preview", "reasoning",
         "gAAAAAx", "summary_text"]) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(KEYS) | st.text(max_size=4), inner, max_size=5),
    max_leaves=25,
)
OPTIONAL = {f: JSON for f in (
    "n", "max_tokens", "max_completion_tokens", "max_output_tokens", "service_tier", "stream",
    "stream_options", "tools", "tool_choice", "reasoning", "reasoning_effort", "prediction",
    "modalities", "instructions", "text", "response_format", "store", "system", "thinking",
    "stop_sequences", "temperature", "top_p", "top_k", "metadata", "cache_control", "container",
    "previous_response_id", "conversation", "prompt", "truncation", "max_tool_calls", "include",
    "client_metadata", "prompt_cache_key", "parallel_tool_calls")}


# Each route with the models it serves, and the field its prompt goes in.
ROUTE_MODELS = [(route, model) for route in ROUTES for model in (
    ("claude-sonnet-4-5", "claude-opus-4-5", "claude-3-5-haiku-20241022") if route == "messages"
    else ("gpt-4o", "o3", "gpt-4.1-mini", "gpt-4o-audio-preview"))]


@settings(max_examples=examples(150), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route_model=st.sampled_from(ROUTE_MODELS), prompt=JSON, max_tokens=st.integers(0, 3_000),
       extra=st.fixed_dictionaries({}, optional=OPTIONAL))
def test_any_body_is_served_or_refused_never_failed_and_a_refusal_is_never_billed(
    http: httpx.Client, route_model: tuple[str, str], prompt: Any, max_tokens: int,
    extra: dict[str, Any],
) -> None:
    route, model = route_model
    path, _, headers, _ = ROUTES[route]
    before = bill_of(http).total.calls
    body = {"model": model, "input" if path == RESPONSES else "messages": prompt,
            **({"max_tokens": max_tokens} if path == MESSAGES else {}), **extra}
    response = http.post(path, json=body, headers=headers)
    assert response.status_code in (200, 400), response.text
    billed = bill_of(http).total.calls - before
    assert billed == (response.status_code == 200)
