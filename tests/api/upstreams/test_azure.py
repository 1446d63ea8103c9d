"""The Azure upstream (api/upstreams/azure.py) against the stub's Azure OpenAI v1 routes, which
take the key in `api-key` and bill a deployment as the model /control maps it to: each call is
judged by the stub's bill, read as the gateway's chat and Responses formats read OpenAI's."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace

import httpx
import pytest

from api.upstreams.azure import AzureUpstream
from core.formats import Api, Plan
from core.gateway_request import plan
from core.upstream import NotSent, Unanswered
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

KEY = "azure-stub-key"
DEPLOYMENTS = {"prod-4o": "gpt-4o"}
HELLO_TOKENS = 9
# 9 x $2.50 + 10 x $10 a million = 122.5 micro-dollars, rounded up once.
HELLO_COST_MICROS = 123


@pytest.fixture(scope="module")
def provider() -> Iterator[StubProvider]:
    with StubProvider(seed=38, latency_ms_min=0, latency_ms_max=2, api_key=KEY) as stub:
        yield stub


def definition(base_url: str, key: str = KEY) -> UpstreamDef:
    return UpstreamDef(name="azure-east", api="azure", base_url=base_url,
                       prices_provider="azure", priced={"prod-4o": "gpt-4o"}, api_key=key)


@pytest.fixture
async def azure(provider: StubProvider) -> AsyncIterator[AzureUpstream]:
    upstream = AzureUpstream(definition(f"{provider.url}/openai/v1"), timeout_s=10.0)
    yield upstream
    await upstream.aclose()


@pytest.fixture(autouse=True)
def fresh_bill(http: httpx.Client) -> None:
    start_fresh(http, {"deployments": DEPLOYMENTS})


def chat(*, stream: bool = False, deployment: str = "prod-4o") -> Plan:
    raw = json.dumps({"model": deployment, "max_tokens": 100, "stream": stream,
                      "messages": [{"role": "user", "content": "hello"}]}).encode()
    return forced(plan(Api.CHAT, raw))


def responses(*, stream: bool = False) -> Plan:
    raw = json.dumps({"model": "prod-4o", "max_output_tokens": 100, "stream": stream,
                      "input": "hello"}).encode()
    return forced(plan(Api.RESPONSES, raw))


def forced(call_plan: Plan) -> Plan:
    return replace(call_plan, headers=(*call_plan.headers, ("X-Stub-Output-Tokens", "10")))


@pytest.mark.parametrize("make", [chat, responses])
async def test_an_answer_settles_to_the_bill(azure: AzureUpstream, http: httpx.Client,
                                             make: Callable[..., Plan]) -> None:
    call_plan = make()
    sent = await azure.send(call_plan, deadline())
    assert sent[0] == 200
    call = only_call(http)
    assert (call.model, call.model_requested, call.billed) == ("gpt-4o", "prod-4o", True)
    assert same_tokens(answer_usage(call_plan, sent[2]), call)
    assert "apim-request-id" in sent[1]
    assert "x-ms-region" in sent[1]


@pytest.mark.parametrize("make", [chat, responses])
async def test_a_stream_tallies_to_the_bill(azure: AzureUpstream, http: httpx.Client,
                                            make: Callable[..., Plan]) -> None:
    call_plan = make(stream=True)
    sent = await azure.send(call_plan, deadline())
    assert sent[0] == 200
    tally = tallied(call_plan, await streamed(sent))
    call = only_call(http)
    assert (call.stream, call.billed) == (True, True)
    assert tally.finished
    assert same_tokens(tally.usage, call)


async def test_the_hello_call_costs_what_the_deployments_model_does(
        azure: AzureUpstream, http: httpx.Client) -> None:
    await azure.send(chat(), deadline())
    assert only_call(http).cost_micros == HELLO_COST_MICROS


async def test_a_wrong_key_is_refused_401_unbilled(provider: StubProvider,
                                                   http: httpx.Client) -> None:
    upstream = AzureUpstream(definition(f"{provider.url}/openai/v1", key="wrong"), 10.0)
    try:
        sent = await upstream.send(chat(), deadline())
    finally:
        await upstream.aclose()
    assert sent[0] == 401
    assert bill_of(http).total.calls == 0


async def test_an_unknown_deployment_is_404_unbilled(azure: AzureUpstream,
                                                     http: httpx.Client) -> None:
    sent = await azure.send(chat(deployment="nowhere"), deadline())
    assert sent[0] == 404
    assert isinstance(sent[2], bytes)
    assert json.loads(sent[2])["error"]["code"] == "DeploymentNotFound"
    assert bill_of(http).total.calls == 0


async def test_a_refused_connection_is_not_sent() -> None:
    upstream = AzureUpstream(definition(closed_port_url() + "/openai/v1"), 10.0)
    try:
        with pytest.raises(NotSent):
            await upstream.send(chat(), deadline())
    finally:
        await upstream.aclose()


async def test_a_hang_is_unanswered(azure: AzureUpstream, http: httpx.Client) -> None:
    start_fresh(http, {"deployments": DEPLOYMENTS, "hang": True})
    with pytest.raises(Unanswered):
        await azure.send(chat(), deadline(HANG_TIMEOUT_S))


async def test_a_stream_broken_off_is_unanswered(azure: AzureUpstream,
                                                 http: httpx.Client) -> None:
    start_fresh(http, {"deployments": DEPLOYMENTS, "break_after_events": 2})
    sent = await azure.send(chat(stream=True), deadline())
    with pytest.raises(Unanswered):
        await streamed(sent)
    assert only_call(http).billed
