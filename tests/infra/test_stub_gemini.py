"""The stub's Gemini API and Vertex AI are the witness a gateway's Google routes are judged by: they
must bill what Google would, from the stub's own table.

Every figure is worked by hand from the stub's table (infra/stub_prices.json, copied from Google's
pricing page) and its counting rule (infra/stub_gemini.py's docstring), never computed by the
code under test; this module imports nothing from `core`. Calls go through the real SDKs
(google-genai with a key and with vertexai=True and a service account by google-auth, the
anthropic SDK's AnthropicVertex) wherever a client would use them; raw httpx where a test reads
the wire itself or sends what an SDK would not. Nothing leaves 127.0.0.1: every base URL is the
stub's, and google-auth's token_uri is the stub's /token.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from google import genai
from google.auth import crypt, jwt
from google.auth.exceptions import RefreshError
from google.genai import errors, types
from google.oauth2 import service_account

from infra.stub_prices import StubPrices
from infra.stub_provider import StubProvider
from tests.infra.conftest import start_fresh
from tests.infra.media import b64, pdf, png, wav
from tests.infra.test_stub_provider import bill_of, only_call

KEY = "gemini-stub-key"
FLASH, PRO, LITE, GEMINI_3 = ("gemini-2.5-flash", "gemini-2.5-pro", "gemini-2.5-flash-lite",
                              "gemini-3-pro-preview")
# A test model with a 100-token window, to be refused over it.
TINY = "gemini-tiny"
TABLE: dict[str, Any] = {"models": {TINY: {
    "input_usd_per_mtok": "1", "output_usd_per_mtok": "1", "context_window_tokens": 100,
    "gemini": {"output_tokens_max": 100, "thinking": "none", "thinking_budget_min": 0,
               "thinking_budget_max": 0, "thinks_by_default": False,
               "grounding_usd_per_1k": "35", "grounding_per": "prompt"}}}}
# "hello": 5 bytes -> 2 tokens, + 4 for the content, + 3 for the reply.
HELLO_TOKENS = 9
# 4,000 bytes -> 1,000 tokens, + 4 + 3.
LONG = "x" * 4_000
LONG_TOKENS = 1_007
NO_RETRY = types.HttpRetryOptions(attempts=1)


def call_headers(**headers: str) -> types.HttpOptions:
    """Per-call X-Stub-* headers, as a GenerateContentConfig's http_options."""
    return types.HttpOptions(headers={f"X-Stub-{k.replace('_', '-')}": v
                                      for k, v in headers.items()})


@pytest.fixture(scope="module")
def provider() -> Iterator[StubProvider]:
    with StubProvider(seed=11, latency_ms_min=0, latency_ms_max=2, api_key=KEY,
                      prices=TABLE) as stub:
        yield stub


@pytest.fixture(scope="module")
def http(provider: StubProvider) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=provider.url, timeout=10.0,
                      headers={"x-goog-api-key": KEY}) as client:
        yield client


@pytest.fixture(autouse=True)
def fresh(http: httpx.Client) -> None:
    start_fresh(http, {"tool_calls": [], "cached_contents": {},
                       "thinking_outside_output_cap": False, "clock_offset_s": 0})


@pytest.fixture(scope="module")
def client(provider: StubProvider) -> genai.Client:
    return genai.Client(api_key=KEY, http_options=types.HttpOptions(
        base_url=provider.url, retry_options=NO_RETRY))


def generate(http: httpx.Client, model: str, body: dict[str, Any],
             headers: dict[str, str] | None = None) -> httpx.Response:
    return http.post(f"/v1beta/models/{model}:generateContent", json=body, headers=headers)


def user(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"contents": [{"role": "user", "parts": list(parts)}]}


# -- the Gemini API through google-genai -------------------------------------------------------


