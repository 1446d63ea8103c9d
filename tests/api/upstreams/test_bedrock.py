"""The Bedrock upstream (api/upstreams/bedrock.py) against the stub's Bedrock runtime, which
verifies SigV4 with botocore and bills Claude at the stub's Bedrock table: each call is judged by
the stub's bill, read as the gateway's Messages format reads Anthropic's answers. Nothing leaves
the machine: every endpoint is the stub on 127.0.0.1."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import httpx
import pytest

from api.upstreams.bedrock import BedrockUpstream, sse_event
from api.upstreams.cloud_messages import cloud_messages_body, error_as_anthropic
from core.formats import Api, Plan
from core.gateway_request import plan
from core.upstream import NotSent, Sent, Unanswered
from core.upstreams import UpstreamDef
from infra.stub_provider import StubProvider
from tests.api.upstreams.conftest import (
    HANG_TIMEOUT_S,
    answer_usage,
    bill_of,
    closed_port_url,
    deadline,
    only_call,
    same_tokens,
    start_fresh,
    streamed,
    tallied,
)

ACCESS_KEY = "AKIAIOSFODNN7EXAMPLE"
SECRET_KEY = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
REGION = "us-east-1"
GLOBAL_SONNET = "global.anthropic.claude-sonnet-4-5-20250929-v1:0"
US_SONNET = "us.anthropic.claude-sonnet-4-5-20250929-v1:0"
HELLO_TOKENS = 9  # "hello" as the stub counts it: 2 + 4 for the message + 3 for the reply


def definition(base_url: str, *, secret: str = SECRET_KEY,
               token: str | None = None) -> UpstreamDef:
    return UpstreamDef(
        name="bedrock-east", api="bedrock", base_url=base_url, prices_provider="aws",
        priced={"claude-sonnet-4-5": "claude-sonnet-4-5", GLOBAL_SONNET: "claude-sonnet-4-5"},
        sent={"claude-sonnet-4-5": GLOBAL_SONNET}, region=REGION,
        signing_credentials=(ACCESS_KEY, secret, token))


@pytest.fixture
async def bedrock(provider: StubProvider) -> AsyncIterator[BedrockUpstream]:
    upstream = BedrockUpstream(definition(provider.url), timeout_s=10.0)
    yield upstream
    await upstream.aclose()


@pytest.fixture(autouse=True)
def fresh_bill(http: httpx.Client) -> None:
    start_fresh(http, {"prompt_cache": True, "clock_offset_s": 0, "bedrock_credentials": {
        "access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY, "region": REGION}})


def messages(model: str = GLOBAL_SONNET, *, stream: bool = False, output_tokens: int = 10,
             headers: tuple[tuple[str, str], ...] = (), **more: Any) -> Plan:
    """A Messages call as the gateway plans it, with the routed model id as its body's model
    and the stub's forced output length."""
    raw = json.dumps({"model": model, "max_tokens": 200, "stream": stream,
                      "messages": [{"role": "user", "content": "hello"}], **more}).encode()
    forwarded = (("anthropic-version", "2023-06-01"), *headers)
    # The stub's per-call header rides with the client's: the upstream forwards it unsigned.
    return replace(plan(Api.MESSAGES, raw, headers=forwarded),
                   headers=(*forwarded, ("X-Stub-Output-Tokens", str(output_tokens))))


async def test_invoke_answers_what_the_messages_format_settles(
        bedrock: BedrockUpstream, http: httpx.Client) -> None:
    call_plan = messages()
    sent = await bedrock.send(call_plan, deadline())
    assert sent[0] == 200
    usage = answer_usage(call_plan, sent[2])
    call = only_call(http)
    assert (call.api, call.model, call.stream, call.billed) == ("bedrock.invoke", GLOBAL_SONNET,
                                                                 False, True)
    assert same_tokens(usage, call)
    assert usage is not None
    assert (usage.input_tokens, usage.output_tokens) == (HELLO_TOKENS, 10)
    # Global Sonnet 4.5: $3 in, $15 out a million.
    assert call.cost_micros == HELLO_TOKENS * 3 + 10 * 15
    assert sent[1]["x-amzn-bedrock-output-token-count"] == "10"
    assert "request-id" in sent[1]


