"""CEILING_UPSTREAMS end to end: a gateway whose models resolve to named upstreams (an
OpenAI-compatible router, Azure OpenAI, Claude on Bedrock and on Vertex), every one of them the
stub provider, reached through the real `openai` and `anthropic` SDKs.

The stub's bill is the witness: each call's charge is compared with what the stub billed for it,
to the micro-dollar. The attacks come first: a model no upstream names, a name two upstreams
serve, a budget too small; each is refused before the stub sees anything.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from core.ledger import Upstream
from core.stores.redis import RedisStore
from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from infra.stub_provider import StubProvider, fetch_bill, reset_bill, stub_control
from tests.api.conftest import (
    ADMIN_TOKEN,
    Client,
    account,
    anthropic_sdk,
    as_key,
    header,
    ledger,
    sdk,
    settled,
    trailer,
)
from tests.support import write_prices

AZURE_KEY = "azure-stub-key"
ACCESS_KEY, SECRET_KEY, REGION = "AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMIEXAMPLEKEY", "us-east-1"
US_SONNET = "us.anthropic.claude-sonnet-4-5-20250929-v1:0"
GLOBAL_HAIKU = "global.anthropic.claude-haiku-4-5-20251001-v1:0"
VERTEX_SONNET, VERTEX_HAIKU = "claude-sonnet-4-5@20250929", "claude-haiku-4-5@20251001"
# Claude Haiku 4.5 at a regional Vertex endpoint: Anthropic's rates and 10% (the operator's
# prices file names it, or the gateway refuses it: core/upstreams.py price_key).
REGIONAL_HAIKU_PRICES = {"input_usd_per_mtok": "1.10", "output_usd_per_mtok": "5.50",
                         "cached_input_usd_per_mtok": "0.11", "cache_write_usd_per_mtok": "1.375"}
HELLO: list[Any] = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def stub() -> Iterator[StubProvider]:
    with StubProvider(seed=41, latency_ms_min=0, latency_ms_max=2, output_tokens_mean=60,
                      api_key=AZURE_KEY) as provider:
        yield provider


def upstreams_file(stub: StubProvider, directory: Path) -> Path:
    account_file = directory / "service-account.json"
    account_file.write_text(httpx.get(f"{stub.url}/vertex/service_account").text)
    vertex = {"api": "vertex", "base_url": stub.url, "project": "stub-project",
              "credentials_file": str(account_file)}
    doc = {"upstreams": [
        {"name": "router", "api": "openai", "base_url": f"{stub.url}/v1",
         "api_key_env": "ROUTER_KEY", "models": ["gpt-4o-mini", "text-embedding-3-small"]},
        {"name": "router2", "api": "openai", "base_url": f"{stub.url}/v1",
         "api_key_env": "ROUTER_KEY", "models": ["gpt-4o-mini"]},
        {"name": "azure-east", "api": "azure", "base_url": f"{stub.url}/openai/v1",
         "api_key_env": "AZURE_KEY",
         "deployments": {"prod-4o": "gpt-4o", "prod-embed": "text-embedding-3-large"}},
        {"name": "bedrock", "api": "bedrock", "region": REGION, "base_url": stub.url,
         "model_ids": {"claude-sonnet-4-5": US_SONNET, "claude-haiku-4-5": GLOBAL_HAIKU}},
        {"name": "vertex", **vertex, "region": "global", "models": [VERTEX_SONNET]},
        {"name": "vertex-east", **vertex, "region": "us-east5",
         "models": [VERTEX_HAIKU, VERTEX_SONNET]},
    ]}
    path = directory / "upstreams.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.fixture(scope="module")
def gw(redis_server: RedisServer, stub: StubProvider,
       tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    directory = tmp_path_factory.mktemp("gateway_upstreams")
    prices = write_prices(tmp_path_factory, "gateway_upstreams_prices", {"models": {
        "regional.claude-haiku-4-5-20251001": REGIONAL_HAIKU_PRICES}})
    with ServiceProcess({
        "REDIS_URL": redis_server.url, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN,
        "CEILING_UPSTREAM_TIMEOUT_S": "30", "CEILING_PRICES_FILE": prices,
        "CEILING_UPSTREAMS": str(upstreams_file(stub, directory)),
        "ROUTER_KEY": AZURE_KEY, "AZURE_KEY": AZURE_KEY,
        "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
    }) as service:
        yield service


@pytest.fixture(autouse=True)
def fresh_bill(stub: StubProvider) -> None:
    stub_control(stub.url, {"clock_offset_s": 0, "deployments": {
        "prod-4o": "gpt-4o", "prod-embed": "text-embedding-3-large"},
                            "bedrock_credentials": {"access_key_id": ACCESS_KEY,
                                                    "secret_access_key": SECRET_KEY,
                                                    "region": REGION}})
    reset_bill(stub.url)


def costs(stub: StubProvider) -> list[int]:
    return [c.cost_micros for c in fetch_bill(stub.url).log]


def nothing_reached(stub: StubProvider) -> None:
    assert list(fetch_bill(stub.url).log) == []


# -- attacks: nothing held, nothing forwarded ------------------------------------------------


@pytest.mark.parametrize("model", ["gpt-5", "router/claude-sonnet-4-5", "nobody/gpt-4o-mini",
                                   "bedrock/gpt-4o"])
def test_a_model_no_upstream_names_is_refused_and_forwarded_nowhere(
        gw: ServiceProcess, admin: Client, stub: StubProvider, model: str) -> None:
    tag, key = account(admin, 1_000_000)
    r = admin.post("/v1/chat/completions", headers=as_key(key), json={
        "model": model, "max_tokens": 50, "messages": HELLO})
    assert (r.status_code, r.json()["error"]["code"]) == (400, "model_not_routed"), r.text
    nothing_reached(stub)
    assert (ledger(admin, tag)["committed_micros"], ledger(admin, tag)["reserved_micros"]) == (
        0, 0)


def test_an_unrouted_model_is_refused_in_anthropics_shape(
        gw: ServiceProcess, admin: Client, stub: StubProvider) -> None:
    _, key = account(admin, 1_000_000)
    with pytest.raises(anthropic.BadRequestError) as refused:
        anthropic_sdk(gw, key).messages.create(model="claude-opus-9", max_tokens=50,
                                               messages=HELLO)
    assert refused.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "claude-opus-9" in refused.value.message
    nothing_reached(stub)


def test_a_model_on_a_route_its_upstream_does_not_serve_is_refused(
        gw: ServiceProcess, admin: Client, stub: StubProvider) -> None:
    _, key = account(admin, 1_000_000)
    with pytest.raises(anthropic.BadRequestError) as refused:
        anthropic_sdk(gw, key).messages.create(model="prod-4o", max_tokens=50, messages=HELLO)
    assert "azure" in refused.value.message
    nothing_reached(stub)


def test_a_name_two_upstreams_serve_is_refused_until_the_call_names_one(
        gw: ServiceProcess, admin: Client, stub: StubProvider) -> None:
    tag, key = account(admin, 1_000_000)
    with pytest.raises(openai.BadRequestError) as refused:
        sdk(gw, key).chat.completions.create(model="gpt-4o-mini", max_tokens=50,
                                             messages=HELLO)
    assert "router/gpt-4o-mini" in refused.value.message
    nothing_reached(stub)
    raw = sdk(gw, key).chat.completions.with_raw_response.create(
        model="router2/gpt-4o-mini", max_tokens=50, messages=HELLO)
    [cost] = costs(stub)
    assert header(raw, "x-ceiling-charged-micros") == cost > 0
    assert fetch_bill(stub.url).log[0].model == "gpt-4o-mini"  # sent without the prefix
    assert ledger(admin, tag)["committed_micros"] == cost


def test_a_budget_too_small_is_refused_before_the_upstream_sees_anything(
        gw: ServiceProcess, admin: Client, stub: StubProvider) -> None:
    _, key = account(admin, 50)
    with pytest.raises(anthropic.APIStatusError) as refused:
        anthropic_sdk(gw, key).messages.create(model="claude-sonnet-4-5", max_tokens=1_000,
                                               messages=HELLO)
    assert refused.value.status_code == 402
    with pytest.raises(openai.APIStatusError) as refused_openai:
        sdk(gw, key).chat.completions.create(model="prod-4o", max_tokens=1_000,
                                             messages=HELLO)
    assert refused_openai.value.status_code == 402
    nothing_reached(stub)


def test_regional_vertex_claude_the_prices_file_does_not_price_is_refused(
        gw: ServiceProcess, admin: Client, stub: StubProvider) -> None:
    """Sonnet 4.5 at a regional endpoint is billed 10% above the global rate Google's table
    has: unless the prices file names it (as it does Haiku here), it is refused, not under-held."""
    tag, key = account(admin, 1_000_000)
    r = admin.post("/v1/messages", headers=as_key(key), json={
        "model": f"vertex-east/{VERTEX_SONNET}", "max_tokens": 50, "messages": HELLO})
    assert (r.status_code, r.json()["error"]["type"]) == (422, "invalid_request_error"), r.text
    assert "regional.claude-sonnet-4-5-20250929" in r.json()["error"]["message"]
    nothing_reached(stub)
    assert ledger(admin, tag)["reserved_micros"] == 0


# -- each cloud through its SDK: the ledger is the stub's bill ----------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_claude_on_bedrock_through_the_anthropic_sdk_is_charged_the_bill(
        gw: ServiceProcess, admin: Client, stub: StubProvider, stream: bool) -> None:
    tag, key = account(admin, 1_000_000)
    client = anthropic_sdk(gw, key)
    if stream:
        with client.messages.with_streaming_response.create(
                model="claude-sonnet-4-5", max_tokens=300, messages=HELLO, stream=True) as raw:
            text = raw.read().decode()
        charged = int(trailer(text)["x-ceiling-charged-micros"])
    else:
        answer = client.messages.with_raw_response.create(
            model="claude-sonnet-4-5", max_tokens=300, messages=HELLO)
        assert answer.parse().usage.output_tokens > 0
        charged = header(answer, "x-ceiling-charged-micros")
    [call] = fetch_bill(stub.url).log
    assert call.cost_micros == charged > 0
    assert settled(admin, tag)["committed_micros"] == call.cost_micros
    # The stub bills the geographic profile as its base id, at the regional rate ($3.30/
    # $16.50), 10% above the global one: a charge equal to its bill is the regional price.
    assert call.model == US_SONNET.removeprefix("us.")


def test_the_prefix_form_reaches_bedrock_at_the_global_rate(
        gw: ServiceProcess, admin: Client, stub: StubProvider) -> None:
    tag, key = account(admin, 1_000_000)
    answer = anthropic_sdk(gw, key).messages.with_raw_response.create(
        model="bedrock/claude-haiku-4-5", max_tokens=300, messages=HELLO)
    [call] = fetch_bill(stub.url).log
    assert call.api.startswith("bedrock")
    assert header(answer, "x-ceiling-charged-micros") == call.cost_micros > 0
    assert call.model == GLOBAL_HAIKU
    assert ledger(admin, tag)["committed_micros"] == call.cost_micros


@pytest.mark.parametrize("stream", [False, True])
def test_an_azure_deployment_through_chat_and_responses_is_charged_the_bill(
        gw: ServiceProcess, admin: Client, stub: StubProvider, stream: bool) -> None:
    tag, key = account(admin, 1_000_000)
    client = sdk(gw, key)
    if stream:
        with client.chat.completions.with_streaming_response.create(
                model="prod-4o", max_tokens=200, messages=HELLO, stream=True,
                stream_options={"include_usage": True}) as raw:
            chat_charged = int(trailer(raw.read().decode())["x-ceiling-charged-micros"])
        with client.responses.with_streaming_response.create(
                model="prod-4o", max_output_tokens=200, input="hello", stream=True) as raw:
            responses_charged = int(trailer(raw.read().decode())["x-ceiling-charged-micros"])
    else:
        chat = client.chat.completions.with_raw_response.create(
            model="prod-4o", max_tokens=200, messages=HELLO)
        responses = client.responses.with_raw_response.create(
            model="prod-4o", max_output_tokens=200, input="hello")
        chat_charged = header(chat, "x-ceiling-charged-micros")
        responses_charged = header(responses, "x-ceiling-charged-micros")
    bill = fetch_bill(stub.url).log
    assert [c.model for c in bill] == ["gpt-4o", "gpt-4o"]
    assert [c.cost_micros for c in bill] == [chat_charged, responses_charged]
    assert settled(admin, tag)["committed_micros"] == chat_charged + responses_charged > 0


@pytest.mark.parametrize(("model", "stream"), [
    (f"vertex/{VERTEX_SONNET}", False), (f"vertex/{VERTEX_SONNET}", True), (VERTEX_HAIKU, False),
    (VERTEX_HAIKU, True)])
def test_claude_on_vertex_through_the_anthropic_sdk_is_charged_the_bill(
        gw: ServiceProcess, admin: Client, stub: StubProvider, model: str,
        stream: bool) -> None:
    tag, key = account(admin, 1_000_000)
    client = anthropic_sdk(gw, key)
    if stream:
        with client.messages.with_streaming_response.create(
                model=model, max_tokens=300, messages=HELLO, stream=True) as raw:
            charged = int(trailer(raw.read().decode())["x-ceiling-charged-micros"])
    else:
        answer = client.messages.with_raw_response.create(model=model, max_tokens=300,
                                                          messages=HELLO)
        assert answer.parse().usage.output_tokens > 0
        charged = header(answer, "x-ceiling-charged-micros")
    [call] = fetch_bill(stub.url).log
    assert call.cost_micros == charged > 0
    assert settled(admin, tag)["committed_micros"] == call.cost_micros


def test_a_token_count_goes_to_the_models_upstream_and_holds_nothing(
        gw: ServiceProcess, admin: Client, stub: StubProvider) -> None:
    tag, key = account(admin, 1_000_000)
    counted = anthropic_sdk(gw, key).messages.count_tokens(model="claude-sonnet-4-5",
                                                           messages=HELLO)
    assert counted.input_tokens > 0
    assert not any(c.billed for c in fetch_bill(stub.url).log)
    assert (ledger(admin, tag)["committed_micros"], ledger(admin, tag)["reserved_micros"]) == (
        0, 0)
    with pytest.raises(anthropic.BadRequestError):
        anthropic_sdk(gw, key).messages.count_tokens(model="gpt-4o", messages=HELLO)


def test_a_retry_with_the_same_key_names_the_same_upstream_or_conflicts(
        gw: ServiceProcess, admin: Client, stub: StubProvider) -> None:
    """`router/m` and `router2/m` send the same body to two upstreams: one Idempotency-Key
    cannot stand for both."""
    _, key = account(admin, 1_000_000)
    headers = {**as_key(key), "Idempotency-Key": "routed-once"}
    body = {"max_tokens": 50, "messages": HELLO}
    first = admin.post("/v1/chat/completions", headers=headers,
                       json={"model": "router/gpt-4o-mini", **body})
    again = admin.post("/v1/chat/completions", headers=headers,
                       json={"model": "router/gpt-4o-mini", **body})
    other = admin.post("/v1/chat/completions", headers=headers,
                       json={"model": "router2/gpt-4o-mini", **body})
    assert (first.status_code, again.status_code) == (200, 200)
    assert again.headers["x-ceiling-replayed"] == "true"
    assert (other.status_code, other.json()["error"]["code"]) == (409, "idempotency_conflict")
    assert len(fetch_bill(stub.url).log) == 1


@pytest.mark.parametrize(("model", "billed_as"), [("text-embedding-3-small",
                                                  "text-embedding-3-small"),
                                                 ("prod-embed", "text-embedding-3-large")])
def test_embeddings_go_to_the_upstream_that_names_the_model_and_are_charged_the_bill(
        gw: ServiceProcess, admin: Client, stub: StubProvider, model: str,
        billed_as: str) -> None:
    tag, key = account(admin, 1_000_000)
    answer = sdk(gw, key).embeddings.with_raw_response.create(
        model=model, input=["hello", "a second, longer input to embed"])
    charged = header(answer, "x-ceiling-charged-micros")
    bill = fetch_bill(stub.url).log
    assert [c.model for c in bill] == [billed_as]
    assert [c.cost_micros for c in bill] == [charged]
    assert settled(admin, tag)["committed_micros"] == charged > 0


def day_spend(redis_server: RedisServer) -> dict[Upstream, int]:
    """What each bill's day counter holds today (UTC): what reconciliation compares."""

    async def read() -> dict[Upstream, int]:
        store = RedisStore(redis_server.url)
        today = datetime.now(UTC).date()
        try:
            return {u: (await store.gateway_spend_by_day(u, today, today)).get(today, 0)
                    for u in Upstream}
        finally:
            await store.close()

    return asyncio.run(read())


