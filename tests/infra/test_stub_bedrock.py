"""The stub's Bedrock runtime is the witness a gateway's Bedrock upstream is judged by: it must
bill Claude on Bedrock as AWS would, and refuse what AWS refuses, unbilled.

Every figure is worked by hand from the stub's Bedrock table (infra/stub_prices.json, source
"bedrock": genai-prices' `aws` rows), never computed by the code under test. Calls go through
the real clients, boto3's bedrock-runtime and the anthropic SDK's AnthropicBedrock, signed with
SigV4 by botocore; raw httpx (signed by botocore's SigV4Auth) where a test reads the wire or
sends what the SDKs would not. Nothing leaves the machine: every endpoint is the stub on
127.0.0.1, and no AWS config file, credentials file or instance metadata is read.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import anthropic
import boto3
import botocore.auth
import httpx
import pytest
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from botocore.credentials import Credentials
from botocore.eventstream import EventStreamBuffer
from botocore.exceptions import ClientError, EventStreamError

from infra.stub_provider import StubProvider
from tests.infra.conftest import start_fresh
from tests.infra.test_stub_provider import bill_of, only_call

ACCESS_KEY = "AKIAIOSFODNN7EXAMPLE"
SECRET_KEY = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
REGION = "us-east-1"
VERSION = "bedrock-2023-05-31"
GLOBAL_SONNET = "global.anthropic.claude-sonnet-4-5-20250929-v1:0"
US_SONNET = "us.anthropic.claude-sonnet-4-5-20250929-v1:0"
SONNET = "anthropic.claude-sonnet-4-5-20250929-v1:0"  # the entry a geographic profile bills
HELLO: Any = [{"role": "user", "content": "hello"}]
# "hello": 5 UTF-8 bytes -> ceil(5 / 4) = 2 tokens, + 4 for the message, + 3 for the reply.
HELLO_TOKENS = 9
# A 5,000-byte text: 1,250 tokens, above Sonnet 4.5's 1,024-token cache minimum.
LONG = "x" * 5_000
CALL_TIMEOUT_S = 10.0
ENV = {"AWS_CONFIG_FILE": "/dev/null", "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
       "AWS_EC2_METADATA_DISABLED": "true"}


@pytest.fixture(scope="module", autouse=True)
def no_aws_config() -> Iterator[None]:
    """No AWS file or metadata endpoint is read: the clients use the static keys given."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in ENV.items():
            patch.setenv(name, value)
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                     "AWS_PROFILE", "AWS_REGION", "AWS_DEFAULT_REGION"):
            patch.delenv(name, raising=False)
        yield


@pytest.fixture(scope="module")
def provider() -> Iterator[StubProvider]:
    with StubProvider(seed=11, latency_ms_min=0, latency_ms_max=2) as stub:
        yield stub


@pytest.fixture(scope="module")
def http(provider: StubProvider) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=provider.url, timeout=CALL_TIMEOUT_S) as client:
        yield client


def bedrock_client(provider: StubProvider, **credentials: str) -> Any:
    session = boto3.session.Session(
        aws_access_key_id=credentials.get("access", ACCESS_KEY),
        aws_secret_access_key=credentials.get("secret", SECRET_KEY),
        aws_session_token=credentials.get("token"), region_name=REGION)
    return session.client("bedrock-runtime", endpoint_url=provider.url, config=Config(
        retries={"max_attempts": 1, "mode": "standard"}, read_timeout=CALL_TIMEOUT_S,
        connect_timeout=CALL_TIMEOUT_S))


@pytest.fixture(scope="module")
def runtime(provider: StubProvider) -> Any:
    return bedrock_client(provider)


@pytest.fixture(scope="module")
def claude(provider: StubProvider) -> anthropic.AnthropicBedrock:
    return anthropic.AnthropicBedrock(aws_access_key=ACCESS_KEY, aws_secret_key=SECRET_KEY,
                                      aws_region=REGION, base_url=provider.url, max_retries=0,
                                      timeout=CALL_TIMEOUT_S)


