"""The Vertex upstream (api/upstreams/vertex.py) against the stub's Vertex AI, which issues OAuth
tokens to its service account (google-auth's JWT-bearer grant, verified) and refuses any other
token 401: Gemini and Claude calls, each judged by the stub's bill. Claude's answers are read as
the gateway's Messages format reads Anthropic's; Gemini's by their usageMetadata (the Gemini
format is not in core/formats yet: its calls are planned here by hand)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from api.upstreams.vertex import VertexUpstream, endpoint
from core.formats import FORMATS, Api, Plan
from core.gateway_request import plan, routed
from core.upstream import NotSent, Sent, Unanswered
from core.upstreams import ModelNotRouted, Routed, UpstreamDef, parse
from infra.stub_provider import StubProvider
from tests.api.upstreams.conftest import (
    HANG_TIMEOUT_S,
    answer_usage,
    bill_of,
    closed_port_url,
    deadline,
    gemini_plan,
    gemini_usage_is_billed,
    only_call,
    same_tokens,
    start_fresh,
    streamed,
    tallied,
)

PROJECT, REGION = "stub-project", "us-east5"
FLASH = "gemini-2.5-flash"
CLAUDE = "claude-sonnet-4-5@20250929"
HELLO_TOKENS = 9
FORCED = (("X-Stub-Output-Tokens", "10"),)


@pytest.fixture(scope="module")
def service_account(provider: StubProvider, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stub's service account's JSON key, its token_uri the stub's /token."""
    path = tmp_path_factory.mktemp("vertex") / "service-account.json"
    path.write_text(httpx.get(f"{provider.url}/vertex/service_account").text)
    return path


def definition(base_url: str, credentials_file: Path, region: str = REGION) -> UpstreamDef:
    return UpstreamDef(name="vertex-east", api="vertex", base_url=base_url,
                       prices_provider="google", priced={FLASH: FLASH, CLAUDE: CLAUDE},
                       project=PROJECT, region=region, credentials_file=str(credentials_file))


@pytest.fixture
async def vertex(provider: StubProvider, service_account: Path) -> AsyncIterator[VertexUpstream]:
    upstream = VertexUpstream(definition(provider.url, service_account), timeout_s=10.0)
    yield upstream
    await upstream.aclose()


@pytest.fixture(autouse=True)
def fresh_bill(http: httpx.Client) -> None:
    start_fresh(http, {"clock_offset_s": 0})


def gemini(*, stream: bool = False) -> Plan:
    return gemini_plan(FLASH, stream=stream)


def claude(*, stream: bool = False) -> Plan:
    raw = json.dumps({"model": CLAUDE, "max_tokens": 100, "stream": stream,
                      "messages": [{"role": "user", "content": "hello"}]}).encode()
    forwarded = (("anthropic-version", "2023-06-01"),)
    return replace(plan(Api.MESSAGES, raw, headers=forwarded), headers=(*forwarded, *FORCED))


def test_the_endpoint_is_the_regions_or_the_global_one(service_account: Path) -> None:
    assert endpoint(definition("", service_account)) == "https://us-east5-aiplatform.googleapis.com"
    assert endpoint(definition("", service_account, "global")) == (
        "https://aiplatform.googleapis.com")


def test_each_model_is_routed_on_its_publishers_route_only(service_account: Path) -> None:
    """Claude is Anthropic's publisher path's (the Messages route), Gemini Google's: a model
    named on the other route is refused before anything is held, naming the route that serves
    it (core/upstream_kinds/vertex.py route_of)."""
    upstreams = parse({"upstreams": [{
        "name": "vertex", "api": "vertex", "project": "p", "region": "global",
        "credentials_file": str(service_account),
        "models": ["claude-opus-5-5", "claude-sonnet-4-5@20250929", "gemini-2.5-flash"]}]}, {})
    for model, route in (("claude-opus-5-5", "messages"), ("gemini-2.5-flash", "gemini"),
                         ("vertex/claude-sonnet-4-5@20250929", "messages")):
        assert upstreams.resolve(model, route).upstream.name == "vertex"
    for model, route, served_on in (("gemini-2.5-flash", "messages", "gemini"),
                                    ("vertex/gemini-2.5-flash", "messages", "gemini"),
                                    ("claude-opus-5-5", "gemini", "messages")):
        with pytest.raises(ModelNotRouted, match=f"on the {served_on} route, not {route}"):
            upstreams.resolve(model, route)