def test_a_routed_call_is_counted_on_its_upstreams_own_bill_not_the_routes_provider(
        gw: ServiceProcess, admin: Client, stub: StubProvider,
        redis_server: RedisServer) -> None:
    """Bedrock's spend counted as Anthropic's would pass for Anthropic's own in reconciliation
    and hide spend made with Anthropic's key directly; each cloud's is its own."""
    _, key = account(admin, 1_000_000)
    before = day_spend(redis_server)
    anthropic_sdk(gw, key).messages.create(model="claude-sonnet-4-5", max_tokens=50,
                                           messages=HELLO)
    sdk(gw, key).chat.completions.create(model="prod-4o", max_tokens=50, messages=HELLO)
    bedrock_cost, azure_cost = costs(stub)
    after = day_spend(redis_server)
    grew = {u: after[u] - before[u] for u in Upstream if after[u] != before[u]}
    assert grew == {Upstream.AWS: bedrock_cost, Upstream.AZURE: azure_cost}


def test_an_openai_compatible_upstream_elsewhere_is_counted_on_another_bill_than_openais(
        gw: ServiceProcess, admin: Client, stub: StubProvider,
        redis_server: RedisServer) -> None:
    """The router speaks OpenAI's API and is priced by OpenAI's table, but is not OpenAI's own
    host: its spend counted as OpenAI's would hide spend made with an OpenAI key from
    reconcile's booking."""
    _, key = account(admin, 1_000_000)
    before = day_spend(redis_server)
    sdk(gw, key).chat.completions.create(model="router/gpt-4o-mini", max_tokens=50,
                                         messages=HELLO)
    [billed] = costs(stub)
    after = day_spend(redis_server)
    grew = {u: after[u] - before[u] for u in Upstream if after[u] != before[u]}
    assert billed > 0
    assert grew == {Upstream.OTHER: billed}