def test_a_call_bills_its_prompt_and_output_at_the_tables_rates(
        client: genai.Client, http: httpx.Client) -> None:
    answer = client.models.generate_content(
        model=LITE, contents=LONG,
        config=types.GenerateContentConfig(http_options=call_headers(Output_Tokens="20")))
    usage = answer.usage_metadata
    assert usage is not None
    assert (usage.prompt_token_count, usage.candidates_token_count, usage.total_token_count,
            usage.thoughts_token_count) == (LONG_TOKENS, 20, LONG_TOKENS + 20, None)
    assert answer.text is not None
    assert len(answer.text.split()) == 20
    call = only_call(http)
    # Flash-Lite: $0.10 in, $0.40 out: 1,007 x 0.10 + 20 x 0.40 = 108.7 -> 109 micro-dollars.
    assert (call.api, call.model, call.billed, call.cost_micros) == ("gemini", LITE, True, 109)


def test_thinking_is_billed_as_output_and_shown_as_a_summary_with_a_signature(
        client: genai.Client, http: httpx.Client) -> None:
    answer = client.models.generate_content(model=FLASH, contents=LONG,
                                            config=types.GenerateContentConfig(
        max_output_tokens=100,
        thinking_config=types.ThinkingConfig(thinking_budget=1_000, include_thoughts=True),
        http_options=call_headers(Output_Tokens="60", Reasoning_Tokens="30")))
    usage = answer.usage_metadata
    assert usage is not None
    assert (usage.thoughts_token_count, usage.candidates_token_count) == (
        30, 30)
    assert answer.candidates
    assert answer.candidates[0].content
    parts = answer.candidates[0].content.parts or []
    assert parts[0].thought is True
    assert parts[0].text
    assert any(p.thought_signature for p in parts)
    call = only_call(http)
    # Flash: $0.30 in, $2.50 out (thinking included): 1,007 x 0.30 + 60 x 2.50 = 452.1 -> 453.
    assert (call.usage and call.usage.reasoning_tokens, call.cost_micros) == (30, 453)


def test_thinking_counts_inside_max_output_tokens_unless_set_outside(
        client: genai.Client, http: httpx.Client) -> None:
    config = types.GenerateContentConfig(
        max_output_tokens=50, http_options=call_headers(Output_Tokens="200",
                                                        Reasoning_Tokens="80"))
    answer = client.models.generate_content(model=FLASH, contents="hello", config=config)
    usage = answer.usage_metadata
    assert usage is not None
    assert answer.candidates
    # Thoughts and answer together are at most the cap: all 50 thinking, nothing shown.
    assert (usage.thoughts_token_count, usage.candidates_token_count) == (50, 0)
    assert answer.candidates[0].finish_reason == types.FinishReason.MAX_TOKENS
    assert bill_of(http).total.output_tokens == 50
    start_fresh(http, {"thinking_outside_output_cap": True})
    usage = client.models.generate_content(model=FLASH, contents="hello",
                                           config=config).usage_metadata
    # The other reading: 80 thinking on top of a 50-token answer.
    assert usage is not None
    assert (usage.thoughts_token_count,
                                  usage.candidates_token_count) == (80, 50)
    assert bill_of(http).total.output_tokens == 130


def test_a_stream_reports_the_output_in_its_last_chunk_only(
        client: genai.Client, http: httpx.Client) -> None:
    chunks = list(client.models.generate_content_stream(
        model=LITE, contents=LONG,
        config=types.GenerateContentConfig(http_options=call_headers(Output_Tokens="40"))))
    assert len(chunks) > 2
    assert all(c.usage_metadata and c.usage_metadata.prompt_token_count == LONG_TOKENS
               for c in chunks)
    assert all(c.usage_metadata and c.usage_metadata.candidates_token_count is None
               for c in chunks[:-1])
    last = chunks[-1].usage_metadata
    assert last is not None
    assert last.candidates_token_count == 40
    assert len("".join(c.text or "" for c in chunks).split()) == 40
    call = only_call(http)
    # 1,007 x 0.10 + 40 x 0.40 = 116.7 -> 117.
    assert (call.stream, call.cost_micros) == (True, 117)


def test_count_tokens_answers_the_prompt_and_bills_nothing(
        client: genai.Client, http: httpx.Client) -> None:
    assert client.models.count_tokens(model=FLASH, contents=LONG).total_tokens == LONG_TOKENS
    bill = bill_of(http)
    assert bill.total.calls == 0
    assert [(c.api, c.status, c.billed) for c in bill.log] == [
        ("gemini.count_tokens", 200, False)]