async def test_gemini_answers_its_usage_as_billed(vertex: VertexUpstream,
                                                  http: httpx.Client) -> None:
    sent = await vertex.send(gemini(), deadline())
    assert sent[0] == 200
    assert isinstance(sent[2], bytes)
    usage = json.loads(sent[2])["usageMetadata"]
    call = only_call(http)
    assert (call.api, call.model, call.billed) == ("vertex.gemini", FLASH, True)
    assert gemini_usage_is_billed(usage, call)
    assert (usage["promptTokenCount"], usage["candidatesTokenCount"]) == (HELLO_TOKENS, 10)


async def test_a_gemini_stream_ends_on_the_billed_usage(vertex: VertexUpstream,
                                                        http: httpx.Client) -> None:
    sent = await vertex.send(gemini(stream=True), deadline())
    assert sent[0] == 200
    raw = await streamed(sent)
    chunks = [json.loads(line[len(b"data: "):]) for line in raw.split(b"\n")
              if line.startswith(b"data: ")]
    call = only_call(http)
    assert call.stream
    assert gemini_usage_is_billed(chunks[-1]["usageMetadata"], call)


async def test_claude_answers_what_the_messages_format_settles(vertex: VertexUpstream,
                                                               http: httpx.Client) -> None:
    call_plan = claude()
    sent = await vertex.send(call_plan, deadline())
    assert sent[0] == 200
    call = only_call(http)
    assert (call.api, call.stream) == ("vertex.messages", False)
    assert same_tokens(answer_usage(call_plan, sent[2]), call)
    # Sonnet 4.5 at a regional endpoint: 10% above 9 x 3 + 10 x 15 = 177: 194.7 -> 195.
    assert call.cost_micros == 195


async def test_a_claude_stream_tallies_to_the_bill(vertex: VertexUpstream,
                                                   http: httpx.Client) -> None:
    call_plan = claude(stream=True)
    sent = await vertex.send(call_plan, deadline())
    assert sent[0] == 200
    tally = tallied(call_plan, await streamed(sent))
    call = only_call(http)
    assert tally.finished
    assert same_tokens(tally.usage, call)
    assert call.stream


async def test_a_refused_token_is_401_unbilled_and_dropped(vertex: VertexUpstream,
                                                           http: httpx.Client) -> None:
    assert (await vertex.send(claude(), deadline()))[0] == 200
    start_fresh(http, {"clock_offset_s": 3_601})  # the token's hour has passed, for the stub
    refused = await vertex.send(gemini(), deadline())
    assert refused[0] == 401
    assert isinstance(refused[2], bytes)
    assert json.loads(refused[2])["error"]["status"] == "UNAUTHENTICATED"  # Google's shape
    assert bill_of(http).total.calls == 0
    assert (await vertex.send(gemini(), deadline()))[0] == 200  # a new token
    start_fresh(http, {"clock_offset_s": 7_202})  # and its hour too
    refused = await vertex.send(claude(), deadline())
    assert refused[0] == 401
    assert isinstance(refused[2], bytes)
    assert json.loads(refused[2])["error"]["type"] == "authentication_error"  # Anthropic's
    assert bill_of(http).total.calls == 0


@pytest.fixture
def forged_account(service_account: Path, tmp_path: Path) -> Path:
    """The service account's JSON with another private key: its assertions do not verify."""
    key = rsa.generate_private_key(public_exponent=65_537, key_size=2_048)
    forged = {**json.loads(service_account.read_text()), "private_key": key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()).decode()}
    path = tmp_path / "forged.json"
    path.write_text(json.dumps(forged))
    return path


async def test_a_service_account_the_token_endpoint_refuses_is_not_sent(
        provider: StubProvider, forged_account: Path, http: httpx.Client) -> None:
    path = forged_account
    upstream = VertexUpstream(definition(provider.url, path), 10.0)
    try:
        with pytest.raises(NotSent, match="Invalid JWT Signature"):
            await upstream.send(claude(), deadline())
    finally:
        await upstream.aclose()
    assert not bill_of(http).log


async def test_a_refused_connection_is_not_sent(service_account: Path) -> None:
    upstream = VertexUpstream(definition(closed_port_url(), service_account), 10.0)
    try:
        for make in (claude, gemini):
            with pytest.raises(NotSent):
                await upstream.send(make(), deadline())
    finally:
        await upstream.aclose()


async def test_a_hang_is_unanswered(vertex: VertexUpstream, http: httpx.Client) -> None:
    await vertex.token()  # the token is had before the stub hangs
    start_fresh(http, {"hang": True})
    with pytest.raises(Unanswered):
        await vertex.send(gemini(), deadline(HANG_TIMEOUT_S))


@pytest.mark.parametrize("make", [claude, gemini])
async def test_a_stream_broken_off_is_unanswered(vertex: VertexUpstream, http: httpx.Client,
                                                 make: Any) -> None:
    start_fresh(http, {"break_after_events": 2})
    sent: Sent = await vertex.send(make(stream=True), deadline())
    assert sent[0] == 200
    with pytest.raises(Unanswered):
        await streamed(sent)
    assert only_call(http).billed