async def test_the_stream_becomes_anthropics_events_and_tallies_to_the_bill(
        bedrock: BedrockUpstream, http: httpx.Client) -> None:
    call_plan = messages(US_SONNET, stream=True, output_tokens=40)
    sent = await bedrock.send(call_plan, deadline())
    assert sent[0] == 200
    assert sent[1]["content-type"].startswith("text/event-stream")
    raw = await streamed(sent)
    events = [event.split(b"\n") for event in raw.split(b"\n\n") if event]
    kinds = [lines[0].removeprefix(b"event: ").decode() for lines in events]
    assert all(len(lines) == 2 and lines[1].startswith(b"data: {") for lines in events)
    assert [json.loads(lines[1][6:])["type"] for lines in events] == kinds
    assert kinds[0] == "message_start"
    assert kinds[-1] == "message_stop"
    assert "message_delta" in kinds
    assert "content_block_delta" in kinds
    tally = tallied(call_plan, raw)
    call = only_call(http)
    assert tally.finished
    assert same_tokens(tally.usage, call)
    assert (call.stream, call.billed) == (True, True)
    # In-region Sonnet 4.5 is 10% dearer: 9 x 3.30 + 40 x 16.50 = 689.7, rounded up.
    assert call.cost_micros == 690


async def test_the_anthropic_sdk_reads_the_translated_stream(bedrock: BedrockUpstream) -> None:
    import anthropic
    import httpx2

    call_plan = messages(stream=True, output_tokens=5)
    raw = await streamed(await bedrock.send(call_plan, deadline()))

    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, content=raw,
                              headers={"content-type": "text/event-stream"})

    client = anthropic.Anthropic(api_key="x", base_url="http://stub.invalid", max_retries=0,
                                 http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))
    with client.messages.stream(model="claude-sonnet-4-5", max_tokens=100,
                                messages=[{"role": "user", "content": "hello"}]) as stream:
        final = stream.get_final_message()
    assert (final.usage.input_tokens, final.usage.output_tokens) == (HELLO_TOKENS, 5)
    assert len(final.content[0].text.split()) == 5  # type: ignore[union-attr]


def test_the_body_is_bedrocks_with_the_betas_in_it() -> None:
    call_plan = messages(headers=(("anthropic-beta", "context-1m-2025-08-07"),), stream=True)
    model, content = cloud_messages_body(call_plan, "bedrock-2023-05-31", betas_in_body=True)
    body = json.loads(content)
    assert model == GLOBAL_SONNET
    assert "model" not in body
    assert "stream" not in body
    assert body["anthropic_version"] == "bedrock-2023-05-31"
    assert body["anthropic_beta"] == ["context-1m-2025-08-07"]


@pytest.mark.parametrize("betas_in_body", [True, False])
def test_the_clients_envelope_in_the_body_is_never_sent(betas_in_body: bool) -> None:
    """A body's `anthropic_beta` and `anthropic_version` (an operator may let them through the
    route's allow-list) are replaced by the checked header's betas and the cloud's version:
    on Bedrock (the betas in the body) and on Vertex (in the header, none in the body)."""
    call_plan = messages(headers=(("anthropic-beta", "interleaved-thinking-2025-05-14"),))
    call_plan = replace(call_plan, body={**call_plan.body, "anthropic_version": "2023-01-01",
                                         "anthropic_beta": ["context-1m-2025-08-07"]})
    _, content = cloud_messages_body(call_plan, "cloud-version", betas_in_body=betas_in_body)
    body = json.loads(content)
    assert body["anthropic_version"] == "cloud-version"
    assert body.get("anthropic_beta") == (
        ["interleaved-thinking-2025-05-14"] if betas_in_body else None)