def test_function_calls_are_scripted_forced_or_not_made(
        client: genai.Client, http: httpx.Client) -> None:
    weather = types.FunctionDeclaration(name="get_weather", parameters=types.Schema(
        type=types.Type.OBJECT, properties={"city": types.Schema(type=types.Type.STRING)},
        required=["city"]))
    tools: list[Any] = [types.Tool(function_declarations=[weather])]
    start_fresh(http, {"tool_calls": [{"name": "get_weather", "input": {"city": "Paris"}}]})
    answer = client.models.generate_content(
        model=LITE, contents="weather?", config=types.GenerateContentConfig(tools=tools))
    assert answer.function_calls
    assert answer.function_calls[0].name == "get_weather"
    assert answer.function_calls[0].args == {"city": "Paris"}
    # {"name":"get_weather","args":{"city":"Paris"}}: 46 bytes -> 12 tokens.
    assert answer.usage_metadata
    assert answer.usage_metadata.candidates_token_count == 12
    # The queue is spent: the turn with the function's response answers text.
    assert answer.candidates
    assert answer.candidates[0].content
    reply = client.models.generate_content(model=LITE, contents=[
        types.Content(role="user", parts=[types.Part(text="weather?")]),
        answer.candidates[0].content,
        types.Content(role="user", parts=[types.Part.from_function_response(
            name="get_weather", response={"sky": "clear"})])],
        config=types.GenerateContentConfig(tools=tools))
    assert reply.function_calls is None
    assert reply.text
    forced = client.models.generate_content(
        model=LITE, contents="weather?", config=types.GenerateContentConfig(
            tools=tools, tool_config=types.ToolConfig(
                function_calling_config=types.FunctionCallingConfig(
                    mode=types.FunctionCallingConfigMode.ANY))))
    assert forced.function_calls
    assert forced.function_calls[0].args == {"city": ""}
    streamed = list(client.models.generate_content_stream(
        model=LITE, contents="weather?", config=types.GenerateContentConfig(
            tools=tools, http_options=call_headers(Tool_Call="1"))))
    assert [c.function_calls[0].name for c in streamed if c.function_calls] == ["get_weather"]
    bill = bill_of(http)
    assert bill.total.calls == 4
    assert bill.total.output_tokens == sum(
        a.usage_metadata.candidates_token_count or 0
        for a in (answer, reply, forced, streamed[-1]) if a.usage_metadata)


def test_grounding_is_billed_per_prompt_on_2_5_and_per_query_on_3(
        client: genai.Client, http: httpx.Client) -> None:
    search: list[Any] = [types.Tool(google_search=types.GoogleSearch())]
    for model in (FLASH, GEMINI_3):
        answer = client.models.generate_content(
            model=model, contents="hello", config=types.GenerateContentConfig(
                tools=search, http_options=call_headers(Output_Tokens="10",
                                                        Web_Searches="3")))
        assert answer.candidates
        assert answer.candidates[0].grounding_metadata
        assert len(answer.candidates[0].grounding_metadata.web_search_queries or []) == 3
    flash, gemini_3 = bill_of(http).log
    # Flash: 9 x 0.30 + 10 x 2.50 = 27.7 -> 28, and $35 / 1,000 grounded prompts: 35,000.
    assert flash.cost_micros == 35_028
    # Gemini 3 Pro: 9 x 2 + 10 x 12 = 138, and 3 queries at $14 / 1,000: 42,000.
    assert gemini_3.cost_micros == 42_138
    assert flash.usage
    assert flash.usage.web_search_requests == 3


