"""Gemini's routes end to end: `/{v1beta,v1}/models/{model}:generateContent`,
`:streamGenerateContent?alt=sse` and `:countTokens`, resolved by the path's model to a `gemini`
upstream of CEILING_UPSTREAMS (the stub provider's Gemini API), reached through the real
google-genai SDK with the spend-ceiling key as its API key.

The stub's bill is the witness: each call's charge is compared with what the stub billed for it,
to the micro-dollar. The attacks come first: a budget too small, a model no upstream names, a
body the gateway cannot bound; each is refused (in Google's error shape, which the SDK raises)
before the stub sees anything.
"""

from __future__ import annotations

import base64
import json
import math
import struct
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import httpx
import pytest
from google import genai
from google.genai import errors, types

from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from infra.stub_provider import StubProvider, fetch_bill, reset_bill, stub_control
from tests.api.conftest import (
    ADMIN_TOKEN,
    Client,
    FaultProxy,
    account,
    as_key,
    client_for,
    ledger,
    settled,
    trailer,
)

STUB_KEY = "gemini-stub-key"
LITE, FLASH, PRO = "gemini-2.5-flash-lite", "gemini-2.5-flash", "gemini-2.5-pro"
GEMINI_3 = "gemini-3-pro-preview"  # served by the Vertex upstream
# Names that begin as a known model's and are none of its versions: one no price table knows,
# and one the operator's prices file prices as a private model. Both routed to the stub.
IMPOSTOR, PRIVATE = "gemini-2.5-flash-evil", "gemini-2.5-pro-anything"
NO_RETRY = types.HttpRetryOptions(attempts=1)
LONG = "x" * 4_000  # 1,000 tokens by the stub's rule


def stub_headers(**headers: str) -> types.HttpOptions:
    """Per-call X-Stub-* headers (the gateway forwards none of them: the stub reads them only
    when they reach it, which these do not), as a GenerateContentConfig's http_options."""
    return types.HttpOptions(headers={f"X-Stub-{k.replace('_', '-')}": v
                                      for k, v in headers.items()})


@pytest.fixture(scope="module")
def stub() -> Iterator[StubProvider]:
    with StubProvider(seed=37, latency_ms_min=0, latency_ms_max=2, output_tokens_mean=40,
                      api_key=STUB_KEY) as provider:
        yield provider