async def test_gemini_counts_free(vertex: VertexUpstream, http: httpx.Client) -> None:
    content = json.dumps({"contents": [{"role": "user", "parts": [{"text": "hello"}]}]})
    sent = await vertex.count_gemini(FLASH, content.encode())
    assert sent[0] == 200
    assert isinstance(sent[2], bytes)
    assert json.loads(sent[2])["totalTokens"] == HELLO_TOKENS
    assert [c.billed for c in bill_of(http).log] == [False]


async def test_calls_waiting_for_a_token_share_one_refresh(
        provider: StubProvider, service_account: Path, monkeypatch: pytest.MonkeyPatch,
        http: httpx.Client) -> None:
    upstream = VertexUpstream(definition(provider.url, service_account), 10.0)
    refreshes = []
    refresh = upstream._refresh

    def counted() -> None:
        refreshes.append(1)
        refresh()

    monkeypatch.setattr(upstream, "_refresh", counted)
    try:
        sent = await asyncio.gather(*(upstream.send(gemini(), deadline()) for _ in range(5)))
    finally:
        await upstream.aclose()
    assert [s[0] for s in sent] == [200] * 5
    assert len(refreshes) == 1
    assert bill_of(http).total.calls == 5


@pytest.mark.parametrize("api", [Api.GEMINI, Api.MESSAGES])
async def test_the_url_names_the_model_as_sent_not_as_priced(
        vertex: VertexUpstream, service_account: Path, http: httpx.Client, api: Api) -> None:
    """A routed call is priced by one name (Routed.price_model: regional Vertex Claude as
    `regional.<dated name>`) and sent by another (Routed.sent_model): Vertex's path names the
    model it knows, whatever the call is priced as."""
    model = FLASH if api is Api.GEMINI else CLAUDE
    to = Routed(definition(vertex.base_url, service_account), model, model, f"regional.{model}")
    body: dict[str, Any] = (
        {"model": model, "max_tokens": 100, "messages": [{"role": "user", "content": "hello"}]}
        if api is Api.MESSAGES else {**gemini().body, "generationConfig": {
            "maxOutputTokens": 100, "thinkingConfig": {"thinkingBudget": 0}}})
    call_plan = routed(FORMATS[api], body, to, (("anthropic-version", "2023-06-01"),), 100,
                       frozenset())
    assert call_plan.model == f"regional.{model}"
    sent = await vertex.send(replace(call_plan, headers=(*call_plan.headers, *FORCED)),
                             deadline())
    assert sent[0] == 200, sent[2]
    assert only_call(http).model in (model, model.replace("@", "-"))


@pytest.mark.parametrize(("extra", "headers", "words"), [
    ({}, {"anthropic-beta": "prompt-caching-scope-2026-01-05"}, "Unexpected value(s)"),
    ({}, {"anthropic-beta": "advanced-tool-use-2025-11-20"}, "Unexpected value(s)"),
    ({"anthropic_beta": ["context-1m-2025-08-07"]}, {}, "anthropic_beta"),
    ({"speed": "fast"}, {}, "speed"),
    ({"model": CLAUDE}, {}, "model"),
    ({"tools": [{"type": "web_fetch_20250910", "name": "web_fetch"}]}, {}, "web fetch"),
])
async def test_the_stub_refuses_what_vertex_refuses_unbilled(
        vertex: VertexUpstream, http: httpx.Client, extra: dict[str, Any],
        headers: dict[str, str], words: str) -> None:
    """The witness: betas Vertex does not take (Anthropic's names of them included), the
    betas in the body, fields of Anthropic's own API, a body `model`, server tools Vertex does
    not run: each refused 400, nothing billed; counts are served, free."""
    url = f"{vertex.publishers_url}/anthropic/models/{CLAUDE}:rawPredict"
    auth = {"authorization": f"Bearer {await vertex.token()}"}
    body = {"anthropic_version": "vertex-2023-10-16", "max_tokens": 10,
            "messages": [{"role": "user", "content": "hello"}], **extra}
    async with httpx.AsyncClient() as client:
        answer = await client.post(url, json=body, headers={**auth, **headers})
        counted = await client.post(
            url.replace(f"{CLAUDE}:rawPredict", "count-tokens:rawPredict"),
            json={"model": CLAUDE, "messages": body["messages"]}, headers=auth)
    assert answer.status_code == 400, answer.text
    assert words in answer.json()["error"]["message"]
    assert counted.json() == {"input_tokens": HELLO_TOKENS}
    assert [(c.status, c.billed) for c in bill_of(http).log] == [(400, False), (200, False)]