@pytest.fixture(autouse=True)
def fresh_bill(http: httpx.Client) -> None:
    start_fresh(http, {"prompt_cache": True, "clock_offset_s": 0, "bedrock_credentials": {
        "access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY, "region": REGION}})


@contextmanager
def stub_headers(client: Any, headers: dict[str, str]) -> Iterator[None]:
    """X-Stub-* headers on each boto3 call, added before it is signed."""

    def add(request: AWSRequest, **kwargs: Any) -> None:
        for name, value in headers.items():
            request.headers[name] = value

    client.meta.events.register("before-sign.bedrock-runtime.*", add, unique_id="stub")
    try:
        yield
    finally:
        client.meta.events.unregister("before-sign.bedrock-runtime.*", unique_id="stub")


def body(**more: Any) -> str:
    return json.dumps({"anthropic_version": VERSION, "max_tokens": 200, "messages": HELLO,
                       **more})


def signed(provider: StubProvider, path: str, data: bytes, *, access: str = ACCESS_KEY,
           secret: str = SECRET_KEY, region: str = REGION, service: str = "bedrock",
           headers: dict[str, str] | None = None) -> dict[str, str]:
    """The headers of a request signed by botocore's SigV4Auth, as a client sends them."""
    request = AWSRequest(method="POST", url=provider.url + path, data=data,
                         headers={"content-type": "application/json", **(headers or {})})
    SigV4Auth(Credentials(access, secret), service, region).add_auth(request)
    return dict(request.headers.items())


def post_signed(http: httpx.Client, provider: StubProvider, path: str, doc: dict[str, Any],
                **signing: Any) -> httpx.Response:
    data = json.dumps(doc).encode()
    return http.post(path, content=data, headers=signed(provider, path, data, **signing))


def frames(raw: bytes) -> list[tuple[dict[str, Any], bytes]]:
    """The event stream's messages, as botocore's decoder reads them: headers and payload."""
    buffer = EventStreamBuffer()
    buffer.add_data(raw)
    return [(dict(message.headers), message.payload) for message in buffer]


def chunk_docs(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(base64.b64decode(json.loads(payload)["bytes"]))
            for headers, payload in frames(raw) if headers[":message-type"] == "event"]


def error_of(response: httpx.Response) -> tuple[int, str, str]:
    """(status, AWS's error name from x-amzn-ErrorType, message) of a refusal."""
    return (response.status_code, response.headers["x-amzn-errortype"].split(":")[0],
            response.json()["message"])


# -- InvokeModel and the stream, through boto3 ----------------------------------------------------


def test_invoke_model_bills_a_global_profile_at_its_own_rates(runtime: Any,
                                                               http: httpx.Client) -> None:
    with stub_headers(runtime, {"X-Stub-Output-Tokens": "10"}):
        answer = runtime.invoke_model(modelId=GLOBAL_SONNET, body=body())
    message = json.loads(answer["body"].read())
    headers = answer["ResponseMetadata"]["HTTPHeaders"]
    assert message["model"] == "claude-sonnet-4-5-20250929"
    assert message["id"].startswith("msg_bdrk_")
    assert message["usage"]["input_tokens"] == HELLO_TOKENS
    assert message["usage"]["output_tokens"] == 10
    assert headers["x-amzn-bedrock-input-token-count"] == str(HELLO_TOKENS)
    assert headers["x-amzn-bedrock-output-token-count"] == "10"
    assert headers["x-amzn-bedrock-cache-read-input-token-count"] == "0"
    call = only_call(http)
    assert (call.api, call.model, call.model_requested, call.stream, call.billed) == (
        "bedrock.invoke", GLOBAL_SONNET, None, False, True)
    # Global Sonnet 4.5: $3 in, $15 out a million: 9 x 3 + 10 x 15 = 177 micro-dollars.
    assert call.cost_micros == 177


def test_a_geographic_profile_bills_the_in_region_rates(runtime: Any,
                                                        http: httpx.Client) -> None:
    with stub_headers(runtime, {"X-Stub-Output-Tokens": "10"}):
        runtime.invoke_model(modelId=US_SONNET, body=body())
    call = only_call(http)
    assert (call.model, call.model_requested) == (SONNET, US_SONNET)
    # In-region Sonnet 4.5 is 10% dearer: 9 x 3.30 + 10 x 16.50 = 194.7, rounded up once.
    assert call.cost_micros == 195


def test_an_arn_bills_the_profile_it_names(runtime: Any, http: httpx.Client) -> None:
    arn = f"arn:aws:bedrock:{REGION}:123456789012:inference-profile/{GLOBAL_SONNET}"
    with stub_headers(runtime, {"X-Stub-Output-Tokens": "1"}):
        runtime.invoke_model(modelId=arn, body=body())
    call = only_call(http)
    assert (call.model, call.model_requested, call.cost_micros) == (GLOBAL_SONNET, arn,
                                                                    9 * 3 + 15)


def test_the_stream_is_chunks_with_invocation_metrics_last(runtime: Any,
                                                           http: httpx.Client) -> None:
    with stub_headers(runtime, {"X-Stub-Output-Tokens": "40"}):
        answer = runtime.invoke_model_with_response_stream(modelId=GLOBAL_SONNET, body=body())
    docs = [json.loads(event["chunk"]["bytes"]) for event in answer["body"]]
    kinds = [d["type"] for d in docs]
    assert kinds[0] == "message_start"
    assert kinds[-1] == "message_stop"
    assert "ping" not in kinds
    assert docs[0]["message"]["model"] == "claude-sonnet-4-5-20250929"
    text = "".join(d["delta"]["text"] for d in docs if d["type"] == "content_block_delta")
    assert len(text.split()) == 40
    assert docs[-1]["amazon-bedrock-invocationMetrics"] == {
        "inputTokenCount": HELLO_TOKENS, "outputTokenCount": 40, "cacheReadInputTokenCount": 0,
        "cacheWriteInputTokenCount": 0, "invocationLatency": 0, "firstByteLatency": 0}
    call = only_call(http)
    assert (call.stream, call.cost_micros) == (True, 9 * 3 + 40 * 15)


def test_botocores_decoder_reads_the_stubs_framing(provider: StubProvider,
                                                   http: httpx.Client) -> None:
    path = f"/model/{GLOBAL_SONNET}/invoke-with-response-stream"
    data = body().encode()
    response = http.post(path, content=data, headers={
        **signed(provider, path, data), "X-Stub-Output-Tokens": "3"})
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/vnd.amazon.eventstream"
    messages = frames(response.content)
    assert all(h == {":event-type": "chunk", ":content-type": "application/json",
                     ":message-type": "event"} for h, _ in messages)
    docs = chunk_docs(response.content)
    assert docs[-1]["amazon-bedrock-invocationMetrics"]["outputTokenCount"] == 3


# -- the anthropic SDK's Bedrock client ---------------------------------------------------------


def test_anthropic_bedrock_creates_and_streams(claude: anthropic.AnthropicBedrock,
                                               http: httpx.Client) -> None:
    forced = {"X-Stub-Output-Tokens": "5"}
    message = claude.messages.create(model=GLOBAL_SONNET, max_tokens=100, messages=HELLO,
                                     extra_headers=forced)
    assert (message.usage.input_tokens, message.usage.output_tokens) == (HELLO_TOKENS, 5)
    with claude.messages.stream(model=US_SONNET, max_tokens=100, messages=HELLO,
                                extra_headers=forced) as stream:
        final = stream.get_final_message()
    assert final.usage.output_tokens == 5
    assert final.content[0].type == "text"
    assert len(final.content[0].text.split()) == 5
    created, streamed = bill_of(http).log
    assert (created.stream, created.cost_micros) == (False, 9 * 3 + 5 * 15)
    # In-region: 9 x 3.30 + 5 x 16.50 = 112.2, rounded up.
    assert (streamed.stream, streamed.model, streamed.cost_micros) == (True, SONNET, 113)


def test_betas_are_the_bodys_list_not_a_header(provider: StubProvider, http: httpx.Client,
                                               claude: anthropic.AnthropicBedrock) -> None:
    # A thinking budget at max_tokens needs interleaved thinking's beta.
    thinking = {"type": "enabled", "budget_tokens": 2_048}
    doc = json.loads(body(max_tokens=2_048, thinking=thinking))
    path = f"/model/{GLOBAL_SONNET}/invoke"
    header_only = post_signed(http, provider, path, doc, headers={
        "anthropic-beta": "interleaved-thinking-2025-05-14"})
    assert error_of(header_only)[:2] == (400, "ValidationException")
    in_body = post_signed(http, provider, path,
                          {**doc, "anthropic_beta": ["interleaved-thinking-2025-05-14"]})
    assert in_body.status_code == 200
    # The SDK moves the header into the body itself.
    claude.messages.create(model=GLOBAL_SONNET, max_tokens=2_048, messages=HELLO,
                           thinking={"type": "enabled", "budget_tokens": 2_048},
                           extra_headers={"anthropic-beta": "interleaved-thinking-2025-05-14"})
    assert [c.billed for c in bill_of(http).log] == [False, True, True]


def test_the_prompt_cache_is_reported_in_headers_and_metrics(runtime: Any,
                                                             http: httpx.Client) -> None:
    system = [{"type": "text", "text": LONG, "cache_control": {"type": "ephemeral"}}]
    with stub_headers(runtime, {"X-Stub-Output-Tokens": "2"}):
        first = runtime.invoke_model(modelId=GLOBAL_SONNET, body=body(system=system))
        second = runtime.invoke_model_with_response_stream(modelId=GLOBAL_SONNET,
                                                           body=body(system=system))
    written = json.loads(first["body"].read())["usage"]
    headers = first["ResponseMetadata"]["HTTPHeaders"]
    assert written["cache_creation_input_tokens"] > 1_024
    assert headers["x-amzn-bedrock-cache-write-input-token-count"] == str(
        written["cache_creation_input_tokens"])
    metrics = [json.loads(e["chunk"]["bytes"]) for e in second["body"]][-1][
        "amazon-bedrock-invocationMetrics"]
    assert metrics["cacheReadInputTokenCount"] == written["cache_creation_input_tokens"]
    assert metrics["cacheWriteInputTokenCount"] == 0
    assert metrics["inputTokenCount"] == written["input_tokens"]
    one, two = bill_of(http).log
    # Global Sonnet 4.5: writes $3.75, reads $0.30, input $3, output $15 a million.
    w, u = written["cache_creation_input_tokens"], written["input_tokens"]
    assert one.cost_micros == -(-(w * 375 + u * 300 + 2 * 1500) // 100)
    assert two.cost_micros == -(-(w * 30 + u * 300 + 2 * 1500) // 100)


# -- what Bedrock refuses, unbilled ----------------------------------------------------------------


@pytest.mark.parametrize(("signing", "name", "words"), [
    ({"secret": "not-the-secret"}, "InvalidSignatureException", "does not match"),
    ({"access": "AKIAOTHERKEY00000000"}, "UnrecognizedClientException", "security token"),
    ({"region": "eu-west-1"}, "InvalidSignatureException", "region"),
    ({"service": "s3"}, "InvalidSignatureException", "service"),
])
def test_a_bad_signature_is_refused_unbilled(provider: StubProvider, http: httpx.Client,
                                             signing: dict[str, str], name: str,
                                             words: str) -> None:
    answer = post_signed(http, provider, f"/model/{GLOBAL_SONNET}/invoke", json.loads(body()),
                         **signing)
    status, error, message = error_of(answer)
    assert (status, error) == (403, name)
    assert words in message
    bill = bill_of(http)
    assert (bill.requests, bill.total.calls, bill.total.cost_micros) == (1, 0, 0)


def test_a_body_changed_after_signing_or_no_signature_is_refused(
        provider: StubProvider, http: httpx.Client) -> None:
    path = f"/model/{GLOBAL_SONNET}/invoke"
    data = body().encode()
    tampered = http.post(path, content=body(max_tokens=201).encode(),
                         headers=signed(provider, path, data))
    assert error_of(tampered)[:2] == (403, "InvalidSignatureException")
    unsigned = http.post(path, content=data, headers={"content-type": "application/json"})
    assert error_of(unsigned) == (403, "MissingAuthenticationTokenException",
                                  "Missing Authentication Token")
    assert bill_of(http).total.calls == 0


def test_a_stale_signature_is_refused(runtime: Any, http: httpx.Client,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(botocore.auth, "get_current_datetime",
                        lambda: datetime.now(UTC).replace(tzinfo=None) - timedelta(minutes=6))
    with pytest.raises(ClientError) as refused:
        runtime.invoke_model(modelId=GLOBAL_SONNET, body=body())
    assert refused.value.response["Error"]["Code"] == "InvalidSignatureException"
    assert "Signature expired" in refused.value.response["Error"]["Message"]
    assert bill_of(http).total.calls == 0


def test_control_sets_the_credentials_a_session_token_included(
        provider: StubProvider, http: httpx.Client, runtime: Any) -> None:
    temporary = {"access_key_id": "ASIATEMPORARY0000000", "secret_access_key": "temp-secret",
                 "session_token": "temp-token", "region": REGION}
    shown = http.post("/control", json={"bedrock_credentials": temporary}).json()
    assert shown["bedrock_credentials"] == {"access_key_id": "ASIATEMPORARY0000000",
                                            "region": REGION, "session_token": "(set)",
                                            "api_key": None}
    assert "temp-secret" not in json.dumps(shown)
    with pytest.raises(ClientError) as old_key:
        runtime.invoke_model(modelId=GLOBAL_SONNET, body=body())
    assert old_key.value.response["Error"]["Code"] == "UnrecognizedClientException"
    no_token = bedrock_client(provider, access="ASIATEMPORARY0000000", secret="temp-secret")
    with pytest.raises(ClientError):
        no_token.invoke_model(modelId=GLOBAL_SONNET, body=body())
    client = bedrock_client(provider, access="ASIATEMPORARY0000000", secret="temp-secret",
                            token="temp-token")
    client.invoke_model(modelId=GLOBAL_SONNET, body=body())
    assert [c.billed for c in bill_of(http).log] == [False, False, True]


@pytest.mark.parametrize(("doc", "model_id", "words"), [
    ({"model": GLOBAL_SONNET}, GLOBAL_SONNET, "extraneous key [model]"),
    ({"stream": True}, GLOBAL_SONNET, "extraneous key [stream]"),
    ({"anthropic_version": None}, GLOBAL_SONNET, "anthropic_version"),
    ({"anthropic_version": "bedrock-1999"}, GLOBAL_SONNET, "anthropic_version"),
    ({}, "anthropic.claude-nonexistent-v1:0", "model identifier is invalid"),
    ({}, "gpt-4o", "model identifier is invalid"),
    ({"max_tokens": None}, GLOBAL_SONNET, "max_tokens"),
    # Bedrock does not run Anthropic's web search: its entries have no search fee.
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, GLOBAL_SONNET,
     "web search is not available"),
    ({"tools": [{"type": "code_execution_20250825", "name": "code_execution"}]}, GLOBAL_SONNET,
     "code execution is not available"),
    # Anthropic's fields Bedrock's Claude body does not take, and betas it does not take.
    ({"service_tier": "auto"}, GLOBAL_SONNET, "extraneous key [service_tier]"),
    ({"speed": "fast"}, GLOBAL_SONNET, "extraneous key [speed]"),
    ({"anthropic_beta": ["prompt-caching-scope-2026-01-05"]}, GLOBAL_SONNET,
     "invalid beta flag"),
    ({"anthropic_beta": ["advanced-tool-use-2025-11-20"]}, GLOBAL_SONNET, "invalid beta flag"),
])
def test_a_bad_body_is_a_validation_exception(runtime: Any, http: httpx.Client,
                                              doc: dict[str, Any], model_id: str,
                                              words: str) -> None:
    sent = {k: v for k, v in json.loads(body(**doc)).items() if v is not None}
    with pytest.raises(ClientError) as refused:
        runtime.invoke_model(modelId=model_id, body=json.dumps(sent))
    error = refused.value.response["Error"]
    assert (refused.value.response["ResponseMetadata"]["HTTPStatusCode"], error["Code"]) == (
        400, "ValidationException")
    assert words in error["Message"]
    assert bill_of(http).total.calls == 0


# -- faults, in Bedrock's shapes -------------------------------------------------------------------


@pytest.mark.parametrize(("status", "name"), [
    (429, "ThrottlingException"), (403, "AccessDeniedException"),
    (404, "ResourceNotFoundException"), (500, "InternalServerException"),
    (503, "ServiceUnavailableException"),
])
def test_a_failure_is_in_bedrocks_shape_unbilled(runtime: Any, http: httpx.Client, status: int,
                                                 name: str) -> None:
    with stub_headers(runtime, {"X-Stub-Fail-Status": str(status)}), pytest.raises(
            ClientError) as failed:
        runtime.invoke_model(modelId=GLOBAL_SONNET, body=body())
    assert failed.value.response["Error"]["Code"] == name
    assert failed.value.response["ResponseMetadata"]["HTTPStatusCode"] == status
    assert bill_of(http).total.calls == 0


@pytest.mark.parametrize(("status", "name"), [
    (429, "throttlingException"), (500, "internalServerException"),
    (503, "serviceUnavailableException"), (529, "modelStreamErrorException"),
])
def test_a_stream_failed_after_billing_ends_in_an_exception_event(
        provider: StubProvider, http: httpx.Client, runtime: Any, status: int,
        name: str) -> None:
    path = f"/model/{GLOBAL_SONNET}/invoke-with-response-stream"
    data = body().encode()
    response = http.post(path, content=data, headers={
        **signed(provider, path, data), "X-Stub-Fail-After-Billing": str(status)})
    assert response.status_code == 200
    *started, (headers, payload) = frames(response.content)
    assert [json.loads(base64.b64decode(json.loads(p)["bytes"]))["type"]
            for _, p in started] == ["message_start"]
    assert (headers[":message-type"], headers[":exception-type"]) == ("exception", name)
    if name == "modelStreamErrorException":
        assert json.loads(payload)["originalStatusCode"] == status
    with stub_headers(runtime, {"X-Stub-Fail-After-Billing": str(status)}):
        answer = runtime.invoke_model_with_response_stream(modelId=GLOBAL_SONNET, body=body())
        with pytest.raises(EventStreamError) as failed:
            list(answer["body"])
    assert failed.value.response["Error"]["Code"] == name
    assert [c.billed for c in bill_of(http).log] == [True, True]


def test_a_stream_broken_off_is_billed_whole(provider: StubProvider, http: httpx.Client) -> None:
    path = f"/model/{GLOBAL_SONNET}/invoke-with-response-stream"
    data = body().encode()
    with http.stream("POST", path, content=data, headers={
            **signed(provider, path, data), "X-Stub-Output-Tokens": "20",
            "X-Stub-Break-After-Events": "2"}) as response:
        pieces: list[bytes] = []
        with pytest.raises(httpx.RemoteProtocolError):
            pieces.extend(response.iter_bytes())
        raw = b"".join(pieces)
    assert [d["type"] for d in chunk_docs(raw)] == ["message_start", "content_block_start"]
    assert only_call(http).cost_micros == 9 * 3 + 20 * 15


# -- CountTokens, and headers that would bill at other rates -----------------------------------


def test_count_tokens_counts_an_invoke_body_free(runtime: Any, http: httpx.Client) -> None:
    counted = runtime.count_tokens(modelId=US_SONNET,
                                   input={"invokeModel": {"body": body().encode()}})
    assert counted["inputTokens"] == HELLO_TOKENS
    with pytest.raises(ClientError) as refused:
        runtime.count_tokens(modelId=US_SONNET, input={"invokeModel": {"body": body(
            model=SONNET).encode()}})
    assert refused.value.response["Error"]["Code"] == "ValidationException"
    bill = bill_of(http)
    assert [(c.api, c.model, c.status, c.billed) for c in bill.log] == [
        ("bedrock.count_tokens", US_SONNET, 200, False),
        ("bedrock.count_tokens", US_SONNET, 400, False)]
    assert (bill.requests, bill.total.calls) == (2, 0)


def test_count_tokens_is_signed_too(provider: StubProvider, http: httpx.Client) -> None:
    doc = {"input": {"invokeModel": {"body": base64.b64encode(body().encode()).decode()}}}
    answer = post_signed(http, provider, f"/model/{GLOBAL_SONNET}/count-tokens", doc,
                         secret="not-the-secret")
    assert error_of(answer)[:2] == (403, "InvalidSignatureException")


@pytest.mark.parametrize(("header", "value"), [
    ("X-Amzn-Bedrock-Service-Tier", "flex"), ("X-Amzn-Bedrock-Service-Tier", "priority"),
    ("X-Amzn-Bedrock-PerformanceConfig-Latency", "optimized"),
    ("X-Amzn-Bedrock-GuardrailIdentifier", "gr-1"),
])
def test_a_header_that_bills_other_rates_is_refused(runtime: Any, http: httpx.Client,
                                                    header: str, value: str) -> None:
    with stub_headers(runtime, {header: value}), pytest.raises(ClientError) as refused:
        runtime.invoke_model(modelId=GLOBAL_SONNET, body=body())
    assert refused.value.response["Error"]["Code"] == "ValidationException"
    with stub_headers(runtime, {"X-Amzn-Bedrock-Service-Tier": "default"}):
        runtime.invoke_model(modelId=GLOBAL_SONNET, body=body())
    assert [c.billed for c in bill_of(http).log] == [False, True]


def test_the_1m_window_is_the_bodys_beta_at_long_context_rates(runtime: Any,
                                                                http: httpx.Client) -> None:
    # 800,000 bytes: 200,000 tokens, + 4 for the message and 3 for the reply: 200,007, above
    # the 200,000 a call without the beta may hold.
    long = [{"role": "user", "content": "x" * 800_000}]
    with stub_headers(runtime, {"X-Stub-Output-Tokens": "10"}):
        with pytest.raises(ClientError) as too_long:
            runtime.invoke_model(modelId=GLOBAL_SONNET, body=body(messages=long))
        runtime.invoke_model(modelId=GLOBAL_SONNET, body=body(
            messages=long, anthropic_beta=["context-1m-2025-08-07"]))
    assert "prompt is too long" in too_long.value.response["Error"]["Message"]
    refused, served = bill_of(http).log
    assert not refused.billed
    assert served.service_tier == "long_context"
    # Global Sonnet 4.5 long context: $6 in, $22.50 out a million.
    assert served.cost_micros == 200_007 * 6 + 10 * 45 // 2


def test_a_bedrock_api_key_is_a_bearer_token(provider: StubProvider, http: httpx.Client) -> None:
    api_key = "ABSKstubbedrockapikey"
    path = f"/model/{GLOBAL_SONNET}/invoke"
    unset = http.post(path, content=body(), headers={"Authorization": f"Bearer {api_key}"})
    assert error_of(unset)[:2] == (403, "AccessDeniedException")
    http.post("/control", json={"bedrock_credentials": {
        "access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY, "region": REGION,
        "api_key": api_key}}).raise_for_status()
    wrong = http.post(path, content=body(), headers={"Authorization": "Bearer other"})
    assert error_of(wrong)[:2] == (403, "AccessDeniedException")
    # boto3 takes the key from AWS_BEARER_TOKEN_BEDROCK but sends it over HTTPS only, which
    # the stub does not serve: the anthropic SDK sends it, as `api_key`.
    served = http.post(path, content=body(), headers={"Authorization": f"Bearer {api_key}"})
    assert served.status_code == 200
    anthropic.AnthropicBedrock(api_key=api_key, aws_region=REGION, base_url=provider.url,
                               max_retries=0, timeout=CALL_TIMEOUT_S).messages.create(
        model=GLOBAL_SONNET, max_tokens=10, messages=HELLO)
    assert [c.billed for c in bill_of(http).log] == [False, False, True, True]