def test_long_context_bills_the_whole_call_at_its_tier_above_200k(http: httpx.Client) -> None:
    no_thinking = {"X-Stub-Output-Tokens": "10", "X-Stub-Reasoning-Tokens": "0"}
    # 799,972 bytes -> 199,993 tokens + 7 = 200,000: not above the threshold.
    below = generate(http, PRO, user({"text": "x" * 799_972}), no_thinking)
    # 800,004 bytes -> 200,001 tokens + 7 = 200,008: above it.
    above = generate(http, PRO, user({"text": "x" * 800_004}), no_thinking)
    assert [r.json()["usageMetadata"]["promptTokenCount"] for r in (below, above)] == [
        200_000, 200_008]
    standard, long = bill_of(http).log
    # 200,000 x 1.25 + 10 x 10 = 250,100; 200,008 x 2.50 + 10 x 15 = 500,170.
    assert (standard.cost_micros, standard.service_tier) == (250_100, "default")
    assert (long.cost_micros, long.service_tier) == (500_170, "long_context")


def test_cached_content_is_billed_at_the_cache_rate(http: httpx.Client) -> None:
    start_fresh(http, {"cached_contents": {"cachedContents/doc": {"model": FLASH,
                                                                  "tokens": 10_000}}})
    body = {**user({"text": "hello"}), "cachedContent": "cachedContents/doc",
            "generationConfig": {"thinkingConfig": {"thinkingBudget": 0}}}
    usage = generate(http, FLASH, body, {"X-Stub-Output-Tokens": "10"}).json()["usageMetadata"]
    assert (usage["promptTokenCount"], usage["cachedContentTokenCount"]) == (10_009, 10_000)
    # 9 x 0.30 + 10,000 x 0.03 + 10 x 2.50 = 327.7 -> 328.
    assert only_call(http).cost_micros == 328
    unknown = generate(http, FLASH, {**body, "cachedContent": "cachedContents/none"})
    assert unknown.json()["error"]["status"] == "PERMISSION_DENIED"
    assert bill_of(http).total.calls == 1


def test_media_are_billed_by_googles_rules(http: httpx.Client) -> None:
    answer = generate(http, FLASH, user(
        {"inlineData": {"mimeType": "image/png", "data": b64(png(100, 100))}},
        {"inlineData": {"mimeType": "image/png", "data": b64(png(1_000, 800))}},
        {"inlineData": {"mimeType": "audio/wav", "data": b64(wav(200))}},
        {"inlineData": {"mimeType": "application/pdf", "data": b64(pdf(3))}},
        {"text": "hi"}), {"X-Stub-Output-Tokens": "10", "X-Stub-Reasoning-Tokens": "0"})
    details = {d["modality"]: d["tokenCount"]
               for d in answer.json()["usageMetadata"]["promptTokensDetails"]}
    # Images: 258 (both sides <= 384 px), 2 x 2 tiles of 768 px x 258 = 1,032; audio 2 s x 32;
    # PDF 3 pages x 258; text "hi" 1 + 4 + 3.
    assert details == {"IMAGE": 258 + 1_032, "AUDIO": 64, "DOCUMENT": 774, "TEXT": 8}
    # (1,290 + 774 + 8) x 0.30 + 64 x 1.00 (audio) + 10 x 2.50 = 710.6 -> 711.
    assert only_call(http).cost_micros == 711


def test_gemini_3_bills_media_by_their_resolution(http: httpx.Client) -> None:
    image = {"inlineData": {"mimeType": "image/png", "data": b64(png(100, 100))}}
    document = {"inlineData": {"mimeType": "application/pdf", "data": b64(pdf(3))}}
    no_thinking = {"X-Stub-Output-Tokens": "10", "X-Stub-Reasoning-Tokens": "0"}

    def details(body: dict[str, Any]) -> dict[str, int]:
        usage = generate(http, GEMINI_3, body, no_thinking).json()["usageMetadata"]
        return {d["modality"]: d["tokenCount"] for d in usage["promptTokensDetails"]}

    # Defaults: an image at high (1,120), a PDF page at medium (560); the text: 4 + 3.
    assert details(user(image, document)) == {"IMAGE": 1_120, "DOCUMENT": 1_680, "TEXT": 7}
    # The request's resolution, and a part's own over it.
    low = {"generationConfig": {"mediaResolution": "MEDIA_RESOLUTION_LOW"}}
    high_image = {**image, "mediaResolution": {"level": "MEDIA_RESOLUTION_HIGH"}}
    assert details({**user(image, document), **low}) == {"IMAGE": 280, "DOCUMENT": 840,
                                                         "TEXT": 7}
    assert details({**user(high_image, document), **low})["IMAGE"] == 1_120
    # (1,120 + 1,680 + 7) x 2 + 10 x 12 = 5,734.
    assert bill_of(http).log[0].cost_micros == 5_734


