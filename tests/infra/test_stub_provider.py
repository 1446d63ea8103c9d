"""The stub provider is the witness the proof trusts: it must bill what a provider would.

Every figure here is worked by hand from the providers' documentation (cited beside it), never
computed by the code under test, and this module imports nothing from `core`: the witness is
checked against the documents, not against the service it judges. Calls go through the real
`openai` SDK wherever a client would use it; raw httpx where a test reads the wire itself.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infra.processes import free_port, tls_context
from infra.stub_bill import Bill, CallRecord
from infra.stub_provider import StubProvider, fetch_bill, reset_bill
from tests.infra.media import b64, data_url, gif, jpeg, mp3, pdf, png, wav, webp
from tests.support import examples

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
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


@pytest.fixture(scope="module")
def provider() -> Iterator[StubProvider]:
    with StubProvider(seed=3, latency_ms_min=0, latency_ms_max=5, prices=TABLE) as stub:
        yield stub


@pytest.fixture(scope="module")
def http(provider: StubProvider) -> Iterator[httpx.Client]:
    # One client: building an httpx client costs ~60 ms (its SSL context), a call a millisecond.
    with httpx.Client(base_url=provider.url, timeout=10.0) as client:
        yield client


@pytest.fixture(scope="module")
def sdk(provider: StubProvider) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{provider.url}/v1", api_key="sk-test", max_retries=0,
                         timeout=10.0)


@pytest.fixture(autouse=True)
def fresh_bill(http: httpx.Client) -> None:
    http.post("/control", json={"images": {}, "files": {}, "prompt_cache": True,
                                "default_service_tier": "default",
                                "upstream_fields": "openai"}).raise_for_status()
    http.post("/billing/reset").raise_for_status()


def bill_of(http: httpx.Client) -> Bill:
    return Bill.from_json(http.get("/billing").json())


def only_call(http: httpx.Client) -> CallRecord:
    [call] = bill_of(http).log
    return call


def forced(tokens: int, **more: str) -> dict[str, str]:
    return {"X-Stub-Output-Tokens": str(tokens), **more}


def image_message(url: str, detail: str | None = "high") -> list[dict[str, Any]]:
    image: dict[str, Any] = {"url": url} | ({"detail": detail} if detail else {})
    # "what is this?": 13 bytes -> 4 tokens; the image part's JSON is not text.
    return [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                         {"type": "image_url", "image_url": image}]}]


# Prompt tokens of image_message around an image of N tokens: 4 text + 4 message + 3 reply.
IMAGE_FRAME_TOKENS = 11


# -- pricing -----------------------------------------------------------------------------------


def test_the_bill_prices_at_the_stubs_own_rates_rounded_up_once(
    sdk: openai.OpenAI, http: httpx.Client
) -> None:
    # gpt-4o: $2.50 in, $10.00 out per million tokens (developers.openai.com/api/docs/pricing).
    answer = sdk.chat.completions.with_raw_response.create(
        model="gpt-4o", messages=HELLO, max_tokens=300, extra_headers=forced(100)).parse()
    assert answer.usage is not None
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (HELLO_TOKENS, 100)
    # gpt-4o-mini: $0.15 in, $0.60 out.
    sdk.chat.completions.create(model="gpt-4o-mini", messages=HELLO, max_tokens=300,
                                extra_headers=forced(7))
    bill = bill_of(http)
    # 9 x 2.5 + 100 x 10 = 1,022.5 -> 1,023; 9 x 0.15 + 7 x 0.6 = 5.55 -> 6.
    assert {m: t.cost_micros for m, t in bill.by_model.items()} == {"gpt-4o": 1_023,
                                                                    "gpt-4o-mini": 6}
    assert (bill.requests, bill.total.calls, bill.total.cost_micros) == (2, 2, 1_029)
    assert [c.cost_micros for c in bill.log] == [1_023, 6]


def test_a_callers_table_prices_its_own_models_from_a_dict_or_a_file(tmp_path: Path) -> None:
    table = {"models": {"my-model": {"input_usd_per_mtok": "3.00",
                                     "output_usd_per_mtok": "7.00"}}}
    path = tmp_path / "stub-table.json"
    path.write_text(json.dumps(table))
    for prices in (table, str(path)):
        with StubProvider(latency_ms_min=0, latency_ms_max=0, prices=prices) as stub:
            client = openai.OpenAI(base_url=f"{stub.url}/v1", api_key="k", max_retries=0)
            client.chat.completions.create(model="my-model", messages=HELLO, max_tokens=50,
                                           extra_headers=forced(10))
            client.chat.completions.create(model="gpt-4o", messages=HELLO, max_tokens=50,
                                           extra_headers=forced(10))
            bill = fetch_bill(stub.url)
            # 9 x 3 + 10 x 7 = 97; the default table still prices gpt-4o: 22.5 + 100 -> 123.
            assert {m: t.cost_micros for m, t in bill.by_model.items()} == {
                "my-model": 97, "gpt-4o": 123}


@pytest.mark.parametrize(("table", "why"), [
    ({"models": {"m": {"input_usd_per_mtok": "1"}}}, "output_usd_per_mtok is required"),
    ({"models": {"m": {"input_usd_per_mtok": 1, "output_usd_per_mtok": "1"}}}, "decimal string"),
    ({"models": {"m": {"input_usd_per_mtok": "1", "output_usd_per_mtok": "1", "colour": "x"}}},
     "unknown fields"),
    ({"models": {"m": {"input_usd_per_mtok": "-1", "output_usd_per_mtok": "1"}}}, "negative"),
    ({"models": {"m": {"input_usd_per_mtok": "1", "output_usd_per_mtok": "1",
                       "image": {"rule": "tile", "base_tokens": 85}}}}, "tile rule"),
    ({"m": {}}, "models"),
    ({"models": {"m": {"input_usd_per_mtok": "1", "output_usd_per_mtok": "1",
                       "web_search_usd_per_call": 0.01}}}, "decimal string"),
    ({"models": {}, "openrouter": {"web_plugin_usd_per_1k_results": "4.00"}}, "openrouter"),
])
def test_a_bad_table_is_refused(table: dict[str, Any], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        StubProvider(prices=table).app()


def test_a_request_fee_is_billed_once_a_call(sdk: openai.OpenAI, http: httpx.Client) -> None:
    sdk.chat.completions.create(model="stub-fee", messages=HELLO, max_tokens=50, n=2,
                                extra_headers=forced(10))
    # 9 x 1 + 20 x 4 + $0.01 (10,000 micro-dollars) = 10,089.
    assert only_call(http).cost_micros == 10_089


def test_priority_is_billed_at_priority_rates_and_said_so(
    sdk: openai.OpenAI, http: httpx.Client
) -> None:
    answer = sdk.chat.completions.create(model="gpt-4o", messages=HELLO, max_tokens=200,
                                         service_tier="priority", extra_headers=forced(100))
    assert answer.service_tier == "priority"
    # Priority gpt-4o: $4.25 in, $17.00 out (openai.com/api-priority-processing):
    # 9 x 4.25 + 100 x 17 = 1,738.25 -> 1,739.
    call = only_call(http)
    assert (call.cost_micros, call.service_tier) == (1_739, "priority")


def test_a_tier_the_model_lacks_is_refused_unbilled(sdk: openai.OpenAI, http: httpx.Client) -> None:
    for tier in ("priority", "flex"):  # gpt-5-nano has no priority row; flex is not modelled
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.chat.completions.create(model="gpt-5-nano", messages=HELLO,
                                        max_completion_tokens=50, service_tier=tier)  # type: ignore[arg-type]
        assert refused.value.param == "service_tier"
    bill = bill_of(http)
    assert (bill.requests, bill.total.calls) == (2, 0)


def test_auto_is_served_at_the_projects_default_tier(
    sdk: openai.OpenAI, http: httpx.Client
) -> None:
    http.post("/control", json={"default_service_tier": "priority"}).raise_for_status()
    answer = sdk.chat.completions.create(model="gpt-4o", messages=HELLO, max_tokens=50,
                                         service_tier="auto", extra_headers=forced(10))
    assert answer.service_tier == "priority"
    # 9 x 4.25 + 10 x 17 = 208.25 -> 209.
    assert only_call(http).cost_micros == 209


# -- text --------------------------------------------------------------------------------------


def test_text_is_counted_by_its_bytes_and_only_text_counts(
    sdk: openai.OpenAI, http: httpx.Client
) -> None:
    messages: Any = [
        {"role": "system", "content": "Be brief."},  # 9 bytes -> 3, + 4
        {"role": "user", "content": [{"type": "text", "text": "Grüße, 世界"}]},  # 16 -> 4, + 4
        {"role": "assistant", "content": None, "tool_calls": [  # "look" + "{}" = 6 -> 2, + 4
            {"id": "c1", "type": "function", "function": {"name": "look", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},  # 5 -> 2, + 4
    ]
    answer = sdk.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=5)
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == 3 + 4 + 4 + 4 + 2 + 4 + 2 + 4 + 3


def test_tool_definitions_are_billed_by_their_json_bytes(sdk: openai.OpenAI) -> None:
    tools: Any = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    size = len(json.dumps(tools, separators=(",", ":")).encode())
    answer = sdk.chat.completions.create(model="gpt-4o", messages=HELLO, max_tokens=5,
                                         tools=tools)
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == HELLO_TOKENS + -(-size // 4)


# -- images (https://developers.openai.com/api/docs/guides/images-vision, calculating costs) ----


@pytest.mark.parametrize(("model", "size", "detail", "tokens"), [
    # 1024 x 1024 high: fits 2048; shortest side 1024 -> 768: 768 x 768 = 2 x 2 tiles;
    # 85 + 4 x 170 = 765, the guide's own example.
    ("gpt-4o", (1024, 1024), "high", 765),
    ("gpt-4o", (1024, 1024), "auto", 765),  # auto is billed as high
    ("gpt-4o", (1024, 1024), None, 765),  # no detail is auto
    ("gpt-4o", (1024, 1024), "low", 85),  # low: the base, whatever the size
    # 2048 x 4096 high: fit to 1024 x 2048, shortest side to 768: 768 x 1536 = 2 x 3 tiles;
    # 85 + 6 x 170 = 1,105, the guide's second example.
    ("gpt-4o", (2048, 4096), "high", 1_105),
    # 4096 x 1024: fit to 2048 x 512; the shortest side, 512, is not scaled up: 4 x 1 tiles.
    ("gpt-4o", (4096, 1024), "high", 85 + 4 * 170),
    ("gpt-4o", (300, 200), "high", 255),  # never scaled up: 1 tile
    ("gpt-4o-mini", (1024, 1024), "high", 2_833 + 4 * 5_667),
    ("o3", (1024, 1024), "high", 75 + 4 * 150),
    ("gpt-5", (1024, 1024), "high", 70 + 4 * 140),
    # Patch rule: 32 x 32 = 1,024 patches x 1.62 = 1,658.88 -> 1,659; detail does not apply.
    ("gpt-4.1-mini", (1024, 1024), "low", 1_659),
    # 1800 x 2400: 57 x 75 = 4,275 patches > 1,536: shrink by sqrt(1024 x 1536 / 4,320,000),
    # then to whole patches across: 1,056 x 1,408 = 33 x 44 = 1,452 patches (the guide's
    # example); x 1.62 = 2,352.24 -> 2,353.
    ("gpt-4.1-mini", (1800, 2400), "high", 2_353),
    ("o4-mini", (1024, 1024), "high", 1_762),  # 1,024 x 1.72 = 1,761.28 -> 1,762
    ("gpt-5-mini", (64, 64), "high", 7),  # 2 x 2 patches x 1.62 = 6.48 -> 7
])
def test_an_image_is_billed_by_the_models_documented_rule(
    sdk: openai.OpenAI, http: httpx.Client, model: str, size: tuple[int, int],
    detail: str | None, tokens: int,
) -> None:
    cap = {"max_completion_tokens": 5} if model.startswith(("o", "gpt-5")) else {"max_tokens": 5}
    answer = sdk.chat.completions.create(
        model=model, messages=image_message(data_url("image/png", png(*size)), detail), **cap,  # type: ignore[arg-type]
    )
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == IMAGE_FRAME_TOKENS + tokens
    assert bill_of(http).total.image_input_tokens == tokens


@pytest.mark.parametrize("image", [
    ("image/jpeg", jpeg(1024, 1024)), ("image/gif", gif(1024, 1024)),
    ("image/webp", webp(1024, 1024, "VP8X")), ("image/webp", webp(1024, 1024, "VP8L")),
    ("image/webp", webp(1024, 1024, "VP8 ")),
], ids=["jpeg", "gif", "webp-extended", "webp-lossless", "webp-lossy"])
def test_every_image_format_gives_its_size(sdk: openai.OpenAI, image: tuple[str, bytes]) -> None:
    answer = sdk.chat.completions.create(
        model="gpt-4o", messages=image_message(data_url(*image)), max_tokens=5)  # type: ignore[arg-type]
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == IMAGE_FRAME_TOKENS + 765


def test_an_image_url_is_billed_from_the_registry_and_refused_when_unknown(
    sdk: openai.OpenAI, http: httpx.Client
) -> None:
    url = "https://images.example/cat.png"
    with pytest.raises(openai.BadRequestError, match="could not be downloaded"):
        sdk.chat.completions.create(model="gpt-4o", messages=image_message(url),  # type: ignore[arg-type]
                                    max_tokens=5)
    assert bill_of(http).total.calls == 0
    http.post("/control", json={"images": {url: [2048, 4096]}}).raise_for_status()
    answer = sdk.chat.completions.create(model="gpt-4o", messages=image_message(url),  # type: ignore[arg-type]
                                         max_tokens=5)
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == IMAGE_FRAME_TOKENS + 1_105


@pytest.mark.parametrize(("model", "content", "why"), [
    ("gpt-4o-audio-preview", image_message(data_url("image/png", png(8, 8)))[0]["content"],
     "does not accept image input"),
    ("gpt-4o", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
     "not a PNG, JPEG"),
    ("gpt-4o", [{"type": "image_url", "image_url": {"url": "data:text/plain;base64,"
                                                    + b64(png(8, 8))}}], "must be image"),
    ("gpt-4o", [{"type": "image_url", "image_url": {"url": "ftp://x/y.png"}}], "needs a data"),
    ("gpt-4o", [{"type": "video", "video": {}}], "not served"),
])
def test_content_it_cannot_read_is_refused_unbilled(
    http: httpx.Client, model: str, content: Any, why: str
) -> None:
    response = http.post(CHAT, json={"model": model, "max_tokens": 5,
                                     "messages": [{"role": "user", "content": content}]})
    assert response.status_code == 400
    assert why in response.json()["error"]["message"]
    assert bill_of(http).total.calls == 0


# -- audio -------------------------------------------------------------------------------------


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
    # gpt-4o-audio-preview: text $2.50 in, $10 out; audio $40 in per million tokens
    # (developers.openai.com/api/docs/models/gpt-4o-audio-preview).
    assert only_call(http).cost_micros == -(-(10 * 25 + audio_tokens * 400 + 10 * 100) // 10)


def test_audio_for_a_model_without_an_audio_rate_is_refused(http: httpx.Client) -> None:
    part = {"type": "input_audio", "input_audio": {"data": b64(wav(100)), "format": "wav"}}
    response = http.post(CHAT, json={"model": "gpt-4o", "max_tokens": 5,
                                     "messages": [{"role": "user", "content": [part]}]})
    assert response.status_code == 400
    assert "does not accept audio input" in response.json()["error"]["message"]
    assert bill_of(http).total.calls == 0


def test_audio_output_is_billed_at_the_audio_output_rate(
    sdk: openai.OpenAI, http: httpx.Client
) -> None:
    answer = sdk.chat.completions.create(
        model="gpt-4o-audio-preview", messages=HELLO, max_tokens=50, modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "wav"}, extra_headers=forced(10))
    assert answer.usage is not None
    assert answer.usage.completion_tokens_details is not None
    assert answer.usage.completion_tokens_details.audio_tokens == 10
    # 9 x 2.5 + 10 x $80 audio out = 22.5 + 800 -> 823.
    assert only_call(http).cost_micros == 823


# -- files and references ----------------------------------------------------------------------


def test_a_pdf_is_billed_for_its_bytes_and_an_image_of_each_page(
    sdk: openai.OpenAI, http: httpx.Client
) -> None:
    document = pdf(2)
    messages: Any = [{"role": "user", "content": [
        {"type": "file", "file": {"filename": "a.pdf",
                                  "file_data": data_url("application/pdf", document)}}]}]
    answer = sdk.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=5)
    # A page is a 1224 x 1584 image: shortest side to 768 -> 768 x 993.9 = 2 x 2 tiles = 765.
    file_tokens = -(-len(document) // 4) + 2 * 765
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == 4 + 3 + file_tokens
    assert bill_of(http).total.file_input_tokens == file_tokens


def test_files_and_items_by_reference_are_billed_from_the_registry(
    sdk: openai.OpenAI, http: httpx.Client
) -> None:
    http.post("/control", json={"files": {
        "file-big": {"bytes": 400_000}, "https://files.example/r.pdf": {"bytes": 4, "pages": 1},
        "msg_stored": {"bytes": 40_000}, "file-img": {"bytes": 10, "image": [1024, 1024]},
    }}).raise_for_status()
    by_id: Any = [{"role": "user", "content": [{"type": "file", "file": {"file_id": "file-big"}}]}]
    answer = sdk.chat.completions.create(model="gpt-4o", messages=by_id, max_tokens=5)
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == 7 + 100_000
    parts: Any = [{"type": "input_file", "file_url": "https://files.example/r.pdf"},
                  {"type": "input_image", "file_id": "file-img", "detail": "low"}]
    items: Any = [{"role": "user", "content": parts}, {"type": "item_reference",
                                                       "id": "msg_stored"}]
    response = sdk.responses.create(model="gpt-4o", input=items, max_output_tokens=5)
    assert response.usage is not None
    # File: 4 bytes -> 1 + one page 765; image low: 85; framing 4 + 4 + 3; item 10,000.
    assert response.usage.input_tokens == 1 + 765 + 85 + 4 + 4 + 3 + 10_000
    for unknown in ({"type": "file", "file": {"file_id": "file-nope"}},
                    {"type": "file", "file": {"file_id": "file-big", "file_data": "AAAA"}}):
        with pytest.raises(openai.BadRequestError):
            sdk.chat.completions.create(model="gpt-4o", max_tokens=5,
                                        messages=[{"role": "user", "content": [unknown]}])  # type: ignore[list-item]
    assert bill_of(http).total.calls == 2


# -- what a provider reports: cached, reasoning, n ---------------------------------------------


def long_prompt(text: str = "x" * 5_000) -> list[dict[str, str]]:
    # 5,000 bytes -> 1,250 tokens + 4 + 3 = 1,257.
    return [{"role": "user", "content": text}]


def test_the_prompt_cache_reads_whole_prefixes_in_128_token_steps(
    sdk: openai.OpenAI, http: httpx.Client
) -> None:
    def cached(messages: Any, model: str = "gpt-4o") -> tuple[int, int]:
        usage = sdk.chat.completions.create(model=model, messages=messages, max_tokens=10,
                                            extra_headers=forced(10)).usage
        assert usage is not None
        assert usage.prompt_tokens_details is not None
        return usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0

    assert cached(long_prompt()) == (1_257, 0)  # the first call writes the cache
    # 1,257 tokens read as 1,024 + 128 = 1,152 (the next step, 1,280, is more than the prefix).
    assert cached(long_prompt()) == (1_257, 1_152)
    longer = [*long_prompt(), {"role": "user", "content": "more"}]  # + 1 + 4
    assert cached(longer) == (1_262, 1_152)
    assert cached(long_prompt(), model="gpt-4o-mini") == (1_257, 0)  # a cache per model
    assert cached(long_prompt("y" * 3_000)) == (757, 0)  # below 1,024 tokens: never cached
    # Cached tokens at $1.25: 105 x 2.5 + 1,152 x 1.25 + 10 x 10 = 262.5 + 1,440 + 100.
    assert bill_of(http).log[1].cost_micros == 1_803


def test_a_model_with_a_cache_write_rate_reports_and_bills_its_writes(
    http: httpx.Client, sdk: openai.OpenAI
) -> None:
    first = sdk.chat.completions.create(model="stub-cw", messages=long_prompt(),  # type: ignore[arg-type]
                                        max_tokens=10, extra_headers=forced(10)).usage
    again = sdk.chat.completions.create(model="stub-cw", messages=long_prompt(),  # type: ignore[arg-type]
                                        max_tokens=10, extra_headers=forced(10)).usage
    assert first is not None
    assert first.prompt_tokens_details is not None
    assert again is not None
    assert again.prompt_tokens_details is not None
    assert (first.prompt_tokens_details.cached_tokens,
            first.prompt_tokens_details.cache_write_tokens) == (0, 1_152)
    assert (again.prompt_tokens_details.cached_tokens,
            again.prompt_tokens_details.cache_write_tokens) == (1_152, 0)
    # Writes at $1.25: 105 x 1 + 1,152 x 1.25 + 40 = 1,585; reads at $0.10: 105 + 115.2 + 40.
    assert [c.cost_micros for c in bill_of(http).log] == [1_585, 261]


def test_cached_tokens_can_be_forced_by_header_or_control(
    sdk: openai.OpenAI, http: httpx.Client
) -> None:
    usage = sdk.chat.completions.create(
        model="gpt-4o", messages=long_prompt(), max_tokens=10,  # type: ignore[arg-type]
        extra_headers=forced(10, **{"X-Stub-Cached-Tokens": "1000"})).usage
    assert usage is not None
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 1_000
    http.post("/control", json={"cached_tokens": 5, "calls": 1}).raise_for_status()
    usage = sdk.chat.completions.create(model="gpt-4o", messages=HELLO, max_tokens=10,
                                        extra_headers=forced(10)).usage
    assert usage is not None
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 5
    # 257 x 2.5 + 1,000 x 1.25 + 100 = 1,992.5 -> 1,993; 4 x 2.5 + 5 x 1.25 + 100 = 116.25.
    assert [c.cost_micros for c in bill_of(http).log] == [1_993, 117]


def test_reasoning_tokens_are_output_within_the_cap(sdk: openai.OpenAI, http: httpx.Client) -> None:
    answer = sdk.chat.completions.create(model="o3", messages=HELLO, max_completion_tokens=500,
                                         extra_headers=forced(100))
    usage = answer.usage
    assert usage is not None
    assert usage.completion_tokens_details is not None
    # Medium effort (the default): half the answer is reasoning, half the words you see.
    assert (usage.completion_tokens, usage.completion_tokens_details.reasoning_tokens) == (100, 50)
    assert len((answer.choices[0].message.content or "").split()) == 50
    low = sdk.chat.completions.create(model="o3", messages=HELLO, max_completion_tokens=500,
                                      reasoning_effort="low", extra_headers=forced(100)).usage
    assert low is not None
    assert low.completion_tokens_details is not None
    assert low.completion_tokens_details.reasoning_tokens == 25
    capped = sdk.chat.completions.create(model="o3", messages=HELLO, max_completion_tokens=40,
                                         extra_headers=forced(100))
    assert capped.usage is not None
    assert capped.usage.completion_tokens_details is not None
    assert (capped.usage.completion_tokens,
            capped.usage.completion_tokens_details.reasoning_tokens) == (40, 20)
    assert capped.choices[0].finish_reason == "length"
    # o3: $2 in, $8 out; reasoning is output: 9 x 2 + 100 x 8 = 818; 18 + 800; 18 + 320.
    assert [c.cost_micros for c in bill_of(http).log] == [818, 818, 338]


def test_reasoning_can_be_all_of_an_answer(sdk: openai.OpenAI) -> None:
    answer = sdk.chat.completions.create(
        model="o3", messages=HELLO, max_completion_tokens=64,
        extra_headers=forced(64, **{"X-Stub-Reasoning-Tokens": "64"}))
    assert answer.usage is not None
    assert (answer.choices[0].message.content, answer.usage.completion_tokens) == ("", 64)


@pytest.mark.parametrize(("model", "extra", "param"), [
    ("o3", {"max_tokens": 50}, "max_tokens"),
    ("gpt-4o", {"max_tokens": 50, "reasoning_effort": "high"}, "reasoning_effort"),
])
def test_reasoning_parameters_are_checked_as_openai_does(
    http: httpx.Client, model: str, extra: dict[str, Any], param: str
) -> None:
    response = http.post(CHAT, json={"model": model, "messages": HELLO, **extra})
    assert (response.status_code, response.json()["error"]["param"]) == (400, param)


def test_n_choices_are_each_drawn_and_summed(sdk: openai.OpenAI, http: httpx.Client) -> None:
    answer = sdk.chat.completions.create(model="gpt-4o", messages=HELLO, max_tokens=50, n=3,
                                         extra_headers=forced(10))
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert answer.usage is not None
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (HELLO_TOKENS, 30)
    assert only_call(http).cost_micros == 323  # 9 x 2.5 + 30 x 10 = 322.5
    drawn = sdk.chat.completions.create(model="gpt-4o", messages=HELLO, max_tokens=4_000, n=4)
    lengths = [len((c.message.content or "").split()) for c in drawn.choices]
    assert drawn.usage is not None
    assert drawn.usage.completion_tokens == sum(lengths)
    assert len(set(lengths)) > 1  # each its own draw


def test_a_stream_of_n_choices_carries_each_and_the_summed_usage(sdk: openai.OpenAI) -> None:
    chunks = list(sdk.chat.completions.create(
        model="gpt-4o", messages=HELLO, max_tokens=50, n=2, stream=True,
        stream_options={"include_usage": True}, extra_headers=forced(20)))
    text = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
    assert [len(t.split()) for t in text.values()] == [20, 20]
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 40


@pytest.mark.parametrize("cap_field", ["max_tokens", "max_completion_tokens"])
def test_output_never_exceeds_the_cap(sdk: openai.OpenAI, cap_field: str) -> None:
    for _ in range(30):
        answer = sdk.chat.completions.create(model="gpt-4o", messages=HELLO,
                                             **{cap_field: 40})  # type: ignore[call-overload]
        assert answer.usage is not None
        tokens = answer.usage.completion_tokens
        assert 1 <= tokens <= 40
        assert len(answer.choices[0].message.content.split(" ")) == tokens
        assert answer.choices[0].finish_reason == ("length" if tokens == 40 else "stop")


def test_a_required_tool_is_answered_with_a_call(sdk: openai.OpenAI) -> None:
    tools: Any = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    answer = sdk.chat.completions.create(model="gpt-4o", messages=HELLO, max_tokens=50,
                                         tools=tools, tool_choice="required",
                                         extra_headers=forced(5))
    [call] = answer.choices[0].message.tool_calls or []
    assert (call.function.name, answer.choices[0].finish_reason) == ("lookup", "tool_calls")  # type: ignore[union-attr]


def test_predicted_output_it_rejects_is_billed_as_output(
    sdk: openai.OpenAI, http: httpx.Client
) -> None:
    answer = sdk.chat.completions.create(
        model="gpt-4o", messages=HELLO, max_tokens=50, extra_headers=forced(10),
        prediction={"type": "content", "content": "x" * 400})
    usage = answer.usage
    assert usage is not None
    assert usage.completion_tokens_details is not None
    # 400 bytes of prediction, none used: 100 rejected tokens on top of the 10 answered.
    assert (usage.completion_tokens, usage.completion_tokens_details.rejected_prediction_tokens
            ) == (110, 100)
    assert only_call(http).cost_micros == 1_123  # 22.5 + 1,100


# -- the Responses API ------------------------------------------------------------------------


def test_responses_answers_in_openais_format(sdk: openai.OpenAI, http: httpx.Client) -> None:
    response = sdk.responses.create(model="gpt-4o", input="hello", instructions="Be brief.",
                                    max_output_tokens=100, extra_headers=forced(30))
    assert (response.status, response.object, response.service_tier) == (
        "completed", "response", "default")
    assert len(response.output_text.split()) == 30
    assert response.usage is not None
    # "Be brief." 9 bytes -> 3 + 4; "hello" 2 + 4; + 3 for the reply.
    assert (response.usage.input_tokens, response.usage.output_tokens,
            response.usage.total_tokens) == (16, 30, 46)
    assert response.usage.input_tokens_details.cached_tokens == 0
    assert only_call(http).cost_micros == 340  # 16 x 2.5 + 30 x 10


def test_responses_stops_at_its_cap_as_incomplete_with_reasoning(sdk: openai.OpenAI) -> None:
    response = sdk.responses.create(model="o4-mini", input="hello", max_output_tokens=40,
                                    reasoning={"effort": "high"}, extra_headers=forced(100))
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None
    assert (response.usage.output_tokens,
            response.usage.output_tokens_details.reasoning_tokens) == (40, 30)
    assert [item.type for item in response.output] == ["reasoning", "message"]


def test_responses_streams_events_ending_with_the_usage(sdk: openai.OpenAI) -> None:
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
    completed = events[-1]
    assert completed.type == "response.completed"
    assert completed.response.usage is not None
    assert completed.response.usage.output_tokens == 40
    with sdk.responses.stream(model="gpt-4o", input="hello", max_output_tokens=100,
                              extra_headers=forced(40)) as stream:
        assert stream.get_final_response().output_text == text
    capped = list(sdk.responses.create(model="gpt-4o", input="hello", max_output_tokens=20,
                                       stream=True, extra_headers=forced(40)))
    assert capped[-1].type == "response.incomplete"


def test_responses_serves_function_tools_and_their_outputs(sdk: openai.OpenAI) -> None:
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


def test_a_previous_response_is_billed_as_input(sdk: openai.OpenAI, http: httpx.Client) -> None:
    first = sdk.responses.create(model="gpt-4o", input="hello", max_output_tokens=50,
                                 extra_headers=forced(20))
    second = sdk.responses.create(model="gpt-4o", input="hello", max_output_tokens=50,
                                  previous_response_id=first.id)
    assert second.usage is not None
    # The stored conversation: its 9 input tokens and 20 output tokens, before the new input.
    assert second.usage.input_tokens == 9 + 20 + 9
    with pytest.raises(openai.BadRequestError):
        sdk.responses.create(model="gpt-4o", input="hi", previous_response_id="resp_nope")
    assert bill_of(http).total.calls == 2


def test_responses_refuses_hosted_tools_and_unknown_items(http: httpx.Client) -> None:
    for body in ({"input": "hi", "tools": [{"type": "web_search"}]},
                 {"input": [{"type": "computer_call_output", "output": {}}]},
                 {"input": "hi", "n": 2}):
        response = http.post(RESPONSES, json={"model": "gpt-4o", **body})
        assert response.status_code == 400
    assert bill_of(http).total.calls == 0


# -- streams -----------------------------------------------------------------------------------


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


def test_a_chat_stream_carries_usage_in_its_last_chunk_when_asked(
    sdk: openai.OpenAI, http: httpx.Client
) -> None:
    chunks = list(sdk.chat.completions.create(
        model="gpt-4o", messages=HELLO, max_tokens=100, stream=True,
        stream_options={"include_usage": True}))
    *content, last = chunks
    text = "".join(c.choices[0].delta.content or "" for c in content)
    assert last.choices == []
    assert last.usage is not None
    assert len(text.split(" ")) == last.usage.completion_tokens
    assert content[-1].choices[0].finish_reason in ("stop", "length")
    assert all(c.usage is None for c in content)
    # 9 x 2.5 + output x 10, rounded up.
    assert only_call(http).cost_micros == -(-(9 * 25 + last.usage.completion_tokens * 100) // 10)
    assert only_call(http).stream


def test_a_stream_without_include_usage_has_no_usage_but_is_billed(
    sdk: openai.OpenAI, http: httpx.Client
) -> None:
    chunks = list(sdk.chat.completions.create(model="gpt-4o", messages=HELLO, max_tokens=50,
                                              stream=True))
    assert all(c.usage is None and c.choices for c in chunks)
    assert bill_of(http).total.calls == 1


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
    assert all("usage" in e for e in events)
    assert seen == sorted(seen)
    assert seen[0] == 0
    assert seen[-1] == 40
    assert {e["usage"]["prompt_tokens"] for e in events} == {HELLO_TOKENS}


def test_a_broken_stream_is_billed_in_full_and_its_last_usage_is_partial(
    http: httpx.Client
) -> None:
    headers = forced(100, **{"X-Stub-Break-After-Events": "3", "X-Stub-Continuous-Usage": "1"})
    events, clean = sse_data(http, CHAT, {
        "model": "gpt-4o", "messages": HELLO, "max_tokens": 200, "stream": True,
        "stream_options": {"include_usage": True}}, headers)
    assert not clean  # the connection dropped: no [DONE], no final usage
    assert len(events) == 3
    assert events[-1]["usage"]["completion_tokens"] == 32  # two 16-token deltas, of 100
    call = only_call(http)
    assert (call.billed, call.usage.output_tokens if call.usage else None) == (True, 100)
    assert call.cost_micros == 1_023  # 9 x 2.5 + 100 x 10, all of it
    assert call.fault == "break_after_events"


def test_a_stream_broken_after_no_events_sends_none_and_is_billed(http: httpx.Client) -> None:
    # 0 is a count, not "off": the connection drops before the first event.
    http.post("/control", json={"break_after_events": 0, "calls": 1}).raise_for_status()
    events, clean = sse_data(http, CHAT, {"model": "gpt-4o", "messages": HELLO,
                                          "max_tokens": 100, "stream": True}, forced(60))
    assert (clean, events) == (False, [])
    call = only_call(http)
    assert (call.billed, call.fault) == (True, "break_after_events")


def test_a_broken_responses_stream_never_sends_its_terminal_event(http: httpx.Client) -> None:
    http.post("/control", json={"break_after_events": 5, "calls": 1}).raise_for_status()
    events, clean = sse_data(http, RESPONSES, {"model": "gpt-4o", "input": "hello",
                                               "max_output_tokens": 100, "stream": True},
                             forced(60))
    assert (clean, len(events)) == (False, 5)
    assert all(e["type"] not in ("response.completed", "response.incomplete") for e in events)
    assert bill_of(http).total.output_tokens == 60
    assert sse_data(http, RESPONSES, {"model": "gpt-4o", "input": "hello",
                                      "max_output_tokens": 100, "stream": True})[1]


def test_a_broken_answer_drops_the_connection_after_billing(
    sdk: openai.OpenAI, http: httpx.Client
) -> None:
    with pytest.raises(openai.APIConnectionError):
        sdk.chat.completions.create(model="gpt-4o", messages=HELLO, max_tokens=50,
                                    extra_headers={"X-Stub-Break-After-Events": "0"})
    assert only_call(http).billed


# -- faults ------------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [500, 503, 408, 499, 520, 521, 522, 523, 524])
def test_a_failure_after_billing_is_billed_in_full(
    sdk: openai.OpenAI, http: httpx.Client, status: int
) -> None:
    with pytest.raises(openai.APIStatusError) as failed:
        sdk.chat.completions.create(
            model="gpt-4o", messages=HELLO, max_tokens=50,
            extra_headers=forced(10, **{"X-Stub-Fail-After-Billing": str(status)}))
    assert failed.value.status_code == status
    call = only_call(http)
    assert (call.status, call.billed, call.cost_micros, call.fault) == (
        status, True, 123, "fail_after_billing")  # 22.5 + 100


def test_the_control_route_fails_the_next_calls_after_billing_then_recovers(
    http: httpx.Client
) -> None:
    http.post("/control", json={"fail_after_billing": 524, "calls": 2}).raise_for_status()
    statuses = [http.post(CHAT, json={"model": "gpt-4o", "messages": HELLO,
                                      "max_tokens": 5}).status_code for _ in range(3)]
    assert statuses == [524, 524, 200]
    bill = bill_of(http)
    assert (bill.requests, bill.total.calls) == (3, 3)
    assert [c.status for c in bill.log] == [524, 524, 200]


def test_a_hang_after_billing_is_billed_and_never_answered(http: httpx.Client) -> None:
    with pytest.raises(httpx.ReadTimeout):
        http.post(RESPONSES, json={"model": "gpt-4o", "input": "hi", "max_output_tokens": 5},
                  headers={"X-Stub-Hang-After-Billing": "1"}, timeout=0.3)
    call = only_call(http)
    assert (call.billed, call.status, call.api) == (True, 0, "responses")


def test_a_hung_call_never_answers_and_is_not_billed(http: httpx.Client) -> None:
    with pytest.raises(httpx.ReadTimeout):
        http.post(CHAT, json={"model": "gpt-4o", "messages": HELLO},
                  headers={"X-Stub-Hang": "1"}, timeout=0.3)
    bill = bill_of(http)
    assert (bill.requests, bill.total.calls) == (1, 0)


@pytest.mark.parametrize("status", [429, 500, 503])
def test_a_failure_header_answers_that_status_unbilled(http: httpx.Client, status: int) -> None:
    response = http.post(CHAT, json={"model": "gpt-4o", "messages": HELLO},
                         headers={"X-Stub-Fail-Status": str(status)})
    assert response.status_code == status
    assert response.json()["error"]["code"] == "stub_failure"
    bill = bill_of(http)
    assert (bill.requests, bill.total.calls, bill.total.cost_micros) == (1, 0, 0)
    assert [(c.status, c.billed) for c in bill.log] == [(status, False)]


def test_the_control_route_fails_the_next_calls_then_recovers(http: httpx.Client) -> None:
    http.post("/control", json={"fail_status": 502, "calls": 2}).raise_for_status()
    statuses = [http.post(CHAT, json={"model": "gpt-4o", "messages": HELLO}).status_code
                for _ in range(3)]
    assert statuses == [502, 502, 200]
    assert http.get("/control").json()["calls"] == 0


def test_the_control_route_hangs_until_cleared(http: httpx.Client) -> None:
    http.post("/control", json={"hang": True}).raise_for_status()
    for _ in range(2):
        with pytest.raises(httpx.ReadTimeout):
            http.post(CHAT, json={"model": "gpt-4o", "messages": HELLO}, timeout=0.3)
    http.post("/control", json={}).raise_for_status()
    assert http.post(CHAT, json={"model": "gpt-4o", "messages": HELLO}).status_code == 200
    bill = bill_of(http)
    assert (bill.requests, bill.total.calls) == (3, 1)


@pytest.mark.parametrize("body", [
    {"fail_status": 200}, {"hang": True, "fail_status": 500}, {"calls": 0, "hang": True},
    {"other": 1}, {"fail_after_billing": 503, "break_after_events": 2},
    {"images": {"https://x/y.png": [0, 10]}}, {"files": {"f": {"bytes": -1}}},
    {"prompt_cache": "yes"}, {"upstream_fields": "anthropic"},
])
def test_the_control_route_refuses_nonsense(http: httpx.Client, body: Any) -> None:
    assert http.post("/control", json=body).status_code == 400


@pytest.mark.parametrize(("body", "status", "code"), [
    ({"model": "no-such-model-anywhere", "messages": HELLO}, 404, "model_not_found"),
    ({"model": "gpt-4o", "messages": HELLO, "n": 0}, 400, "invalid_request"),
    ({"model": "gpt-4o", "messages": []}, 400, "invalid_request"),
    ({"model": "gpt-4o", "messages": HELLO, "max_tokens": 0}, 400, "invalid_request"),
    ({"model": "gpt-4o", "messages": HELLO, "web_search_options": {}}, 400, "invalid_request"),
])
def test_what_it_cannot_serve_is_refused_unbilled(
    http: httpx.Client, body: dict[str, Any], status: int, code: str
) -> None:
    response = http.post(CHAT, json=body)
    assert (response.status_code, response.json()["error"]["code"]) == (status, code)
    bill = bill_of(http)
    assert bill.total.calls == 0
    assert [(c.status, c.billed) for c in bill.log] == [(status, False)]


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


def test_a_refused_search_call_is_not_billed(http: httpx.Client) -> None:
    for body, headers, status in (
        ({"web_search_options": {"search_context_size": "huge"}}, {}, 400),
        ({}, {"X-Stub-Fail-Status": "503"}, 503),
    ):
        response = http.post(CHAT, json={"model": "gpt-4o-search-preview", "messages": HELLO,
                                         **body}, headers=headers)
        assert response.status_code == status
    bill = bill_of(http)
    assert (bill.requests, bill.total.calls, bill.total.web_search_calls,
            bill.total.cost_micros) == (2, 0, 0, 0)


# OpenRouter's fields, sent to gpt-4o-mini: its web plugin and fallbacks dearer and cheaper.
OPENROUTER_FIELDS = {"plugins": [{"id": "web"}],
                     "models": ["not-priced-here", "gpt-4o", "gpt-4.1-nano"]}


def test_the_openrouter_mode_bills_the_web_plugin_and_the_dearest_fallback(
    http: httpx.Client
) -> None:
    http.post("/control", json={"upstream_fields": "openrouter"}).raise_for_status()
    base = {"model": "gpt-4o-mini", "messages": HELLO}
    http.post(CHAT, json=base, headers=forced(10)).raise_for_status()
    http.post(CHAT, json={**base, "plugins": [{"id": "web"}]}, headers=forced(10))
    http.post(RESPONSES, json={"model": "gpt-4o-mini", "input": "hello", "plugins": [
        {"id": "web", "max_results": 2}]}, headers=forced(10)).raise_for_status()
    answer = http.post(CHAT, json={**base, **OPENROUTER_FIELDS}, headers=forced(10)).json()
    # The dearest is the requested model; a search model's fee makes a fallback dearer.
    http.post(CHAT, json={"model": "gpt-4o", "messages": HELLO, "models": ["gpt-4o-mini"]},
              headers=forced(10))
    http.post(CHAT, json={**base, "models": ["gpt-4o-mini-search-preview"]}, headers=forced(10))
    plain, web, web_2, fallback, kept, search = bill_of(http).log
    assert plain.cost_micros == token_micros("gpt-4o-mini", plain)
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
    assert bill_of(http).total.calls == 6


def test_outside_the_openrouter_mode_its_fields_change_nothing(http: httpx.Client) -> None:
    base = {"model": "gpt-4o-mini", "messages": HELLO}
    http.post(CHAT, json=base, headers=forced(10)).raise_for_status()
    answer = http.post(CHAT, json={**base, **OPENROUTER_FIELDS}, headers=forced(10)).json()
    plain, sent_fields = bill_of(http).log
    assert answer["model"] == sent_fields.model == "gpt-4o-mini"
    assert sent_fields.model_requested is None
    assert sent_fields.usage is not None
    assert sent_fields.usage.web_plugin_results == 0
    assert sent_fields.cost_micros == plain.cost_micros == token_micros("gpt-4o-mini", plain)


# -- the bill and the process ------------------------------------------------------------------


def test_reset_starts_a_new_bill(provider: StubProvider, http: httpx.Client) -> None:
    http.post(CHAT, json={"model": "gpt-4o", "messages": HELLO}).raise_for_status()
    assert fetch_bill(provider.url).total.calls == 1
    reset_bill(provider.url)
    bill = fetch_bill(provider.url)
    assert (bill.requests, bill.total.calls, bill.total.cost_micros, bill.by_model,
            list(bill.log)) == (0, 0, 0, {}, [])


def test_the_bill_reads_without_its_log(provider: StubProvider, http: httpx.Client) -> None:
    http.post(CHAT, json={"model": "gpt-4o", "messages": HELLO}).raise_for_status()
    bill = fetch_bill(provider.url, with_log=False)
    assert (bill.total.calls, list(bill.log)) == (1, [])


def test_a_seed_makes_sequential_calls_reproducible() -> None:
    def draws(seed: int) -> list[int]:
        with (StubProvider(seed=seed, latency_ms_min=0, latency_ms_max=0) as stub,
              httpx.Client(base_url=stub.url) as client):
            return [client.post(CHAT, json={"model": "gpt-4o", "messages": HELLO,
                                            "max_tokens": 4_000}).json()["usage"]
                    ["completion_tokens"] for _ in range(8)]

    assert draws(11) == draws(11)
    assert draws(11) != draws(12)


def test_a_required_api_key_is_checked_before_billing() -> None:
    with StubProvider(api_key="sk-upstream", latency_ms_min=0, latency_ms_max=0) as stub:
        body = {"model": "gpt-4o", "messages": HELLO}
        assert httpx.post(stub.url + CHAT, json=body).status_code == 401
        assert httpx.post(stub.url + CHAT, json=body,
                          headers={"Authorization": "Bearer sk-upstream"}).status_code == 200
        bill = fetch_bill(stub.url)
        assert (bill.requests, bill.total.calls) == (2, 1)


def test_it_runs_as_its_own_process(tmp_path: Path) -> None:
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"models": {"proc-m": {"input_usd_per_mtok": "1.00",
                                                       "output_usd_per_mtok": "1.00"}}}))
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "infra.stub_provider", "--port", str(port), "--seed", "5",
         "--prices-file", str(table)],
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"{url}/health/live", timeout=0.5,
                             verify=tls_context()).status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the stub provider did not start"
                time.sleep(0.05)
        body = {"model": "proc-m", "messages": HELLO, "max_tokens": 5}
        assert httpx.post(url + CHAT, json=body, headers=forced(5)).status_code == 200
        assert fetch_bill(url).total.cost_micros == 14  # 9 + 5
    finally:
        os.kill(process.pid, signal.SIGTERM)
        process.wait(timeout=10)


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
        "arguments", "id", "output", "summary", "include_usage", "effort", "refusal")
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3_000) | st.sampled_from(
        ["text", "image_url", "input_image", "input_audio", "file", "input_file", "user",
         "function_call", "item_reference", "low", "wav", "mp3", "data:image/png;base64,AA==",
         "https://x.example/a.png", "priority", "auto", "required", "audio"]) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(KEYS) | st.text(max_size=4), inner, max_size=5),
    max_leaves=25,
)
OPTIONAL = {f: JSON for f in ("n", "max_tokens", "max_completion_tokens", "max_output_tokens",
                              "service_tier", "stream", "stream_options", "tools", "tool_choice",
                              "reasoning", "reasoning_effort", "prediction", "modalities",
                              "instructions", "text", "response_format", "store")}


@settings(max_examples=examples(75), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from([CHAT, RESPONSES]),
       model=st.sampled_from(["gpt-4o", "o3", "gpt-4.1-mini", "gpt-4o-audio-preview"]),
       prompt=JSON, extra=st.fixed_dictionaries({}, optional=OPTIONAL))
def test_any_body_is_served_or_refused_never_failed_and_a_refusal_is_never_billed(
    http: httpx.Client, path: str, model: str, prompt: Any, extra: dict[str, Any]
) -> None:
    before = bill_of(http).total.calls
    body = {"model": model, "messages" if path == CHAT else "input": prompt, **extra}
    response = http.post(path, json=body)
    assert response.status_code in (200, 400), response.text
    billed = bill_of(http).total.calls - before
    assert billed == (response.status_code == 200)