async def test_a_count_sends_no_beta_of_the_clients_body(bedrock: BedrockUpstream,
                                                        http: httpx.Client) -> None:
    """Counted as it is invoked (cloud_body): a beta in the count body that Bedrock does not
    take would fail the count ("invalid beta flag"); it is dropped."""
    counted = json.dumps({"model": GLOBAL_SONNET, "anthropic_beta": ["betas-of-tomorrow"],
                          "messages": [{"role": "user", "content": "hello"}]}).encode()
    sent = await bedrock.count(Api.MESSAGES, counted, ())
    assert sent[0] == 200, sent[2]
    assert json.loads(sent[2])["input_tokens"] > 0


async def test_a_beta_reaches_bedrock_in_the_body(bedrock: BedrockUpstream,
                                                  http: httpx.Client) -> None:
    # A thinking budget at max_tokens is refused by the stub without interleaved thinking's
    # beta, which Bedrock reads only from the body.
    call_plan = messages(max_tokens=2_048, thinking={"type": "enabled", "budget_tokens": 2_048},
                         headers=(("anthropic-beta", "interleaved-thinking-2025-05-14"),))
    sent = await bedrock.send(call_plan, deadline())
    assert sent[0] == 200, sent[2]
    assert only_call(http).billed


async def test_a_wrong_secret_is_refused_unbilled_in_anthropics_shape(
        provider: StubProvider, http: httpx.Client) -> None:
    upstream = BedrockUpstream(definition(provider.url, secret="not-the-secret"), 10.0)
    try:
        sent = await upstream.send(messages(), deadline())
    finally:
        await upstream.aclose()
    assert sent[0] == 403
    assert isinstance(sent[2], bytes)
    error = json.loads(sent[2])
    assert (error["type"], error["error"]["type"]) == ("error", "permission_error")
    assert "signature" in error["error"]["message"]
    assert sent[1]["x-amzn-errortype"].startswith("InvalidSignatureException")
    assert bill_of(http).total.calls == 0


async def test_a_session_token_is_signed(provider: StubProvider, http: httpx.Client) -> None:
    start_fresh(http, {"bedrock_credentials": {
        "access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY, "region": REGION,
        "session_token": "session-1"}})
    upstream = BedrockUpstream(definition(provider.url, token="session-1"), 10.0)
    try:
        sent = await upstream.send(messages(), deadline())
    finally:
        await upstream.aclose()
    assert sent[0] == 200
    assert only_call(http).billed


@pytest.mark.parametrize(("status", "kind"), [(429, "rate_limit_error"),
                                              (500, "api_error"), (503, "overloaded_error")])
async def test_an_error_keeps_its_status_unbilled(bedrock: BedrockUpstream, http: httpx.Client,
                                                  status: int, kind: str) -> None:
    start_fresh(http, {"fail_status": status})
    for stream in (False, True):
        sent = await bedrock.send(messages(stream=stream), deadline())
        assert sent[0] == status
        assert isinstance(sent[2], bytes)
        assert json.loads(sent[2])["error"]["type"] == kind
    assert bill_of(http).total.calls == 0


async def test_an_unknown_model_is_refused_400(bedrock: BedrockUpstream,
                                               http: httpx.Client) -> None:
    sent = await bedrock.send(messages("anthropic.claude-nothing-v1:0"), deadline())
    assert sent[0] == 400
    assert isinstance(sent[2], bytes)
    assert json.loads(sent[2])["error"] == {
        "type": "invalid_request_error", "message": "The provided model identifier is invalid."}
    assert bill_of(http).total.calls == 0


async def test_a_refused_connection_is_not_sent() -> None:
    upstream = BedrockUpstream(definition(closed_port_url()), 10.0)
    try:
        with pytest.raises(NotSent):
            await upstream.send(messages(), deadline())
    finally:
        await upstream.aclose()


async def test_a_hang_is_unanswered(bedrock: BedrockUpstream, http: httpx.Client) -> None:
    start_fresh(http, {"hang": True})
    with pytest.raises(Unanswered):
        await bedrock.send(messages(), deadline(HANG_TIMEOUT_S))


async def test_a_stream_broken_off_is_unanswered(bedrock: BedrockUpstream,
                                                 http: httpx.Client) -> None:
    start_fresh(http, {"break_after_events": 2})
    sent = await bedrock.send(messages(stream=True, output_tokens=20), deadline())
    assert sent[0] == 200
    with pytest.raises(Unanswered):
        await streamed(sent)
    assert only_call(http).billed