def test_gemini_25_bills_an_image_at_a_media_resolution_by_googles_figure(
        http: httpx.Client) -> None:
    image = {"inlineData": {"mimeType": "image/png", "data": b64(png(100, 100))}}

    def image_tokens(level: str | None) -> int:
        config = {} if level is None else {"generationConfig": {
            "mediaResolution": f"MEDIA_RESOLUTION_{level}"}}
        usage = generate(http, FLASH, {**user(image), **config},
                         {"X-Stub-Output-Tokens": "10"}).json()["usageMetadata"]
        return {d["modality"]: d["tokenCount"] for d in usage["promptTokensDetails"]}["IMAGE"]

    # Its tiles with no level; low 64, medium 256, high 256 + 2,048 "Pan & Scan", ultra high
    # (Gemini 3's) as high.
    assert [image_tokens(level) for level in (None, "LOW", "MEDIUM", "HIGH", "ULTRA_HIGH")] == [
        258, 64, 256, 2_304, 2_304]


def test_unknown_fields_and_answers_in_other_media_are_refused(http: httpx.Client) -> None:
    refused = [generate(http, FLASH, {**user({"text": "hello"}), "priority": "high"}),
               generate(http, FLASH, {**user({"text": "hello"}), "generationConfig": {
                   "maxTokens": 10}}),
               generate(http, FLASH, {**user({"text": "hello"}), "generationConfig": {
                   "responseModalities": ["TEXT", "IMAGE"]}})]
    assert [r.status_code for r in refused] == [400, 400, 400]
    assert 'Unknown name "priority"' in refused[0].json()["error"]["message"]
    # snake_case is Google's too.
    assert generate(http, LITE, {**user({"text": "hello"}), "generation_config": {
        "max_output_tokens": 5}}).status_code == 200
    assert bill_of(http).total.calls == 1


def test_refusals_are_in_googles_shape_and_unbilled(
        provider: StubProvider, http: httpx.Client, client: genai.Client) -> None:
    with pytest.raises(errors.ClientError) as unknown:
        client.models.generate_content(model="gemini-0-nothing", contents="hello")
    assert (unknown.value.code, unknown.value.status) == (404, "NOT_FOUND")
    wrong = httpx.post(f"{provider.url}/v1beta/models/{FLASH}:generateContent?key=wrong",
                       json=user({"text": "hello"}))
    none = httpx.post(f"{provider.url}/v1beta/models/{FLASH}:generateContent",
                      json=user({"text": "hello"}))
    over = generate(http, TINY, user({"text": "x" * 400}))
    counted = httpx.post(f"{provider.url}/v1beta/models/{FLASH}:countTokens?key=wrong",
                         json=user({"text": "hello"}))
    assert counted.json()["error"]["status"] == "INVALID_ARGUMENT"
    budget = generate(http, FLASH, {**user({"text": "hello"}), "generationConfig": {
        "thinkingConfig": {"thinkingBudget": 50_000}}})
    assert [(r.status_code, r.json()["error"]["status"]) for r in (wrong, none, over, budget)] \
        == [(400, "INVALID_ARGUMENT"), (403, "PERMISSION_DENIED"), (400, "INVALID_ARGUMENT"),
            (400, "INVALID_ARGUMENT")]
    assert "exceeds the maximum number of tokens allowed (100)" in over.json()["error"][
        "message"]
    bill = bill_of(http)
    assert (bill.requests, bill.total.calls) == (6, 0)