@pytest.fixture(scope="module")
def spy(stub: StubProvider) -> Iterator[FaultProxy]:
    """A proxy before the stub that keeps the last request it forwarded, as it was sent."""
    with FaultProxy(stub.port) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def gw(redis_server: RedisServer, stub: StubProvider, spy: FaultProxy,
       tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    directory = tmp_path_factory.mktemp("gateway_gemini")
    doc = {"upstreams": [
        {"name": "google", "api": "gemini", "base_url": stub.url, "api_key_env": "GEMINI_KEY",
         "models": [LITE, FLASH, IMPOSTOR, PRIVATE]},
        {"name": "google-spied", "api": "gemini", "base_url": spy.url,
         "api_key_env": "GEMINI_KEY", "models": [PRO]},
    ]}
    account_file = Path(directory) / "service-account.json"
    account_file.write_text(httpx.get(f"{stub.url}/vertex/service_account").text)
    doc["upstreams"].append({
        "name": "vertex", "api": "vertex", "base_url": stub.url, "project": "stub-project",
        "region": "us-central1", "credentials_file": str(account_file), "models": [GEMINI_3]})
    path = Path(directory) / "upstreams.json"
    path.write_text(json.dumps(doc))
    prices = Path(directory) / "prices.json"
    prices.write_text(json.dumps({"models": {PRIVATE: {
        "input_usd_per_mtok": "1.25", "output_usd_per_mtok": "10"}}}))
    with ServiceProcess({
        "CEILING_PRICES_FILE": str(prices),
        "REDIS_URL": redis_server.url, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN,
        "CEILING_UPSTREAM_TIMEOUT_S": "30", "CEILING_UPSTREAMS": str(path),
        "GEMINI_KEY": STUB_KEY,
    }) as service:
        yield service


@pytest.fixture(autouse=True)
def fresh_bill(stub: StubProvider) -> None:
    stub_control(stub.url, {"clock_offset_s": 0, "cached_contents": {},
                            "thinking_outside_output_cap": False})
    reset_bill(stub.url)


def google(gw: ServiceProcess, key: str) -> genai.Client:
    """google-genai pointed at the gateway, as its users point it: the base URL and the
    spend-ceiling key as the API key (sent in x-goog-api-key). Kept for the module: a Client
    closes its HTTP client once nothing refers to it, which `google(...).models` would not."""
    client = genai.Client(api_key=key, http_options=types.HttpOptions(
        base_url=gw.url, retry_options=NO_RETRY, timeout=30_000))
    _clients.append(client)
    return client


_clients: list[genai.Client] = []


def costs(stub: StubProvider) -> list[int]:
    return [c.cost_micros for c in fetch_bill(stub.url).log if c.billed]


def nothing_reached(stub: StubProvider) -> None:
    assert list(fetch_bill(stub.url).log) == []


def nothing_held(admin: Client, tag: str) -> None:
    period = ledger(admin, tag)
    assert (period["committed_micros"], period["reserved_micros"]) == (0, 0)


def reason(error: errors.APIError) -> str:
    """The gateway's code, as Google's shape carries it: the ErrorInfo's reason."""
    details = error.details["error"]["details"]
    return str(details[0]["reason"])


def json_text_bytes(value: object) -> int:
    """The UTF-8 bytes of `value` as JSON text (docs/gateway.md: text is held by the bytes of
    the JSON that carries it), written out by the standard library with its standard
    separators rather than by the gateway's own helper."""
    return len(json.dumps(value, ensure_ascii=False).encode())


def body(text: str = "hello", **config: Any) -> dict[str, Any]:
    return {"contents": [{"role": "user", "parts": [{"text": text}]}],
            **({"generationConfig": config} if config else {})}


# -- attacks: nothing held, nothing forwarded ------------------------------------------------


def test_a_budget_too_small_is_refused_in_googles_shape_before_the_stub_sees_anything(
        gw: ServiceProcess, admin: Client, stub: StubProvider) -> None:
    tag, key = account(admin, 50)
    with pytest.raises(errors.ClientError) as raised:
        google(gw, key).models.generate_content(
            model=LITE, contents=LONG, config=types.GenerateContentConfig(max_output_tokens=500))
    assert raised.value.status == "FAILED_PRECONDITION"
    assert reason(raised.value) == "budget_exceeded"
    nothing_reached(stub)
    nothing_held(admin, tag)
    with pytest.raises(errors.ClientError):
        list(google(gw, key).models.generate_content_stream(
            model=LITE, contents=LONG, config=types.GenerateContentConfig(max_output_tokens=500)))
    nothing_reached(stub)
    nothing_held(admin, tag)


@pytest.mark.parametrize("model", ["gemini-2.0-flash", "gpt-4o-mini", "gemini-2.5-flash@x",
                                   "nobody%2Fgemini-2.5-flash", "..%2Fgemini-2.5-flash"])
def test_a_model_no_upstream_names_is_refused_and_forwarded_nowhere(
        gw: ServiceProcess, admin: Client, stub: StubProvider, model: str) -> None:
    """Refused in Google's shape; a name with a slash is `<upstream>/<model>`, refused as the
    model it is (tests/api/test_gateway_upstreams.py: the ones that name one)."""
    tag, key = account(admin, 1_000_000)
    r = admin.post(f"/v1beta/models/{model}:generateContent", headers={"x-goog-api-key": key},
                   json=body())
    error = r.json()["error"]
    assert (r.status_code, error["code"], error["status"]) == (
        400, 400, "INVALID_ARGUMENT"), r.text
    assert error["details"][0]["reason"] in ("model_not_routed", "invalid_request"), r.text
    nothing_reached(stub)
    nothing_held(admin, tag)


def test_the_sdk_raises_an_unrouted_model(gw: ServiceProcess, admin: Client,
                                          stub: StubProvider) -> None:
    tag, key = account(admin, 1_000_000)
    with pytest.raises(errors.ClientError) as raised:
        google(gw, key).models.generate_content(model="gemini-2.0-flash", contents="hello")
    assert reason(raised.value) == "model_not_routed"
    nothing_reached(stub)
    nothing_held(admin, tag)


@pytest.mark.parametrize(("sent", "code"), [
    (body(candidateCount=9), "invalid_request"),
    ({**body(), "unknownField": 1}, "field_unsupported"),
    ({**body(), "model": "models/gemini-2.5-pro"}, "field_unsupported"),
    (body(thinkingConfig={"thinkingBudget": 1_000_000}), "input_unbounded"),
    (body(speechConfig={}), "input_unbounded"),
])
def test_a_body_the_gateway_cannot_bound_is_refused_before_the_stub_sees_it(
        gw: ServiceProcess, admin: Client, stub: StubProvider, sent: dict[str, Any],
        code: str) -> None:
    tag, key = account(admin, 10_000_000)
    r = admin.post(f"/v1beta/models/{FLASH}:generateContent", headers={"x-goog-api-key": key},
                   json=sent)
    assert 400 <= r.status_code < 500, r.text
    error = r.json()["error"]
    assert set(error) >= {"code", "message", "status"}, r.text
    assert error["details"][0]["reason"] == code, r.text
    nothing_reached(stub)
    nothing_held(admin, tag)


@pytest.mark.parametrize(("model", "thinking", "code"), [
    (IMPOSTOR, None, "input_unbounded"),
    (IMPOSTOR, {"thinkingBudget": 100}, "model_unpriced"),
    (PRIVATE, None, "input_unbounded"),
    (PRIVATE, {"thinkingLevel": "low"}, "input_unbounded"),
])
def test_a_name_that_only_begins_as_a_known_models_is_held_as_any_unknown_model(
        gw: ServiceProcess, admin: Client, stub: StubProvider, model: str,
        thinking: dict[str, Any] | None, code: str) -> None:
    """gemini-2.5-pro-anything is not gemini-2.5-pro: neither its thinking rule nor its limits
    apply. Unpriced, it is refused as any unpriced model is; priced by the operator, its thinking
    needs a budget (nothing documents its most), named in the refusal. Nothing is forwarded."""
    tag, key = account(admin, 10_000_000)
    config: dict[str, Any] = {"maxOutputTokens": 50}
    if thinking is not None:
        config["thinkingConfig"] = thinking
    r = admin.post(f"/v1beta/models/{model}:generateContent", headers={"x-goog-api-key": key},
                   json=body(**config))
    error = r.json()["error"]
    assert (r.status_code, error["details"][0]["reason"]) == (400, code), r.text
    if code == "input_unbounded":
        assert error["details"][0]["metadata"]["field"] == (
            "generationConfig.thinkingConfig.thinkingBudget"), r.text
    nothing_reached(stub)
    nothing_held(admin, tag)


@pytest.mark.parametrize(("model", "sent", "code", "field"), [
    (FLASH, {**body(), "tools": [{"google_search": {}}]}, "input_unbounded",
     "tools[0].google_search"),
    (FLASH, {**body(), "tools": [{"googleMaps": {}}]}, "input_unbounded", "tools[0].googleMaps"),
    (FLASH, {**body(), "labels": {"team": "a"}}, "field_unsupported", "labels"),
    (FLASH, {**body(), "serviceTier": "flex"}, "field_unsupported", "serviceTier"),
    (FLASH, {**body(), "cached_content": "cachedContents/x"}, "field_unsupported",
     "cached_content"),
    (FLASH, body(routingConfig={"autoMode": {}}), "input_unbounded",
     "generationConfig.routingConfig"),
    (FLASH, body(audioTimestamp=True), "input_unbounded", "generationConfig.audioTimestamp"),
    (FLASH, body(imageConfig={"aspectRatio": "1:1"}), "input_unbounded",
     "generationConfig.imageConfig"),
    (FLASH, body(thinkingConfig={"thinkingBudget": 10, "depth": 9}), "input_unbounded",
     "generationConfig.thinkingConfig.depth"),
    (FLASH, body(responseModalities=["AUDIO"]), "invalid_request",
     "generationConfig.responseModalities"),
    (FLASH, body(responseModalities=["TEXT", "IMAGE"]), "invalid_request",
     "generationConfig.responseModalities"),
    (FLASH, body(mediaResolution="MEDIA_RESOLUTION_ENORMOUS"), "invalid_request",
     "generationConfig.mediaResolution"),
    (FLASH, body(candidateCount=0), "invalid_request", "generationConfig.candidateCount"),
    (GEMINI_3, {**body(maxOutputTokens=10), "tools": [{"googleSearch": {}}]},
     "model_unbounded", None),
])
def test_a_hostile_body_is_refused_naming_its_setting_before_the_stub_sees_it(
        gw: ServiceProcess, admin: Client, stub: StubProvider, model: str,
        sent: dict[str, Any], code: str, field: str | None) -> None:
    """Grounding tools by another spelling, Vertex's billing labels, a service tier, answers in
    audio or images, settings newer than the gateway, a resolution Google does not name, and
    grounding billed per query with no bound: each refused by the setting that would bound
    it, in Google's shape, with nothing held or forwarded."""
    tag, key = account(admin, 10_000_000)
    r = admin.post(f"/v1beta/models/{model}:generateContent", headers={"x-goog-api-key": key},
                   json=sent)
    error = r.json()["error"]
    info = error["details"][0]
    assert (r.status_code, info["reason"]) == (400, code), r.text
    if field is None:  # a price component: named as one
        assert info["metadata"]["component"] == "web_search", r.text
        assert "web_searches_max" in error["message"], r.text
    else:
        assert info["metadata"]["field"] == field, r.text
    nothing_reached(stub)
    nothing_held(admin, tag)


def png(width: int, height: int) -> str:
    head = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + struct.pack(
        ">II", width, height) + b"\x08\x02\x00\x00\x00" + b"\x00" * 4
    return base64.b64encode(head + b"\x00" * 64).decode()


# Each is held at a bound the stub's bill stays within: grounding per prompt (its fee once,
# whatever the queries, and each step's input at the window), code execution, a cached content and
# URL context (their input at the window), an image at each media resolution, every candidate.
# Beside each, the least the stub must bill for it to have served what was asked (Flash-Lite: $35
# a grounded prompt; $0.10 a million input tokens, so URL context's 101,774 tokens at least
# 10,177).
HELD: dict[str, tuple[dict[str, Any], dict[str, Any], int]] = {
    "googleSearchRetrieval": ({**body(maxOutputTokens=50, candidateCount=3),
                               "tools": [{"googleSearchRetrieval": {}}]}, {"web_searches": 6},
                              35_000),
    "googleSearch": ({**body(maxOutputTokens=50, candidateCount=2),
                      "tools": [{"googleSearch": {}}]}, {"web_searches": 4}, 35_000),
    "codeExecution": ({**body(maxOutputTokens=50), "tools": [{"codeExecution": {}}]}, {}, 1),
    # A cache as large as the window leaves: 1,048,000 tokens at the $0.01 cached rate.
    "cachedContent": ({**body(maxOutputTokens=50), "cachedContent": "cachedContents/full"},
                      {"cached_contents": {"cachedContents/full": {
                          "model": LITE, "tokens": 1_048_000}}}, 10_480),
    "urlContext": ({**body("read https://example.com/a and https://example.com/b",
                           maxOutputTokens=50), "tools": [{"urlContext": {}}]},
                   {"files": {"https://example.com/a": {"bytes": 400_000, "pages": 0},
                              "https://example.com/b": {"bytes": 4_000, "pages": 3}}}, 10_177),
    # A small image (one tile's 258 tokens) at each resolution: the stub bills Google's Gemini
    # 2.5 figure for the level (64, 256, and 256 + 2,048 "Pan & Scan" at high, ultra high as
    # high), at $0.10 a million; held below high at its tile, else at the window.
    **{f"mediaResolution-{level}": ({"contents": [{"role": "user", "parts": [
        {"text": "what is it?"}, {"inlineData": {"mimeType": "image/png",
                                                 "data": png(300, 200)}}]}],
        "generationConfig": {"maxOutputTokens": 50,
                             "mediaResolution": f"MEDIA_RESOLUTION_{level}"}}, {},
        math.ceil(Fraction(image_tokens, 10)))
       for level, image_tokens in (("LOW", 64), ("MEDIUM", 256), ("HIGH", 2_304),
                                   ("ULTRA_HIGH", 2_304))},
}


@pytest.mark.parametrize("case", HELD)
def test_a_body_the_gateway_can_bound_is_held_there_and_billed_within_it(
        gw: ServiceProcess, admin: Client, stub: StubProvider, case: str) -> None:
    sent, control, least_micros = HELD[case]
    stub_control(stub.url, control)
    tag, key = account(admin, 10_000_000)
    r = admin.post(f"/v1beta/models/{LITE}:generateContent", headers={"x-goog-api-key": key},
                   json=sent)
    assert r.status_code == 200, r.text
    [cost] = costs(stub)
    assert least_micros <= cost <= int(r.headers["x-ceiling-reserved-micros"])
    assert settled(admin, tag)["committed_micros"] == cost


def test_a_cached_content_is_held_at_the_models_window(
        gw: ServiceProcess, admin: Client, stub: StubProvider) -> None:
    """A cachedContent reference can feed the model up to its window: held there, so a budget
    below that is refused before the stub sees anything; one above it is charged the bill."""
    tag, key = account(admin, 50_000)
    r = admin.post(f"/v1beta/models/{LITE}:generateContent", headers={"x-goog-api-key": key},
                   json={**body(maxOutputTokens=50), "cachedContent": "cachedContents/big"})
    assert (r.status_code, r.json()["error"]["details"][0]["reason"]) == (
        400, "budget_exceeded"), r.text
    nothing_reached(stub)
    nothing_held(admin, tag)
    stub_control(stub.url, {"cached_contents": {"cachedContents/big": {
        "model": LITE, "tokens": 200_000}}})
    tag, key = account(admin, 10_000_000)
    r = admin.post(f"/v1beta/models/{LITE}:generateContent", headers={"x-goog-api-key": key},
                   json={**body(maxOutputTokens=50), "cachedContent": "cachedContents/big"})
    assert r.status_code == 200, r.text
    # Flash-Lite's window, 1,048,576 tokens at $0.10: about 104,858 micro-dollars held.
    assert int(r.headers["x-ceiling-reserved-micros"]) >= 104_857
    assert settled(admin, tag)["committed_micros"] == sum(costs(stub)) > 0


# -- through the google-genai SDK: charged the stub's bill ---------------------------------------


def test_generate_content_passes_unchanged_and_is_charged_the_bill(
        gw: ServiceProcess, admin: Client, stub: StubProvider) -> None:
    tag, key = account(admin, 10_000_000)
    answer = google(gw, key).models.generate_content(
        model=LITE, contents=LONG, config=types.GenerateContentConfig(max_output_tokens=200))
    usage = answer.usage_metadata
    assert usage is not None
    assert usage.prompt_token_count == 1_007
    assert answer.text
    [cost] = costs(stub)
    assert settled(admin, tag)["committed_micros"] == cost > 0


def test_thinking_is_held_on_top_of_the_cap_and_charged_the_bill(
        gw: ServiceProcess, admin: Client, stub: StubProvider) -> None:
    tag, key = account(admin, 10_000_000)
    answer = google(gw, key).models.generate_content(
        model=FLASH, contents="hello", config=types.GenerateContentConfig(
            max_output_tokens=100, thinking_config=types.ThinkingConfig(thinking_budget=500)))
    assert answer.usage_metadata is not None
    [cost] = costs(stub)
    assert settled(admin, tag)["committed_micros"] == cost > 0
    # The hold covers the 500 thinking tokens beside the 100 of the cap, at the output rate
    # ($2.50 a million on gemini-2.5-flash): 600 tokens are 1,500 micro-dollars at least.
    r = admin.post(f"/v1beta/models/{FLASH}:generateContent", headers={"x-goog-api-key": key},
                   json=body(maxOutputTokens=100, thinkingConfig={"thinkingBudget": 500}))
    assert r.status_code == 200, r.text
    assert int(r.headers["x-ceiling-reserved-micros"]) >= 600 * 2_500_000 // 1_000_000


@pytest.mark.parametrize("candidates", [1, 8])
@pytest.mark.parametrize("outside", [False, True],
                         ids=["thoughts-within-the-cap", "thoughts-beside-the-cap"])
def test_the_hold_is_the_documented_worst_case_and_the_stubs_whole_spend_stays_within_it(
        gw: ServiceProcess, admin: Client, stub: StubProvider, spy: FaultProxy,
        outside: bool, candidates: int) -> None:
    """Google documents thinking billed at the output rate and a budget the model may
    overflow, not that thoughts count inside maxOutputTokens (docs/gateway.md, "The Gemini
    API"): each candidate is held at its cap plus its budget. The stub, drawn far past both,
    spends the whole cap on thoughts and answer together (as Google serves it), or, the other
    reading, the whole cap on its answer and the whole budget on thoughts: its bill reaches the
    hold's output and never passes the hold. Every candidate asked for is held and billed."""
    stub_control(stub.url, {"thinking_outside_output_cap": outside})
    tag, key = account(admin, 10_000_000)
    cap, budget = 100, 500
    spy.output_tokens = 100_000
    try:
        r = admin.post(f"/v1beta/models/{PRO}:generateContent", headers={"x-goog-api-key": key},
                       json=body(maxOutputTokens=cap, candidateCount=candidates,
                                 thinkingConfig={"thinkingBudget": budget}))
    finally:
        spy.disarm()
    assert r.status_code == 200, r.text
    usage = r.json()["usageMetadata"]
    written = usage.get("candidatesTokenCount", 0) + usage["thoughtsTokenCount"]
    assert written == candidates * (cap + budget if outside else cap)
    # The hold by hand: the forwarded body's text by its bytes (4 tokens a turn) at 2.5 Pro's
    # $1.25 a million, and every candidate's cap and budget at its $10 output rate.
    sent = spy.forwarded()
    text = sum(4 + json_text_bytes(turn) for turn in sent["contents"]) + json_text_bytes(
        {k: v for k, v in sent.items() if k != "contents"})
    hold = math.ceil(Fraction(text * 125, 100) + candidates * (cap + budget) * 10)
    assert int(r.headers["x-ceiling-reserved-micros"]) == hold
    [cost] = costs(stub)
    assert 0 < cost <= hold
    assert settled(admin, tag)["committed_micros"] == cost


@pytest.mark.parametrize("outside", [False, True],
                         ids=["thoughts-within-the-cap", "thoughts-beside-the-cap"])
def test_a_budget_below_the_models_range_is_held_at_its_least_which_the_stub_thinks(
        gw: ServiceProcess, admin: Client, stub: StubProvider, spy: FaultProxy,
        outside: bool) -> None:
    """2.5 Pro takes thinking budgets of 128 to 32,768 (https://ai.google.dev/gemini-api/docs/
    thinking); Google does not say what it does with 1, and the stub raises it to 128, so the
    call is held at 128 thoughts beside its cap: the stub, drawn far past both, bills within
    the hold."""
    stub_control(stub.url, {"thinking_outside_output_cap": outside})
    tag, key = account(admin, 10_000_000)
    cap = 100
    spy.output_tokens = 100_000
    try:
        r = admin.post(f"/v1beta/models/{PRO}:generateContent", headers={"x-goog-api-key": key},
                       json=body(maxOutputTokens=cap, thinkingConfig={"thinkingBudget": 1}))
    finally:
        spy.disarm()
    assert r.status_code == 200, r.text
    usage = r.json()["usageMetadata"]
    assert usage["thoughtsTokenCount"] == (128 if outside else cap)
    [cost] = costs(stub)
    assert 0 < cost <= int(r.headers["x-ceiling-reserved-micros"])
    assert settled(admin, tag)["committed_micros"] == cost


def test_generate_content_stream_passes_unchanged_and_is_charged_the_bill(
        gw: ServiceProcess, admin: Client, stub: StubProvider, spy: FaultProxy) -> None:
    tag, key = account(admin, 10_000_000)
    # 64 tokens written, whatever the stub's draw: 32 thought and 32 answered, two text chunks.
    spy.output_tokens = 64
    try:
        chunks = list(google(gw, key).models.generate_content_stream(
            model=PRO, contents=LONG, config=types.GenerateContentConfig(
                max_output_tokens=200, thinking_config=types.ThinkingConfig(
                    thinking_budget=128))))
    finally:
        spy.disarm()
    assert len(chunks) > 1
    last = chunks[-1].usage_metadata
    assert last is not None
    assert last.candidates_token_count
    assert "".join(c.text or "" for c in chunks)
    [cost] = costs(stub)
    assert settled(admin, tag)["committed_micros"] == cost > 0


def test_a_stream_is_googles_events_only_its_bill_in_the_ledger(
        gw: ServiceProcess, admin: Client, stub: StubProvider) -> None:
    """google-genai parses every line of a stream as an event: no trailer follows the last."""
    tag, key = account(admin, 10_000_000)
    r = admin.post(f"/v1beta/models/{LITE}:streamGenerateContent?alt=sse",
                   headers={"x-goog-api-key": key}, json=body(maxOutputTokens=100))
    assert r.status_code == 200, r.text
    assert int(r.headers["x-ceiling-reserved-micros"]) > 0
    lines = [line for line in r.text.split("\n") if line]
    assert lines
    assert all(line.startswith("data: {") for line in lines), r.text
    assert trailer(r.text) == {}
    [cost] = costs(stub)
    assert settled(admin, tag)["committed_micros"] == cost > 0


def test_v1_is_served_as_v1beta(gw: ServiceProcess, admin: Client, stub: StubProvider) -> None:
    tag, key = account(admin, 10_000_000)
    client = genai.Client(api_key=key, http_options=types.HttpOptions(
        base_url=gw.url, api_version="v1", retry_options=NO_RETRY))
    _clients.append(client)
    answer = client.models.generate_content(model=LITE, contents="hello")
    assert answer.text
    [cost] = costs(stub)
    assert settled(admin, tag)["committed_micros"] == cost > 0


def test_gemini_on_vertex_through_the_same_sdk_is_charged_the_bill(
        gw: ServiceProcess, admin: Client, stub: StubProvider) -> None:
    """The client speaks the Gemini API to the gateway; the upstream is Vertex AI, reached as a
    service account: streamed and not, and counted."""
    tag, key = account(admin, 10_000_000)
    client = google(gw, key)
    config = types.GenerateContentConfig(
        max_output_tokens=100, thinking_config=types.ThinkingConfig(thinking_budget=200))
    answer = client.models.generate_content(model=GEMINI_3, contents="hello", config=config)
    assert answer.usage_metadata is not None
    chunks = list(client.models.generate_content_stream(model=GEMINI_3, contents="hello",
                                                        config=config))
    assert chunks[-1].usage_metadata is not None
    assert client.models.count_tokens(model=GEMINI_3, contents=LONG).total_tokens == 1_007
    log = fetch_bill(stub.url).log
    assert [c.billed for c in log] == [True, True, False], log
    assert settled(admin, tag)["committed_micros"] == sum(costs(stub)) > 0


def test_count_tokens_holds_nothing_and_bills_nothing(
        gw: ServiceProcess, admin: Client, stub: StubProvider) -> None:
    tag, key = account(admin, 10_000_000)
    counted = google(gw, key).models.count_tokens(model=LITE, contents=LONG)
    assert counted.total_tokens == 1_007
    assert [(c.api, c.billed) for c in fetch_bill(stub.url).log] == [
        ("gemini.count_tokens", False)]
    nothing_held(admin, tag)
    with pytest.raises(errors.ClientError) as raised:
        google(gw, key).models.count_tokens(model="gemini-2.0-flash", contents="hello")
    assert reason(raised.value) == "model_not_routed"


def test_a_key_in_the_query_works_and_goes_no_further(
        gw: ServiceProcess, admin: Client, stub: StubProvider, spy: FaultProxy) -> None:
    tag, key = account(admin, 10_000_000)
    r = httpx.post(f"{gw.url}/v1beta/models/{PRO}:generateContent?key={key}",
                   json=body(maxOutputTokens=50, thinkingConfig={"thinkingBudget": 128}),
                   timeout=30)
    assert r.status_code == 200, r.text
    sent = spy.last_request
    assert key.encode() not in sent
    assert b"key=" not in sent.split(b"\r\n", 1)[0]
    assert STUB_KEY.encode() in sent  # the upstream's own key, in x-goog-api-key
    [cost] = costs(stub)
    assert settled(admin, tag)["committed_micros"] == cost > 0


def test_a_wrong_key_is_refused_in_googles_shape(gw: ServiceProcess, admin: Client,
                                                 stub: StubProvider) -> None:
    r = httpx.post(f"{gw.url}/v1beta/models/{LITE}:generateContent?key=nope", json=body(),
                   timeout=30)
    assert r.status_code == 401, r.text
    assert r.json()["error"]["status"] == "UNAUTHENTICATED"
    nothing_reached(stub)
    r = httpx.post(f"{gw.url}/v1beta/models/{LITE}:generateContent", json=body(),
                   headers=as_key("nope"), timeout=30)
    assert r.status_code == 401, r.text


def test_without_named_upstreams_a_gemini_call_is_refused_and_held_nowhere(
        redis_server: RedisServer, stub: StubProvider) -> None:
    with ServiceProcess({"REDIS_URL": redis_server.url, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN,
                         "CEILING_UPSTREAM_URL": f"{stub.url}/v1"}) as bare, \
            client_for(bare) as admin:
        tag, key = account(admin, 1_000_000)
        r = admin.post(f"/v1beta/models/{LITE}:generateContent",
                       headers={"x-goog-api-key": key}, json=body())
        error = r.json()["error"]
        assert (r.status_code, error["status"], error["details"][0]["reason"]) == (
            503, "UNAVAILABLE", "invalid_configuration"), r.text
        assert "CEILING_UPSTREAMS" in error["message"]
        nothing_reached(stub)
        nothing_held(admin, tag)


def test_a_stream_cut_off_keeps_its_hold_and_the_sdk_raises_googles_error(
        gw: ServiceProcess, admin: Client, stub: StubProvider, spy: FaultProxy) -> None:
    """The provider's stream breaks before its end: the call may have been billed, so its hold
    stays (outcome unknown) and the stream ends on an error event in Google's shape."""
    tag, key = account(admin, 10_000_000)
    spy.output_tokens, spy.cut_after_bytes = 300, 600
    try:
        config = types.GenerateContentConfig(
            max_output_tokens=400, thinking_config=types.ThinkingConfig(thinking_budget=128))
        with pytest.raises(errors.APIError) as raised:
            list(google(gw, key).models.generate_content_stream(model=PRO, contents="hello",
                                                                config=config))
    finally:
        spy.disarm()
    assert "upstream_timeout" in str(raised.value.details), raised.value.details
    assert ledger(admin, tag)["reserved_micros"] > 0  # left held: expiry charges it


def test_a_retry_with_its_idempotency_key_is_replayed_the_stub_called_once(
        gw: ServiceProcess, admin: Client, stub: StubProvider) -> None:
    tag, key = account(admin, 10_000_000)
    headers = {"x-goog-api-key": key, "Idempotency-Key": "gemini-retry-1"}
    first, again = (admin.post(f"/v1/models/{LITE}:generateContent", headers=headers,
                               json=body(maxOutputTokens=50)) for _ in range(2))
    assert (first.status_code, again.status_code) == (200, 200), again.text
    assert again.headers["x-ceiling-replayed"] == "true"
    assert again.json() == first.json()
    [cost] = costs(stub)
    assert settled(admin, tag)["committed_micros"] == cost > 0
