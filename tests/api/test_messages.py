"""POST /v1/messages end to end: the real `anthropic` SDK, sync and async, pointed at gateway
instances in front of the stub provider's Anthropic routes.

The stub's bill is the witness: what a call was charged is compared with what the provider
billed for it, to the micro-dollar, never with what the gateway says. The service prices Claude
from genai-prices' bundled table and the stub from its own (infra/stub_prices.json). Instances:
`gw` calls the stub through a FaultProxy (to read what was forwarded); `gw_no_anthropic` has
no Anthropic provider configured.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from infra.stub_provider import StubProvider, fetch_bill, reset_bill, stub_control
from tests.api.conftest import (
    ADMIN_TOKEN,
    Client,
    FaultProxy,
    account,
    anthropic_sdk,
    as_key,
    async_anthropic_sdk,
    correct,
    counting_client,
    header,
    ledger,
    refused_to_key,
    trailer,
)

# The provider's own key, which the gateway sends; the client's key is the spend-ceiling one.
PROVIDER_KEY = "sk-ant-provider"
SONNET, HAIKU = "claude-sonnet-4-5", "claude-haiku-4-5"
HELLO: list[Any] = [{"role": "user", "content": "hello"}]
# A prefix above Sonnet 4.5's 1,024-token cache minimum (the stub counts 4 bytes a token).
MANUAL = "You answer from this manual. " + "Rule. " * 1_000


@pytest.fixture(scope="module")
def stub() -> Iterator[StubProvider]:
    with StubProvider(seed=15, latency_ms_min=0, latency_ms_max=2, output_tokens_mean=150,
                      api_key=PROVIDER_KEY) as provider:
        yield provider


def service(redis_server: RedisServer, **env: str) -> ServiceProcess:
    return ServiceProcess({"REDIS_URL": redis_server.url, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN,
                           "CEILING_UPSTREAM_TIMEOUT_S": "30", **env})


@pytest.fixture(scope="module")
def gw(redis_server: RedisServer, proxy: FaultProxy) -> Iterator[ServiceProcess]:
    with service(redis_server, CEILING_ANTHROPIC_URL=proxy.url,
                 CEILING_ANTHROPIC_API_KEY=PROVIDER_KEY) as s:
        yield s


@pytest.fixture(scope="module")
def gw_no_anthropic(redis_server: RedisServer, stub: StubProvider) -> Iterator[ServiceProcess]:
    with service(redis_server, CEILING_UPSTREAM_URL=f"{stub.url}/v1") as s:
        yield s


@pytest.fixture(autouse=True)
def fresh_bill(stub: StubProvider, proxy: FaultProxy) -> Iterator[None]:
    stub_control(stub.url, {"prompt_cache": True})
    reset_bill(stub.url)
    yield
    proxy.disarm()
    stub_control(stub.url, {})


def billed_costs(stub: StubProvider) -> list[int]:
    return [c.cost_micros for c in fetch_bill(stub.url).log]


def forwarded_headers(proxy: FaultProxy) -> dict[str, str]:
    head = proxy.last_request.split(b"\r\n\r\n", 1)[0].decode().split("\r\n")[1:]
    return {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in head)}


# -- the call path ------------------------------------------------------------------------------


async def test_a_message_is_charged_what_the_provider_billed_sync_and_async(
    gw: ServiceProcess, admin: Client, stub: StubProvider
) -> None:
    ceiling = 1_000_000
    tag, key = account(admin, ceiling)
    raw = anthropic_sdk(gw, key).messages.with_raw_response.create(
        model=SONNET, max_tokens=300, messages=HELLO)
    raw_async = await async_anthropic_sdk(gw, key).messages.with_raw_response.create(
        model=HAIKU, max_tokens=300, messages=HELLO, system="Be brief.")
    costs = billed_costs(stub)
    assert raw.parse().usage.output_tokens > 0
    assert (await raw_async.parse()).usage.output_tokens > 0
    for answer, cost in zip((raw, raw_async), costs, strict=True):
        assert header(answer, "x-ceiling-charged-micros") == cost > 0
        assert header(answer, "x-ceiling-reserved-micros") >= cost
        assert answer.headers["x-ceiling-billing-outcome"] == "billed"
        assert answer.headers["request-id"].startswith("req_")  # the provider's, relayed
    period = ledger(admin, tag)
    assert (period["committed_micros"], period["reserved_micros"]) == (sum(costs), 0)
    assert header(raw_async, "x-ceiling-remaining-micros") == ceiling - sum(costs)


def test_the_providers_key_is_sent_with_the_clients_version_and_betas(
    gw: ServiceProcess, admin: Client, proxy: FaultProxy
) -> None:
    _, key = account(admin, 1_000_000)
    anthropic_sdk(gw, key).messages.create(
        model=SONNET, max_tokens=10, messages=HELLO,
        extra_headers={"anthropic-beta": "fine-grained-tool-streaming-2025-05-14"})
    sent = forwarded_headers(proxy)
    assert proxy.forwarded_path() == "/v1/messages"
    assert sent["x-api-key"] == PROVIDER_KEY  # never the client's spend-ceiling key
    assert key not in proxy.last_request.decode(errors="replace")
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", sent["anthropic-version"])  # the SDK's own
    assert sent["anthropic-beta"] == "fine-grained-tool-streaming-2025-05-14"
    assert "authorization" not in sent


def test_a_stream_settles_at_message_stop_and_ends_with_its_figures(
    gw: ServiceProcess, admin: Client, stub: StubProvider
) -> None:
    tag, key = account(admin, 1_000_000)
    with anthropic_sdk(gw, key).messages.stream(model=SONNET, max_tokens=200,
                                                messages=HELLO) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text
    assert final.usage.output_tokens > 0
    with httpx.stream("POST", f"{gw.url}/v1/messages", json={
            "model": SONNET, "max_tokens": 200, "messages": HELLO, "stream": True},
            headers={"x-api-key": key, "anthropic-version": "2023-06-01"}) as response:
        held = header(response, "x-ceiling-reserved-micros")
        assert "x-ceiling-charged-micros" not in response.headers  # not known yet
        body = response.read().decode()
    # The figures follow message_stop as SSE comments, which the SDK skips.
    assert body.index("event: message_stop") < body.index(": x-ceiling-charged-micros")
    figures = trailer(body)
    costs = billed_costs(stub)
    assert (figures["x-ceiling-billing-outcome"], int(figures["x-ceiling-reserved-micros"])) == (
        "billed", held)
    assert int(figures["x-ceiling-charged-micros"]) == costs[1]
    period = ledger(admin, tag)
    assert (period["committed_micros"], period["reserved_micros"]) == (sum(costs), 0)


def test_cache_writes_reads_thinking_and_tools_are_settled_to_the_micro_dollar(
    gw: ServiceProcess, admin: Client, stub: StubProvider
) -> None:
    """Anthropic's usage puts cache reads and writes beside the input count, and splits 1-hour
    writes out; thinking is output. Each call's charge is its bill."""
    tag, key = account(admin, 10_000_000)
    messages = anthropic_sdk(gw, key).messages
    cached = [{"type": "text", "text": MANUAL, "cache_control": {"type": "ephemeral"}}]
    cached_1h = [{"type": "text", "text": MANUAL + " (1h)",
                  "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    weather = [{"name": "weather", "description": "the weather in a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    calls = [
        lambda: messages.with_raw_response.create(model=SONNET, max_tokens=50, system=cached,
                                                  messages=HELLO),  # a 5-minute write
        lambda: messages.with_raw_response.create(model=SONNET, max_tokens=50, system=cached,
                                                  messages=HELLO),  # its read
        lambda: messages.with_raw_response.create(model=SONNET, max_tokens=50,
                                                  system=cached_1h, messages=HELLO),
        lambda: messages.with_raw_response.create(
            model=SONNET, max_tokens=2_000, messages=HELLO,
            thinking={"type": "enabled", "budget_tokens": 1_024}),
        lambda: messages.with_raw_response.create(
            model=HAIKU, max_tokens=100, messages=HELLO, tools=weather,
            tool_choice={"type": "tool", "name": "weather"}),
    ]
    charged = [header(call(), "x-ceiling-charged-micros") for call in calls]
    bill = fetch_bill(stub.url)
    assert charged == [c.cost_micros for c in bill.log]
    usages = [c.usage for c in bill.log]
    assert all(usage is not None for usage in usages)
    written, read, written_1h, thought = (u for u in usages[:4] if u is not None)
    assert min(written.cache_write_tokens, read.cached_input_tokens,
               written_1h.cache_write_1h_tokens, thought.reasoning_tokens) > 0
    assert ledger(admin, tag)["committed_micros"] == bill.total.cost_micros


# -- refusals -----------------------------------------------------------------------------------


def test_a_spent_budget_is_a_402_billing_error_the_sdk_does_not_retry(
    gw: ServiceProcess, admin: Client, stub: StubProvider
) -> None:
    tag, key = account(admin, 100)
    transport, sent = counting_client()
    with pytest.raises(anthropic.APIStatusError) as refused:
        anthropic_sdk(gw, key, max_retries=3, http_client=transport).messages.create(
            model=SONNET, max_tokens=100, messages=HELLO)
    error = refused.value
    assert error.status_code == 402
    assert isinstance(error.body, dict)
    assert error.body["type"] == "error"
    assert {k: error.body["error"][k] for k in ("type", "code", "budget_id", "period")} == {
        "type": "billing_error", "code": "budget_exceeded", "budget_id": tag, "period": "total"}
    assert error.response.headers["x-should-retry"] == "false"
    assert (header(error.response, "x-ceiling-reserved-micros"),
            header(error.response, "x-ceiling-remaining-micros")) == (0, 100)
    assert len(sent) == 1  # the SDK, told it may retry 3 times, sent it once
    assert fetch_bill(stub.url).requests == 0


def test_a_busy_budget_is_a_429_the_sdk_retries(
    gw: ServiceProcess, admin: Client, stub: StubProvider
) -> None:
    _, key = account(admin, 10_000, roles=("gateway", "sidecar"))
    assert admin.post("/v1/reservations", headers=as_key(key),
                      json={"amount_micros": 9_000}).is_success
    transport, sent = counting_client()
    with pytest.raises(anthropic.RateLimitError) as busy:
        anthropic_sdk(gw, key, max_retries=1, http_client=transport).messages.create(
            model=SONNET, max_tokens=50, messages=HELLO)
    assert busy.value.body["error"]["code"] == "budget_busy"  # type: ignore[index]
    assert busy.value.response.headers["retry-after"] == "1"
    assert len(sent) == 2
    assert fetch_bill(stub.url).requests == 0


def test_the_key_comes_as_x_api_key_or_a_bearer_token_and_needs_the_gateway_role(
    gw: ServiceProcess, admin: Client
) -> None:
    _, key = account(admin, 1_000_000)
    bearer = anthropic.Anthropic(base_url=gw.url, auth_token=key, max_retries=0)
    assert bearer.messages.create(model=SONNET, max_tokens=5, messages=HELLO).content
    with pytest.raises(anthropic.AuthenticationError) as nobody:
        anthropic_sdk(gw, "sk-ceil-nope").messages.create(model=SONNET, max_tokens=5,
                                                         messages=HELLO)
    assert nobody.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    _, sidecar = account(admin, 1_000_000, roles=("sidecar",))
    with pytest.raises(anthropic.PermissionDeniedError) as forbidden:
        anthropic_sdk(gw, sidecar).messages.create(model=SONNET, max_tokens=5, messages=HELLO)
    assert forbidden.value.body["error"]["missing_role"] == "gateway"  # type: ignore[index]


def test_without_an_anthropic_provider_the_route_refuses_before_holding(
    gw_no_anthropic: ServiceProcess, admin: Client
) -> None:
    tag, key = account(admin, 1_000_000)
    transport, sent = counting_client()
    with pytest.raises(anthropic.InternalServerError) as refused:
        anthropic_sdk(gw_no_anthropic, key, max_retries=2, http_client=transport
                      ).messages.create(model=SONNET, max_tokens=5, messages=HELLO)
    error = refused.value.body["error"]  # type: ignore[index]
    assert (error["type"], error["code"]) == ("api_error", "invalid_configuration")
    assert "CEILING_ANTHROPIC_URL" in error["message"]
    assert len(sent) == 1
    assert ledger(admin, tag)["reserved_micros"] == 0


# -- the provider's errors ----------------------------------------------------------------------


def test_a_providers_refusal_releases_and_an_error_after_billing_stays_held(
    gw: ServiceProcess, admin: Client, stub: StubProvider
) -> None:
    """A 400 the provider answers itself proves nothing was billed: released. A 529 (overloaded)
    can come after the call was billed: held, and the SDK, which retries 529, is told not to
    (a retry could pay twice). No key can lower the hold; an operator corrects it."""
    tag, key = account(admin, 1_000_000, roles=("gateway", "sidecar"))
    with pytest.raises(anthropic.BadRequestError) as bad:
        anthropic_sdk(gw, key).messages.create(model=SONNET, max_tokens=5, messages=HELLO,
                                               extra_body={"temperature": 2.0})
    assert bad.value.response.headers["x-ceiling-billing-outcome"] == "released"
    assert ledger(admin, tag)["reserved_micros"] == 0
    stub_control(stub.url, {"fail_after_billing": 529})
    transport, sent = counting_client()
    with pytest.raises(anthropic.APIStatusError) as overloaded:
        anthropic_sdk(gw, key, max_retries=2, http_client=transport).messages.create(
            model=SONNET, max_tokens=100, messages=HELLO)
    response = overloaded.value.response
    assert overloaded.value.status_code == 529
    assert (response.headers["x-ceiling-billing-outcome"], response.headers["x-should-retry"]) == (
        "unknown", "false")
    assert len(sent) == 1
    rid, held = response.headers["x-ceiling-reservation-id"], header(
        response, "x-ceiling-reserved-micros")
    assert ledger(admin, tag)["reserved_micros"] == held
    refused_to_key(admin, key, rid)
    [_, billed] = fetch_bill(stub.url).log
    assert (billed.billed, billed.status) == (True, 529)
    assert correct(admin, rid, billed.cost_micros)["charged_micros"] == billed.cost_micros
    period = ledger(admin, tag)
    assert (period["committed_micros"], period["reserved_micros"]) == (billed.cost_micros, 0)


def test_a_stream_the_provider_breaks_off_raises_in_the_sdk_and_stays_held(
    gw: ServiceProcess, admin: Client, stub: StubProvider
) -> None:
    tag, key = account(admin, 1_000_000)
    stub_control(stub.url, {"break_after_events": 5})
    with pytest.raises(anthropic.APIStatusError, match="broke off"):
        list(anthropic_sdk(gw, key).messages.create(model=SONNET, max_tokens=100,
                                                    messages=HELLO, stream=True))
    period = ledger(admin, tag)
    assert period["committed_micros"] == 0
    assert period["reserved_micros"] >= fetch_bill(stub.url).total.cost_micros > 0


def test_a_retry_under_one_idempotency_key_makes_one_call(
    gw: ServiceProcess, admin: Client, stub: StubProvider
) -> None:
    _, key = account(admin, 1_000_000)
    messages = anthropic_sdk(gw, key).messages
    once = {"Idempotency-Key": "messages-once"}
    first = messages.with_raw_response.create(model=SONNET, max_tokens=50, messages=HELLO,
                                              extra_headers=once)
    again = messages.with_raw_response.create(model=SONNET, max_tokens=50, messages=HELLO,
                                              extra_headers=once)
    assert again.headers["x-ceiling-replayed"] == "true"
    assert again.parse().id == first.parse().id
    assert fetch_bill(stub.url).requests == 1
    # The same key with another beta is another call: refused as a conflict, not replayed.
    with pytest.raises(anthropic.APIStatusError) as conflict:
        messages.create(model=SONNET, max_tokens=50, messages=HELLO, extra_headers={
            **once, "anthropic-beta": "interleaved-thinking-2025-05-14"})
    assert conflict.value.body["error"]["code"] == "idempotency_conflict"  # type: ignore[index]
    assert json.loads(again.http_response.text)["id"] == first.parse().id


# -- token counting -------------------------------------------------------------------------------


def test_count_tokens_is_forwarded_holds_nothing_and_counts_against_the_rate(
    gw: ServiceProcess, admin: Client, stub: StubProvider,
) -> None:
    """The SDK's messages.count_tokens through the gateway: the provider's count comes back,
    nothing is billed or left held, the body is checked like a call's (an unknown field is
    refused before the provider), and the key's requests per minute count it."""
    tag, key = account(admin, 1_000_000)
    r = admin.admin("PUT", f"/v1/admin/budgets/{tag}", json={
        "limits": [{"period": "day", "ceiling_micros": 1_000_000}],
        "rate": {"requests_per_minute": 3}})
    assert r.status_code == 200, r.text
    client = anthropic_sdk(gw, key, max_retries=0)
    counted = client.messages.count_tokens(
        model=SONNET, messages=HELLO, system="be brief",
        tools=[{"name": "f", "input_schema": {"type": "object"}}])
    assert counted.input_tokens > 0
    bill = fetch_bill(stub.url)
    assert (bill.requests, bill.total.cost_micros) == (1, 0)
    assert (ledger(admin, tag)["committed_micros"], ledger(admin, tag)["reserved_micros"]) == (
        0, 0)
    with pytest.raises(anthropic.UnprocessableEntityError) as refused:
        client.messages.count_tokens(model=SONNET, messages=HELLO,
                                     extra_body={"speed": "fast"})
    assert refused.value.body["error"]["field"] == "speed"  # type: ignore[index]
    client.messages.count_tokens(model=SONNET, messages=HELLO)
    client.messages.count_tokens(model=SONNET, messages=HELLO)
    with pytest.raises(anthropic.RateLimitError) as limited:
        client.messages.count_tokens(model=SONNET, messages=HELLO)
    assert limited.value.body["error"]["code"] == "rate_limited"  # type: ignore[index]
    assert fetch_bill(stub.url).requests == 3