def test_faults_fail_unbilled_or_billed_and_break_a_stream(http: httpx.Client) -> None:
    body = user({"text": "hello"})
    failed = generate(http, LITE, body, {"X-Stub-Fail-Status": "503"})
    after = generate(http, LITE, body, {"X-Stub-Fail-After-Billing": "500"})
    assert [(r.status_code, r.json()["error"]["status"]) for r in (failed, after)] == [
        (503, "UNAVAILABLE"), (500, "INTERNAL")]
    with pytest.raises(httpx.RemoteProtocolError), http.stream(
            "POST", f"/v1beta/models/{LITE}:streamGenerateContent?alt=sse", json=body,
            headers={"X-Stub-Break-After-Events": "1", "X-Stub-Output-Tokens": "100"}) as stream:
        for _ in stream.iter_lines():
            pass
    bill = bill_of(http)
    assert [(c.status, c.billed) for c in bill.log] == [(503, False), (500, True),
                                                         (200, True)]


def test_url_context_and_candidates_are_billed(http: httpx.Client) -> None:
    start_fresh(http, {"files": {"https://example.com/a": {"bytes": 4_000}}})
    body = {**user({"text": "read https://example.com/a and https://example.com/b"}),
            "tools": [{"urlContext": {}}],
            "generationConfig": {"candidateCount": 3, "thinkingConfig": {"thinkingBudget": 0}}}
    answer = generate(http, FLASH, body, {"X-Stub-Output-Tokens": "10"}).json()
    usage = answer["usageMetadata"]
    # The prompt: 52 bytes -> 13 tokens + 4 + 3 = 20; the tool {"urlContext":{}} is no input.
    # URL context: the registered page, 4,000 bytes -> 1,000 tokens; the other is not read.
    assert (usage["promptTokenCount"], usage["toolUsePromptTokenCount"],
            usage["candidatesTokenCount"]) == (20, 1_000, 30)
    assert len(answer["candidates"]) == 3
    statuses = [u["urlRetrievalStatus"] for u in answer["candidates"][0][
        "urlContextMetadata"]["urlMetadata"]]
    assert statuses == ["URL_RETRIEVAL_STATUS_SUCCESS", "URL_RETRIEVAL_STATUS_ERROR"]
    # (20 + 1,000) x 0.30 + 3 x 10 x 2.50 = 381.
    assert only_call(http).cost_micros == 381


def test_thinking_settings_follow_each_models_documented_range(http: httpx.Client) -> None:
    def thinking(model: str, config: dict[str, Any]) -> httpx.Response:
        return generate(http, model, {**user({"text": "hello"}), "generationConfig": {
            "thinkingConfig": config}}, {"X-Stub-Output-Tokens": "40"})

    # 2.5 Pro cannot stop thinking; 2.5 takes no thinkingLevel; 3 takes no budget beside one.
    refused = [thinking(PRO, {"thinkingBudget": 0}),
               thinking(FLASH, {"thinkingLevel": "low"}),
               thinking(GEMINI_3, {"thinkingLevel": "low", "thinkingBudget": 128})]
    assert [r.status_code for r in refused] == [400, 400, 400]
    # Gemini 3 at low thinks a quarter of 40; Flash-Lite does not think unless asked.
    low = thinking(GEMINI_3, {"thinkingLevel": "low"}).json()["usageMetadata"]
    lite = thinking(LITE, {}).json()["usageMetadata"]
    assert (low["thoughtsTokenCount"], low["candidatesTokenCount"]) == (10, 30)
    assert "thoughtsTokenCount" not in lite
    assert lite["candidatesTokenCount"] == 40
    assert bill_of(http).total.calls == 2
    # A budget below the range is raised to its least (2.5 Pro's 128), the dearer reading.
    raised = generate(http, PRO, {**user({"text": "hello"}), "generationConfig": {
        "thinkingConfig": {"thinkingBudget": 1}}}, {"X-Stub-Output-Tokens": "1000"})
    assert raised.json()["usageMetadata"]["thoughtsTokenCount"] == 128


def test_control_refuses_a_bad_gemini_setting_whole(http: httpx.Client) -> None:
    refused = http.post("/control", json={"cached_contents": {"c": {"model": FLASH}},
                                          "thinking_outside_output_cap": True})
    assert refused.status_code == 400
    shown = http.get("/control").json()
    assert (shown["cached_contents"], shown["thinking_outside_output_cap"]) == ({}, False)