async def test_an_exception_frame_after_billing_is_unanswered(bedrock: BedrockUpstream,
                                                              http: httpx.Client) -> None:
    start_fresh(http, {"fail_after_billing": 529})
    sent = await bedrock.send(messages(stream=True), deadline())
    assert sent[0] == 200
    with pytest.raises(Unanswered, match="modelStreamErrorException"):
        await streamed(sent)
    assert only_call(http).billed


def test_an_unknown_event_is_skipped_and_an_error_frame_ends_the_stream() -> None:
    assert sse_event({":message-type": "event", ":event-type": "metadata"}, b"{}") == b""
    with pytest.raises(Unanswered, match="ThrottlingException"):
        sse_event({":message-type": "error", ":error-code": "ThrottlingException"}, b"")


async def test_count_tokens_counts_free(bedrock: BedrockUpstream, http: httpx.Client) -> None:
    content = json.dumps({"model": US_SONNET,
                          "messages": [{"role": "user", "content": "hello"}]}).encode()
    sent = await bedrock.count(Api.MESSAGES, content, ())
    assert (sent[0], sent[2]) == (200, json.dumps({"input_tokens": HELLO_TOKENS}).encode())
    bill = bill_of(http)
    assert [(c.api, c.billed) for c in bill.log] == [("bedrock.count_tokens", False)]


async def test_a_count_to_nowhere_is_unanswered() -> None:
    upstream = BedrockUpstream(definition(closed_port_url()), 10.0)
    try:
        with pytest.raises(Unanswered):
            await upstream.count(Api.MESSAGES, b'{"model": "m", "messages": []}', ())
    finally:
        await upstream.aclose()


@pytest.mark.parametrize(("status", "raised"), [(403, "PermissionDeniedError"),
                                                (429, "RateLimitError"),
                                                (503, "ServiceUnavailableError")])
async def test_the_anthropic_sdk_raises_a_translated_error_as_anthropics(
        bedrock: BedrockUpstream, http: httpx.Client, status: int, raised: str) -> None:
    import anthropic
    import httpx2

    start_fresh(http, {"fail_status": status})
    sent = await bedrock.send(messages(), deadline())
    assert isinstance(sent[2], bytes)
    body = sent[2]

    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(status, content=body, headers={"content-type": "application/json"})

    client = anthropic.Anthropic(api_key="x", base_url="http://stub.invalid", max_retries=0,
                                 http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))
    with pytest.raises(anthropic.APIStatusError) as failed:
        client.messages.create(model="claude-sonnet-4-5", max_tokens=10,
                               messages=[{"role": "user", "content": "hello"}])
    assert type(failed.value).__name__ == raised
    assert failed.value.status_code == status


def test_an_error_of_no_known_shape_still_gets_anthropics() -> None:
    anthropics: Sent = (400, {}, b'{"type": "error", "error": {"type": "x", "message": "m"}}')
    assert error_as_anthropic(anthropics) is anthropics
    for body, message in ((b"<html>bad gateway</html>", "<html>bad gateway</html>"),
                          (b"", "the provider answered 502"),
                          (b'{"Message": "from a proxy"}', "from a proxy")):
        translated = error_as_anthropic((502, {"x-amzn-requestid": "r"}, body))
        assert isinstance(translated[2], bytes)
        assert json.loads(translated[2]) == {"type": "error", "error": {
            "type": "api_error", "message": message}}
        assert translated[1]["content-type"] == "application/json"


async def test_an_arn_is_sent_escaped_and_signed_as_sent(bedrock: BedrockUpstream,
                                                          http: httpx.Client) -> None:
    arn = f"arn:aws:bedrock:{REGION}:123456789012:inference-profile/{GLOBAL_SONNET}"
    sent = await bedrock.send(messages(arn, output_tokens=1), deadline())
    assert sent[0] == 200, sent[2]
    call = only_call(http)
    assert (call.model, call.model_requested) == (GLOBAL_SONNET, arn)