@pytest.mark.parametrize(("gemini", "why"), [
    ({"thinking": "sometimes"}, "thinking is one of"),
    ({"grounding_per": "result"}, "grounding_per"),
    ({"thinking_budget_min": 10, "thinking_budget_max": 5}, "thinking_budget_min"),
    ({"media_tokens": {"high": 1}}, "media_tokens"),
    ({"output_tokens_max": 0}, "output_tokens_max"),
])
def test_a_bad_gemini_entry_is_refused(gemini: dict[str, Any], why: str) -> None:
    entry = TABLE["models"][TINY]
    bad = {"models": {"g": {**entry, "gemini": {**entry["gemini"], **gemini}}}}
    with pytest.raises(ValueError, match=why):
        StubPrices.load(bad)


# -- Vertex AI ---------------------------------------------------------------------------------

PROJECT, REGION = "stub-project", "us-central1"


@pytest.fixture(scope="module")
def credentials(provider: StubProvider) -> service_account.Credentials:
    info = httpx.get(f"{provider.url}/vertex/service_account").json()
    assert info["token_uri"] == f"{provider.url}/token"
    return sa_credentials(info)


def test_vertex_gemini_through_google_genai_with_a_service_account(
        provider: StubProvider, credentials: service_account.Credentials,
        http: httpx.Client) -> None:
    vertex = genai.Client(vertexai=True, project=PROJECT, location=REGION,
                          credentials=credentials, http_options=types.HttpOptions(
                              base_url=provider.url, retry_options=NO_RETRY))
    config = types.GenerateContentConfig(http_options=call_headers(Output_Tokens="10",
                                                                   Reasoning_Tokens="0"))
    answer = vertex.models.generate_content(model=PRO, contents="hello", config=config)
    assert answer.usage_metadata
    assert answer.usage_metadata.traffic_type == "ON_DEMAND"
    chunks = list(vertex.models.generate_content_stream(model=PRO, contents="hello",
                                                        config=config))
    assert chunks[-1].usage_metadata
    assert chunks[-1].usage_metadata.candidates_token_count == 10
    assert vertex.models.count_tokens(model=PRO, contents="hello").total_tokens == HELLO_TOKENS
    bill = bill_of(http)
    assert [(c.api, c.billed) for c in bill.log] == [
        ("vertex.gemini", True), ("vertex.gemini", True), ("vertex.gemini.count_tokens", False)]
    # Pro: 9 x 1.25 + 10 x 10 = 111.25 -> 112, twice.
    assert bill.total.cost_micros == 224


def test_claude_on_vertex_through_anthropic_vertex(
        provider: StubProvider, credentials: service_account.Credentials,
        http: httpx.Client) -> None:
    claude = anthropic.AnthropicVertex(region="us-east5", project_id=PROJECT,
                                       credentials=credentials, base_url=f"{provider.url}/v1",
                                       max_retries=0)
    headers = {"X-Stub-Output-Tokens": "20"}
    message = claude.messages.create(model="claude-sonnet-4-5@20250929", max_tokens=100,
                                     messages=[{"role": "user", "content": "hello"}],
                                     extra_headers=headers)
    assert (message.usage.input_tokens, message.usage.output_tokens) == (HELLO_TOKENS, 20)
    with claude.messages.stream(model="claude-sonnet-4-5@20250929", max_tokens=100,
                                messages=[{"role": "user", "content": "hello"}],
                                extra_headers=headers) as stream:
        assert stream.get_final_message().usage.output_tokens == 20
    everywhere = anthropic.AnthropicVertex(region="global", project_id=PROJECT,
                                           credentials=credentials,
                                           base_url=f"{provider.url}/v1", max_retries=0)
    everywhere.messages.create(model="claude-sonnet-4-5@20250929", max_tokens=100,
                               messages=[{"role": "user", "content": "hello"}],
                               extra_headers=headers)
    bill = bill_of(http)
    assert [(c.api, c.model, c.stream) for c in bill.log] == [
        ("vertex.messages", "claude-sonnet-4-5-20250929", False),
        ("vertex.messages", "claude-sonnet-4-5-20250929", True),
        ("vertex.messages", "claude-sonnet-4-5-20250929", False)]
    # Sonnet 4.5: $3 in, $15 out: 9 x 3 + 20 x 15 = 327 at the global endpoint, and 10% more
    # at a regional one: 359.7 -> 360.
    assert [c.cost_micros for c in bill.log] == [360, 360, 327]


def test_a_wrong_or_expired_token_is_refused_unbilled(
        provider: StubProvider, credentials: service_account.Credentials,
        http: httpx.Client) -> None:
    url = (f"{provider.url}/v1/projects/{PROJECT}/locations/{REGION}/publishers/google/models/"
           f"{FLASH}:generateContent")
    credentials.refresh(google_request())  # type: ignore[no-untyped-call]
    good = {"Authorization": f"Bearer {credentials.token}"}
    assert httpx.post(url, json=user({"text": "hello"}), headers=good).status_code == 200
    wrong = httpx.post(url, json=user({"text": "hello"}),
                       headers={"Authorization": "Bearer ya29.forged"})
    claude = httpx.post(url.replace("google/models/" + FLASH + ":generateContent",
                                    "anthropic/models/claude-sonnet-4-5@20250929:rawPredict"),
                        json={"anthropic_version": "vertex-2023-10-16", "max_tokens": 10,
                              "messages": [{"role": "user", "content": "hello"}]})
    start_fresh(http, {"clock_offset_s": 3_601})  # the token's hour has passed
    expired = httpx.post(url, json=user({"text": "hello"}), headers=good)
    assert [(r.status_code, r.json()["error"]["status"]) for r in (wrong, claude, expired)] == [
        (401, "UNAUTHENTICATED")] * 3
    assert bill_of(http).total.calls == 0


def test_the_token_endpoint_refuses_an_assertion_it_cannot_verify(
        provider: StubProvider) -> None:
    info = httpx.get(f"{provider.url}/vertex/service_account").json()
    other = rsa.generate_private_key(public_exponent=65_537, key_size=2_048)
    forged = {**info, "private_key": other.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()).decode()}
    with pytest.raises(RefreshError, match="Invalid JWT Signature"):
        sa_credentials(forged).refresh(google_request())  # type: ignore[no-untyped-call]
    signer = crypt.RSASigner.from_service_account_info(info)  # type: ignore[no-untyped-call]
    now_s = int(time.time())
    claims = {"iss": info["client_email"], "aud": "https://oauth2.googleapis.com/token",
              "scope": "https://www.googleapis.com/auth/cloud-platform"}
    for bad, why in (({"iat": now_s - 7_200, "exp": now_s - 3_600}, "short-lived"),
                     ({"iat": now_s, "exp": now_s + 7_200}, "longer than an hour"),
                     ({"iat": now_s, "exp": now_s + 600, "aud": "https://elsewhere/token"},
                      "aud")):
        assertion = jwt.encode(signer, {**claims, **bad}).decode()  # type: ignore[no-untyped-call]
        answer = httpx.post(f"{provider.url}/token", data={
            "grant_type": "urn:ietf:params:oauth:grant-type:jwt-bearer", "assertion": assertion})
        assert answer.status_code == 400
        assert why in answer.json()["error_description"]
    head = base64.urlsafe_b64encode(json.dumps({"alg": "none"}).encode()).decode()
    unsigned = httpx.post(f"{provider.url}/token", data={
        "grant_type": "urn:ietf:params:oauth:grant-type:jwt-bearer",
        "assertion": f"{head}.{head}.{head}"})
    assert unsigned.status_code == 400
    assert unsigned.json()["error"] == "invalid_grant"


def google_request() -> Any:
    from google.auth.transport.requests import Request

    return Request()


def sa_credentials(info: dict[str, Any]) -> service_account.Credentials:
    """google-auth's credentials from a service-account JSON (google-auth is untyped)."""
    credentials: service_account.Credentials = (
        service_account.Credentials.from_service_account_info(  # type: ignore[no-untyped-call]
            info, scopes=["https://www.googleapis.com/auth/cloud-platform"]))
    return credentials
