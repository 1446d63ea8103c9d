"""The OpenAI-compatible gateway end to end, with the real openai SDK, sync and async.

Gateway instances run as processes (ServiceProcess) in front of the stub provider, whose bill is
the witness: what the ledger charged is compared with what the provider billed, never with what
the gateway says. Three instances: `gw` calls the stub directly; `gw_faulty` calls it through a
FaultProxy (below) and gives up on the provider after UPSTREAM_TIMEOUT_S; `gw_dead` points at a
port nothing listens on. Every test prices its own model from the prices file, so its part of
the provider's bill and its output-length histogram are its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from core.config import OUTPUT_TOKENS_DEFAULT
from core.gateway import CLAMP_OUTPUT_TOKENS_MIN
from core.replies import IN_FLIGHT_RETRY_AFTER_S, IN_FLIGHT_WAIT_S_MAX
from core.stores.redis import RedisStore
from infra.processes import free_port
from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from infra.stub_provider import StubProvider, Tally, fetch_bill, stub_control
from tests.api.conftest import (
    ADMIN_TOKEN,
    BOTH_ROLES,
    Client,
    FaultProxy,
    account,
    as_key,
    async_sdk,
    correct,
    counting_client,
    gateway,
    header,
    ledger,
    refused_to_key,
    reservation,
    sdk,
    settled,
    trailer,
)
from tests.support import write_prices

MODELS = iter(f"gw-m{i:02d}" for i in range(64))
# The test models' rates: one micro-dollar an input token, four an output token.
INPUT_MICROS = 1
OUTPUT_MICROS = 4
# gw_faulty gives up on the provider this fast, so a hung provider costs a test seconds.
UPSTREAM_TIMEOUT_S = 5
MESSAGES = [{"role": "user", "content": "hello"}]
# These instances may hold a model's p95 output length (test_the_p95_is_held_...).
HOLD_P95 = {"CEILING_HOLD_P95": "1"}

# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prices_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    rates = {"input_usd_per_mtok": f"{INPUT_MICROS}.00",
             "output_usd_per_mtok": f"{OUTPUT_MICROS}.00"}
    return write_prices(tmp_path_factory, "gateway",
                        {"models": {f"gw-m{i:02d}": rates for i in range(64)}})


@pytest.fixture(scope="module")
def stub() -> Iterator[StubProvider]:
    # The provider's own table, written apart from the service's prices file: the witness
    # prices what it serves by its own rates, whatever the gateway was told.
    rates = {"input_usd_per_mtok": f"{INPUT_MICROS}.00",
             "output_usd_per_mtok": f"{OUTPUT_MICROS}.00"}
    table = {"models": {f"gw-m{i:02d}": rates for i in range(64)}}
    with StubProvider(seed=6, latency_ms_min=1, latency_ms_max=5, output_tokens_mean=120,
                      prices=table) as provider:
        yield provider


@pytest.fixture(scope="module")
def gw(redis_server: RedisServer, prices_file: str, stub: StubProvider) -> Iterator[ServiceProcess]:
    with gateway(redis_server, prices_file, f"{stub.url}/v1", 30, HOLD_P95) as service:
        yield service


@pytest.fixture(scope="module")
def gw_faulty(redis_server: RedisServer, prices_file: str,
              proxy: FaultProxy) -> Iterator[ServiceProcess]:
    with gateway(redis_server, prices_file, f"{proxy.url}/v1", UPSTREAM_TIMEOUT_S,
                 HOLD_P95) as service:
        yield service


@pytest.fixture(scope="module")
def gw_dead(redis_server: RedisServer, prices_file: str) -> Iterator[ServiceProcess]:
    with gateway(redis_server, prices_file, f"http://127.0.0.1:{free_port()}/v1", 5,
                 HOLD_P95) as service:
        yield service


@pytest.fixture(autouse=True)
def no_faults(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "proxy" in request.fixturenames:
        request.getfixturevalue("proxy").disarm()
    if "stub" in request.fixturenames:
        stub_control(request.getfixturevalue("stub").url, {})


@pytest.fixture
def model() -> str:
    return next(MODELS)


# -- helpers -------------------------------------------------------------------------------------


def billed(stub: StubProvider, model: str) -> Tally:
    return fetch_bill(stub.url).by_model.get(model, Tally())


def provider_requests(stub: StubProvider) -> int:
    return fetch_bill(stub.url).requests


def cost(usage: Any) -> int:
    return int(usage.prompt_tokens * INPUT_MICROS + usage.completion_tokens * OUTPUT_MICROS)


# -- the call path: price, reserve, call, settle -------------------------------------------------


async def test_a_call_is_charged_what_the_provider_billed_sync_and_async(
    gw: ServiceProcess, admin: Client, stub: StubProvider, model: str
) -> None:
    tag, key = account(admin, 1_000_000)
    raw = sdk(gw, key).chat.completions.with_raw_response.create(
        model=model, messages=MESSAGES, max_tokens=300)
    raw_async = await async_sdk(gw, key).chat.completions.with_raw_response.create(
        model=model, messages=MESSAGES, max_completion_tokens=300)
    for answer in (raw, raw_async):
        usage = answer.parse().usage
        assert usage is not None
        assert header(answer, "x-ceiling-charged-micros") == cost(usage) > 0
        assert header(answer, "x-ceiling-reserved-micros") >= cost(usage)
        assert answer.headers["x-ceiling-billing-outcome"] == "billed"
    bill = billed(stub, model)
    period = ledger(admin, tag)
    assert (bill.calls, period["committed_micros"], period["reserved_micros"]) == (
        2, bill.cost_micros, 0)
    assert header(raw_async, "x-ceiling-remaining-micros") == 1_000_000 - bill.cost_micros


async def test_a_stream_settles_from_the_usage_chunk_the_gateway_asked_for(
    gw: ServiceProcess, admin: Client, stub: StubProvider, model: str
) -> None:
    tag, key = account(admin, 1_000_000)
    chunks = list(sdk(gw, key).chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=200, stream=True))
    # The client did not ask for usage: the chunk the gateway asked for is not passed on.
    assert chunks
    assert all(c.usage is None and c.choices for c in chunks)
    stream = await async_sdk(gw, key).chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=200, stream=True,
        stream_options={"include_usage": True})
    last = [c async for c in stream][-1]
    assert last.usage is not None
    assert last.choices == []
    before = billed(stub, model).cost_micros
    with httpx.stream("POST", f"{gw.url}/v1/chat/completions",
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": model, "messages": MESSAGES, "max_tokens": 200,
                            "stream": True}) as response:
        held = header(response, "x-ceiling-reserved-micros")
        assert "x-ceiling-charged-micros" not in response.headers  # not known yet
        text = response.read().decode()
    assert text.endswith("data: [DONE]\n\n")
    figures = trailer(text)
    assert figures["x-ceiling-billing-outcome"] == "billed"
    assert int(figures["x-ceiling-reserved-micros"]) == held
    bill = billed(stub, model)
    assert int(figures["x-ceiling-charged-micros"]) == bill.cost_micros - before
    period = ledger(admin, tag)
    assert (bill.calls, period["committed_micros"], period["reserved_micros"]) == (
        3, bill.cost_micros, 0)
    assert int(figures["x-ceiling-remaining-micros"]) == 1_000_000 - bill.cost_micros


def test_the_worst_case_is_the_input_bound_plus_the_cap_times_n(
    gw_faulty: ServiceProcess, admin: Client, proxy: FaultProxy, model: str
) -> None:
    _, key = account(admin, 10_000_000)
    chat = sdk(gw_faulty, key).chat.completions

    def held(**request: Any) -> int:
        request = {"model": model, "messages": MESSAGES, **request}
        try:
            return header(chat.with_raw_response.create(**request), "x-ceiling-reserved-micros")
        except openai.APIStatusError as refused:  # the stub serves n = 1 only
            return header(refused.response, "x-ceiling-reserved-micros")

    assert held(max_tokens=200) - held(max_tokens=100) == 100 * OUTPUT_MICROS
    longer = [{"role": "user", "content": "hello" + "x" * 50}]
    assert held(max_tokens=100, messages=longer) - held(max_tokens=100) == 50 * INPUT_MICROS
    assert held(max_tokens=100, n=3) - held(max_tokens=100, n=2) == 100 * OUTPUT_MICROS
    # No cap: the gateway sets one, prices it and forwards it.
    assert held() == held(max_completion_tokens=OUTPUT_TOKENS_DEFAULT)
    held()
    assert proxy.forwarded()["max_completion_tokens"] == OUTPUT_TOKENS_DEFAULT
    list(chat.create(model=model, messages=MESSAGES, max_tokens=20, stream=True))
    assert proxy.forwarded()["stream_options"] == {"include_usage": True}


# -- streams cut off -----------------------------------------------------------------------------


def test_a_client_that_hangs_up_is_charged_what_the_provider_billed(
    gw_faulty: ServiceProcess, admin: Client, proxy: FaultProxy, stub: StubProvider, model: str
) -> None:
    tag, key = account(admin, 1_000_000)
    proxy.output_tokens, proxy.throttle = 300, True  # 19 chunks, relayed over about a second
    stream = sdk(gw_faulty, key).chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=400, stream=True)
    assert [next(stream).choices[0].delta.role, next(stream).choices[0].delta.content] != []
    stream.close()
    # The client is gone mid-stream. Whether the gateway has read the rest yet is a race on a
    # loaded machine (a check that it had not once failed CI), so only the outcome is checked:
    # settled at what the provider billed for the whole answer, never at zero.
    held = ledger(admin, tag)
    assert held["committed_micros"] > 0 or held["reserved_micros"] > 0
    period = settled(admin, tag)
    bill = billed(stub, model)
    assert bill.output_tokens == 300
    assert (period["committed_micros"], period["reserved_micros"]) == (bill.cost_micros, 0)


def test_a_stream_the_provider_breaks_off_stays_held_and_is_correctable(
    gw_faulty: ServiceProcess, admin: Client, proxy: FaultProxy, stub: StubProvider, model: str
) -> None:
    tag, key = account(admin, 1_000_000, roles=BOTH_ROLES)
    proxy.output_tokens, proxy.cut_after_bytes = 300, 1_000
    request = {"model": model, "messages": MESSAGES, "max_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{gw_faulty.url}/v1/chat/completions", json=request,
                      headers={"Authorization": f"Bearer {key}"}) as response:
        rid, held = response.headers["x-ceiling-reservation-id"], header(
            response, "x-ceiling-reserved-micros")
        text = response.read().decode()
    assert "[DONE]" not in text
    assert '"code": "upstream_timeout"' in text
    figures = trailer(text)
    assert figures["x-ceiling-billing-outcome"] == "unknown"
    assert int(figures["x-ceiling-charged-micros"]) == held
    period = ledger(admin, tag)
    assert (period["committed_micros"], period["reserved_micros"]) == (0, held)
    # The SDK raises on the error event instead of ending the stream as if it were complete.
    proxy.output_tokens, proxy.cut_after_bytes = 300, 1_000
    with pytest.raises(openai.APIError, match="broke off"):
        list(sdk(gw_faulty, key).chat.completions.create(**request))
    # The provider billed both calls in full. The key cannot lower what its reservation holds;
    # an operator who reads the bill corrects it.
    bill = fetch_bill(stub.url).by_model[model]
    assert bill.calls == 2
    per_call = bill.cost_micros // 2
    refused_to_key(admin, key, rid)
    assert correct(admin, rid, per_call)["charged_micros"] == per_call
    period = ledger(admin, tag)
    assert period["committed_micros"] == per_call
    assert period["reserved_micros"] == held  # the SDK's call, still held
    assert period["committed_micros"] + period["reserved_micros"] >= bill.cost_micros


# -- failures with and without an outcome ----------------------------------------------------------


def test_a_provider_that_cannot_be_reached_releases_the_reservation(
    gw_dead: ServiceProcess, admin: Client, model: str
) -> None:
    tag, key = account(admin, 1_000_000)
    with pytest.raises(openai.APIStatusError) as failed:
        sdk(gw_dead, key).chat.completions.create(model=model, messages=MESSAGES, max_tokens=100)
    error = failed.value
    assert (error.status_code, error.code) == (502, "upstream_unreachable")
    assert error.response.headers["x-ceiling-billing-outcome"] == "released"
    assert header(error.response, "x-ceiling-charged-micros") == 0
    assert header(error.response, "x-ceiling-reserved-micros") > 0
    period = ledger(admin, tag)
    assert (period["committed_micros"], period["reserved_micros"]) == (0, 0)


def test_no_answer_keeps_the_worst_case_and_a_waiting_retry_gives_up(
    gw_faulty: ServiceProcess, admin: Client, stub: StubProvider, model: str
) -> None:
    tag, key = account(admin, 1_000_000)
    stub_control(stub.url, {"hang": True, "calls": 1})
    requests_before = provider_requests(stub)
    retry_key = {"Idempotency-Key": f"k-{uuid.uuid4().hex}"}
    request: dict[str, Any] = {"model": model, "messages": MESSAGES, "max_tokens": 100,
                               "extra_headers": retry_key}

    def original() -> openai.APIStatusError:
        # The SDK may retry twice; x-should-retry: false on an unknown outcome stops it.
        with pytest.raises(openai.APIStatusError) as failed:
            sdk(gw_faulty, key, max_retries=2).chat.completions.create(**request)
        return failed.value

    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(original)
        time.sleep(0.5)
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as waited:
            sdk(gw_faulty, key).chat.completions.create(**request)
        waited_s = time.monotonic() - started
        timed_out = first.result()
    assert (waited.value.status_code, waited.value.code) == (409, "idempotency_in_flight")
    assert waited.value.response.headers["retry-after"] == str(IN_FLIGHT_RETRY_AFTER_S)
    assert IN_FLIGHT_WAIT_S_MAX - 0.5 < waited_s < UPSTREAM_TIMEOUT_S
    assert (timed_out.status_code, timed_out.code) == (504, "upstream_timeout")
    answer = timed_out.response.headers
    assert (answer["x-ceiling-billing-outcome"], answer["x-should-retry"]) == ("unknown", "false")
    held = int(answer["x-ceiling-reserved-micros"])
    assert int(answer["x-ceiling-charged-micros"]) == held
    assert provider_requests(stub) - requests_before == 1
    period = ledger(admin, tag)
    assert (period["committed_micros"], period["reserved_micros"]) == (0, held)
    # An operator corrects it from the provider's bill (which has nothing for a hung call).
    rid = answer["x-ceiling-reservation-id"]
    assert reservation(admin, rid)["state"] == "open"
    assert correct(admin, rid, 0)["charged_micros"] == 0
    assert ledger(admin, tag)["reserved_micros"] == 0
    # The key was given back: a retry now makes the call.
    assert sdk(gw_faulty, key).chat.completions.create(**request).usage is not None


@pytest.mark.parametrize(("status", "outcome"), [
    (400, "released"), (404, "released"), (429, "released"),
    # Statuses that can come after the provider ran (and billed) the call keep the hold.
    (408, "unknown"), (499, "unknown"), (500, "unknown"), (502, "unknown"), (503, "unknown"),
    (504, "unknown"), (520, "unknown"), (524, "unknown")])
def test_provider_errors_pass_through_and_only_a_refusal_releases_the_hold(
    gw_faulty: ServiceProcess, admin: Client, stub: StubProvider, model: str, status: int,
    outcome: str,
) -> None:
    tag, key = account(admin, 1_000_000, roles=BOTH_ROLES)
    stub_control(stub.url, {"fail_status": status, "calls": 1})
    with pytest.raises(openai.APIStatusError) as failed:
        sdk(gw_faulty, key).chat.completions.create(model=model, messages=MESSAGES, max_tokens=90)
    error = failed.value
    assert (error.status_code, error.code) == (status, "stub_failure")
    answer = error.response.headers
    assert answer["x-ceiling-billing-outcome"] == outcome
    held = 0 if outcome == "released" else header(error.response, "x-ceiling-reserved-micros")
    period = ledger(admin, tag)
    assert (period["committed_micros"], period["reserved_micros"]) == (0, held)
    if outcome == "unknown":
        assert answer["x-should-retry"] == "false"  # a blind retry could pay twice
        refused_to_key(admin, key, answer["x-ceiling-reservation-id"])
        assert ledger(admin, tag)["reserved_micros"] == held


def test_a_stream_with_usage_but_no_end_stays_held(
    gw_faulty: ServiceProcess, admin: Client, proxy: FaultProxy, stub: StubProvider, model: str
) -> None:
    # Cut after the usage chunk, before `data: [DONE]`: usage alone does not make a stream
    # complete (a provider reporting cumulative usage sends it with every chunk).
    tag, key = account(admin, 1_000_000)
    proxy.output_tokens, proxy.cut_before = 300, b"data: [DONE]"
    with httpx.stream("POST", f"{gw_faulty.url}/v1/chat/completions", headers=as_key(key),
                      json={"model": model, "messages": MESSAGES, "max_tokens": 400,
                            "stream": True}) as response:
        held = header(response, "x-ceiling-reserved-micros")
        text = response.read().decode()
    assert proxy.cut_before is None, "the proxy cut the stream"
    figures = trailer(text)
    assert figures["x-ceiling-billing-outcome"] == "unknown"
    assert "[DONE]" not in text
    bill = billed(stub, model)
    assert bill.calls == 1
    period = ledger(admin, tag)
    assert (period["committed_micros"], period["reserved_micros"]) == (0, held)
    assert held >= bill.cost_micros


# -- a key holder cannot lower what a gateway call is charged -----------------------------------


def test_a_key_cannot_release_or_settle_its_own_stream_mid_stream(
    gw_faulty: ServiceProcess, admin: Client, proxy: FaultProxy, stub: StubProvider, model: str
) -> None:
    tag, key = account(admin, 1_000_000, roles=BOTH_ROLES)
    _, stranger = account(admin, 1_000_000, roles=BOTH_ROLES)
    _, gateway_only = account(admin, 1_000_000)
    proxy.output_tokens, proxy.throttle = 300, True  # 19 chunks over about a second
    with httpx.stream("POST", f"{gw_faulty.url}/v1/chat/completions", headers=as_key(key),
                      json={"model": model, "messages": MESSAGES, "max_tokens": 400,
                            "stream": True}) as response:
        rid = response.headers["x-ceiling-reservation-id"]
        chunks = response.iter_bytes()
        next(chunks)
        # Mid-stream, with the id the gateway just sent: its own key, another org's key, and a
        # key without the sidecar role all fail to release or settle it.
        for who in (key, stranger):
            refused_to_key(admin, who, rid)
        r = admin.post(f"/v1/reservations/{rid}/release", headers=as_key(gateway_only))
        assert (r.status_code, r.json()["error"]["code"], r.json()["error"]["missing_role"]) == (
            403, "forbidden", "sidecar")
        text = b"".join(chunks).decode()
    figures = trailer(text)
    assert figures["x-ceiling-billing-outcome"] == "billed"
    bill = billed(stub, model)
    assert (bill.calls, bill.output_tokens) == (1, 300)
    assert int(figures["x-ceiling-charged-micros"]) == bill.cost_micros
    period = ledger(admin, tag)
    assert (period["committed_micros"], period["reserved_micros"]) == (bill.cost_micros, 0)
    assert reservation(admin, rid)["made_by"] == "gateway"


def test_a_504_cannot_be_settled_by_its_key_only_corrected_by_an_operator(
    gw_faulty: ServiceProcess, admin: Client, stub: StubProvider, model: str
) -> None:
    tag, key = account(admin, 1_000_000, roles=BOTH_ROLES)
    stub_control(stub.url, {"hang": True, "calls": 1})
    with pytest.raises(openai.APIStatusError) as failed:
        sdk(gw_faulty, key).chat.completions.create(model=model, messages=MESSAGES, max_tokens=90)
    assert (failed.value.status_code, failed.value.code) == (504, "upstream_timeout")
    answer = failed.value.response.headers
    rid, held = answer["x-ceiling-reservation-id"], int(answer["x-ceiling-reserved-micros"])
    assert "unless an operator corrects it" in failed.value.message  # the key is not invited
    refused_to_key(admin, key, rid)
    assert ledger(admin, tag)["reserved_micros"] == held
    stored = reservation(admin, rid)
    assert {k: stored[k] for k in ("state", "made_by", "reserved_micros", "corrected_by")} == {
        "state": "open", "made_by": "gateway", "reserved_micros": held, "corrected_by": None}
    fixed = correct(admin, rid, 7)
    assert (fixed["charged_micros"], fixed["corrected_by"].startswith("admin:")) == (7, True)
    assert ADMIN_TOKEN not in json.dumps(fixed)
    stored = reservation(admin, rid)
    assert (stored["state"], stored["outcome"], stored["charged_micros"],
            stored["corrected_from_micros"], stored["correction_reason"]) == (
        "settled", "corrected", 7, held, "the provider's bill")
    assert stored["corrected_at_ms"] >= stored["created_ms"]
    assert (ledger(admin, tag)["committed_micros"], ledger(admin, tag)["reserved_micros"]) == (
        7, 0)
    # Once resolved, neither the key nor a second correction to another amount moves it.
    refused_to_key(admin, key, rid)
    again = admin.admin("POST", f"/v1/admin/reservations/{rid}/settle",
                        json={"actual_micros": 8, "reason": "again"})
    assert (again.status_code, again.json()["error"]["code"]) == (409, "idempotency_conflict")


def test_a_key_needs_the_gateway_role_for_the_gateway(
    gw: ServiceProcess, admin: Client, model: str
) -> None:
    tag, sidecar_only = account(admin, 1_000_000, roles=("sidecar",))
    with pytest.raises(openai.PermissionDeniedError) as refused:
        sdk(gw, sidecar_only).chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=10)
    assert refused.value.code == "forbidden"
    assert isinstance(refused.value.body, dict)
    assert refused.value.body["missing_role"] == "gateway"
    assert refused.value.response.headers["x-should-retry"] == "false"
    assert ledger(admin, tag)["reserved_micros"] == 0


# -- retries -------------------------------------------------------------------------------------


def test_a_retry_never_makes_a_second_call(
    gw_faulty: ServiceProcess, admin: Client, proxy: FaultProxy, stub: StubProvider, model: str
) -> None:
    tag, key = account(admin, 1_000_000)
    proxy.delay_s = 0.6
    chat = sdk(gw_faulty, key).chat.completions
    request: dict[str, Any] = {"model": model, "messages": MESSAGES, "max_tokens": 100,
                               "extra_headers": {"Idempotency-Key": "same-call"}}
    before = provider_requests(stub)
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: chat.with_raw_response.create(**request), range(2)))
    assert answers[0].parse().id == answers[1].parse().id
    assert sorted(a.headers.get("x-ceiling-replayed", "") for a in answers) == ["", "true"]
    later = chat.with_raw_response.create(**request)
    assert (later.parse().id, later.headers["x-ceiling-replayed"]) == (answers[0].parse().id,
                                                                     "true")
    assert provider_requests(stub) - before == 1
    assert ledger(admin, tag)["committed_micros"] == billed(stub, model).cost_micros
    # The same key for another request is refused, and the SDK does not retry it.
    transport, sent = counting_client()
    with pytest.raises(openai.ConflictError) as conflict:
        sdk(gw_faulty, key, max_retries=2, http_client=transport).chat.completions.create(
            **{**request, "max_tokens": 101})
    assert conflict.value.code == "idempotency_conflict"
    assert conflict.value.response.headers["x-should-retry"] == "false"
    assert len(sent) == 1


def test_a_streaming_retry_of_a_running_call_is_told_to_come_back(
    gw_faulty: ServiceProcess, admin: Client, proxy: FaultProxy, stub: StubProvider, model: str
) -> None:
    _, key = account(admin, 1_000_000)
    proxy.delay_s = 0.6
    chat = sdk(gw_faulty, key).chat.completions
    request: dict[str, Any] = {"model": model, "messages": MESSAGES, "max_tokens": 60,
                               "stream": True, "extra_headers": {"Idempotency-Key": "stream-1"}}
    before = provider_requests(stub)
    with ThreadPoolExecutor(1) as pool:
        original = pool.submit(lambda: [c.model_dump() for c in chat.create(**request)])
        time.sleep(0.2)
        started = time.monotonic()
        with pytest.raises(openai.ConflictError) as busy:
            chat.create(**request)
        assert time.monotonic() - started < IN_FLIGHT_WAIT_S_MAX / 2  # a stream does not wait
        chunks = original.result()
    assert busy.value.code == "idempotency_in_flight"
    assert busy.value.response.headers["retry-after"] == str(IN_FLIGHT_RETRY_AFTER_S)
    # Once finished, the stream is replayed as it was sent.
    assert [c.model_dump() for c in chat.create(**request)] == chunks
    assert provider_requests(stub) - before == 1


# -- refusals ------------------------------------------------------------------------------------


def test_a_spent_budget_is_refused_in_openais_shape_and_not_retried(
    gw: ServiceProcess, admin: Client, model: str
) -> None:
    tag, key = account(admin, 100)
    transport, sent = counting_client()
    with pytest.raises(openai.APIStatusError) as refused:
        sdk(gw, key, max_retries=2, http_client=transport).chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=100)
    error = refused.value
    assert error.status_code == 402
    assert isinstance(error.body, dict)
    assert {k: error.body[k] for k in ("type", "code", "param", "budget_id", "period")} == {
        "type": "budget_error", "code": "budget_exceeded", "param": None, "budget_id": tag,
        "period": "total"}
    assert "no room left" in error.message
    assert error.response.headers["x-should-retry"] == "false"
    assert (header(error.response, "x-ceiling-reserved-micros"),
            header(error.response, "x-ceiling-remaining-micros")) == (0, 100)
    assert len(sent) == 1


def test_a_busy_budget_is_429_which_the_sdk_retries(
    gw: ServiceProcess, admin: Client, model: str
) -> None:
    _, key = account(admin, 1_000, roles=BOTH_ROLES)
    auth = {"Authorization": f"Bearer {key}"}
    assert admin.post("/v1/reservations", headers=auth, json={"amount_micros": 900}).is_success
    transport, sent = counting_client()
    with pytest.raises(openai.RateLimitError) as busy:
        sdk(gw, key, max_retries=1, http_client=transport).chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=50)
    assert (busy.value.code, busy.value.response.headers["retry-after"]) == ("budget_busy", "1")
    assert "x-should-retry" not in busy.value.response.headers
    assert len(sent) == 2


def test_no_key_is_401_in_openais_shape(gw: ServiceProcess, model: str) -> None:
    with pytest.raises(openai.AuthenticationError) as refused:
        sdk(gw, "sk-ceil-nope").chat.completions.create(model=model, messages=MESSAGES)
    assert refused.value.code == "unauthorized"


def test_what_cannot_be_bounded_is_refused_before_anything_is_held(
    gw: ServiceProcess, admin: Client, model: str
) -> None:
    tag, key = account(admin, 1_000_000)
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        sdk(gw, key).responses.create(model=model, input="hi", previous_response_id="resp_1")
    assert (refused.value.code, refused.value.param) == ("input_unbounded",
                                                         "previous_response_id")
    # The test models have no per-image bound: an image is refused by its field, not guessed.
    with pytest.raises(openai.UnprocessableEntityError) as image:
        sdk(gw, key).chat.completions.create(model=model, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}])
    assert (image.value.code, image.value.param) == ("input_unbounded",
                                                     "messages[0].content[0].image_url.url")
    with pytest.raises(openai.UnprocessableEntityError) as unpriced:
        sdk(gw, key).chat.completions.create(model="model-of-tomorrow", messages=MESSAGES)
    assert unpriced.value.code == "model_unpriced"
    assert ledger(admin, tag)["reserved_micros"] == 0


def test_the_responses_route_forwards_prices_and_releases_what_the_provider_refuses(
    gw_faulty: ServiceProcess, admin: Client, proxy: FaultProxy, stub: StubProvider, model: str
) -> None:
    # The stub refuses the call (a 404 it is told to answer): the refusal shows the call was
    # forwarded, priced (a reservation was held and released) and relayed with its status.
    stub_control(stub.url, {"fail_status": 404, "calls": 1})
    tag, key = account(admin, 1_000_000)
    with pytest.raises(openai.NotFoundError) as missing:
        sdk(gw_faulty, key).responses.create(model=model, input="hi")
    assert missing.value.response.headers["x-ceiling-billing-outcome"] == "released"
    assert header(missing.value.response, "x-ceiling-reserved-micros") > (
        OUTPUT_TOKENS_DEFAULT * OUTPUT_MICROS)
    assert proxy.forwarded_path() == "/v1/responses"
    assert proxy.forwarded()["max_output_tokens"] == OUTPUT_TOKENS_DEFAULT
    assert ledger(admin, tag)["reserved_micros"] == 0


# -- holding less than the worst case --------------------------------------------------------------


async def test_the_p95_is_held_far_from_the_ceiling_and_the_worst_case_within_the_margin(
    gw_faulty: ServiceProcess, admin: Client, proxy: FaultProxy, stub: StubProvider,
    redis_server: RedisServer, model: str,
) -> None:
    store = RedisStore(redis_server.url)
    for _ in range(60):
        await store.observe_output(model, 20)  # p95: the 20-token bucket
    await store.close()
    proxy.output_tokens = 100  # every call runs past its p95 hold
    cap = 1_000

    def call(ceiling_micros: int) -> tuple[int, int, dict[str, Any]]:
        tag, key = account(admin, ceiling_micros)
        raw = sdk(gw_faulty, key).chat.completions.with_raw_response.create(
            model=model, messages=MESSAGES, max_tokens=cap)
        period = settled(admin, tag)
        return (header(raw, "x-ceiling-reserved-micros"), header(raw, "x-ceiling-charged-micros"),
                period)

    p95_held, charged, far = call(10_000_000)
    worst = p95_held + (cap - 20) * OUTPUT_MICROS
    # Settle charges the whole call: more than was held, recorded as overshoot.
    assert far["committed_micros"] == charged > p95_held
    assert far["overshoot_micros"] == charged - p95_held
    # The margin: after the p95 hold, the whole worst case must still be left.
    assert call(worst + p95_held)[0] == p95_held
    held, charged, near = call(worst + p95_held - 1)
    assert held == worst
    assert near["committed_micros"] == charged <= near["ceiling_micros"]
    assert billed(stub, model).cost_micros == 3 * charged


def test_a_clamped_call_is_sent_with_the_output_its_budget_can_pay(
    gw_faulty: ServiceProcess, admin: Client, proxy: FaultProxy, model: str
) -> None:
    _, probe_key = account(admin, 10_000_000)
    cap = 2_000
    request: dict[str, Any] = {"model": model, "messages": MESSAGES, "max_tokens": cap}
    worst = header(sdk(gw_faulty, probe_key).chat.completions.with_raw_response.create(
        **request), "x-ceiling-reserved-micros")
    input_micros = worst - cap * OUTPUT_MICROS
    clamp = {"X-Ceiling-Clamp": "1"}

    _, key = account(admin, input_micros + 500 * OUTPUT_MICROS)
    with pytest.raises(openai.APIStatusError) as refused:
        sdk(gw_faulty, key).chat.completions.create(**request)
    assert refused.value.code == "budget_exceeded"
    raw = sdk(gw_faulty, key).chat.completions.with_raw_response.create(
        **request, extra_headers=clamp)
    assert header(raw, "x-ceiling-clamped-output-tokens") == 500
    assert proxy.forwarded()["max_tokens"] == 500
    assert header(raw, "x-ceiling-reserved-micros") == input_micros + 500 * OUTPUT_MICROS

    _, small_key = account(admin, input_micros + (CLAMP_OUTPUT_TOKENS_MIN - 1) * OUTPUT_MICROS)
    with pytest.raises(openai.APIStatusError) as too_small:
        sdk(gw_faulty, small_key).chat.completions.create(**request, extra_headers=clamp)
    assert too_small.value.code == "budget_exceeded"


def test_a_budget_that_says_clamp_clamps_every_call_under_it(
    gw_faulty: ServiceProcess, admin: Client, proxy: FaultProxy, model: str
) -> None:
    """`clamp: true` on a budget (here the parent of the key's): every call under it behaves as
    if it sent X-Ceiling-Clamp: 1, and the definition reads it back."""
    _, probe_key = account(admin, 10_000_000)
    cap = 2_000
    request: dict[str, Any] = {"model": model, "messages": MESSAGES, "max_tokens": cap}
    worst = header(sdk(gw_faulty, probe_key).chat.completions.with_raw_response.create(
        **request), "x-ceiling-reserved-micros")
    input_micros = worst - cap * OUTPUT_MICROS
    tag = f"org:c{uuid.uuid4().hex[:10]}"
    r = admin.admin("PUT", f"/v1/admin/budgets/{tag}", json={
        "limits": [{"period": "total", "ceiling_micros": input_micros + 500 * OUTPUT_MICROS}],
        "clamp": True})
    assert r.status_code == 200, r.text
    assert admin.admin("GET", f"/v1/admin/budgets/{tag}").json()["clamp"] is True
    team = f"{tag}/team:t"
    admin.budget(team, 10_000_000)
    key = admin.key(team)["Authorization"].removeprefix("Bearer ")
    raw = sdk(gw_faulty, key).chat.completions.with_raw_response.create(**request)
    assert header(raw, "x-ceiling-clamped-output-tokens") == 500
    assert proxy.forwarded()["max_tokens"] == 500


def test_a_clamped_call_is_not_bound_by_another_models_limit(
    gw_faulty: ServiceProcess, admin: Client, proxy: FaultProxy, model: str
) -> None:
    """A clamp fits the call to its own room: another model's per_model limit on the path
    (here one micro-dollar, all but spent) is not this call's room, so the call is clamped to
    what the budget has left, not refused."""
    _, probe_key = account(admin, 10_000_000)
    cap = 2_000
    request: dict[str, Any] = {"model": model, "messages": MESSAGES, "max_tokens": cap}
    worst = header(sdk(gw_faulty, probe_key).chat.completions.with_raw_response.create(
        **request), "x-ceiling-reserved-micros")
    input_micros = worst - cap * OUTPUT_MICROS
    tag = f"org:c{uuid.uuid4().hex[:10]}"
    r = admin.admin("PUT", f"/v1/admin/budgets/{tag}", json={
        "limits": [{"period": "total", "ceiling_micros": input_micros + 500 * OUTPUT_MICROS}],
        "clamp": True,
        "per_model": {"claude-haiku-4-5": {"limits": [{"period": "total",
                                                       "ceiling_micros": 1}]}}})
    assert r.status_code == 200, r.text
    key = admin.key(tag)["Authorization"].removeprefix("Bearer ")
    raw = sdk(gw_faulty, key).chat.completions.with_raw_response.create(**request)
    assert header(raw, "x-ceiling-clamped-output-tokens") == 500
    assert proxy.forwarded()["max_tokens"] == 500


def test_a_run_has_its_remaining_budget_in_every_answer(
    gw: ServiceProcess, admin: Client, model: str
) -> None:
    _, key = account(admin, 1_000_000, run_ceiling_micros=50_000)
    raw = sdk(gw, key).chat.completions.with_raw_response.create(
        model=model, messages=MESSAGES, max_tokens=100,
        extra_headers={"X-Ceiling-Run-Id": "agent-1"})
    charged = header(raw, "x-ceiling-charged-micros")
    assert header(raw, "x-ceiling-run-remaining-micros") == 50_000 - charged
    assert header(raw, "x-ceiling-remaining-micros") == 1_000_000 - charged


# -- under load ----------------------------------------------------------------------------------

LOAD_CLIENTS = 25
LOAD_S_MAX = 45.0
LOAD_CEILING_MICROS = 40_000
# A client stops after this many budget_exceeded refusals: the ceiling has been reached.
LOAD_REFUSALS_MAX = 3


async def test_25_sdk_clients_never_push_the_providers_bill_past_the_ceiling(
    gw: ServiceProcess, admin: Client, stub: StubProvider, model: str
) -> None:
    """Random output caps and lengths, streams, streams cancelled after a chunk or three, and
    retries (concurrent duplicates under one Idempotency-Key, and the SDK's own retries of
    `budget_busy`), until the budget refuses every client. Holds here are the worst case (the
    model's p95 is not trusted within a test: see core.gateway.hold for why a p95 hold cannot
    promise this under concurrency)."""
    tag, key = account(admin, LOAD_CEILING_MICROS)
    deadline = time.monotonic() + LOAD_S_MAX
    seen: Counter[str] = Counter()

    async def client(seed: int) -> None:
        rng = random.Random(seed)
        chat = async_sdk(gw, key, max_retries=1).chat.completions
        refusals = 0
        while refusals < LOAD_REFUSALS_MAX and time.monotonic() < deadline:
            kind = rng.choice(("plain", "stream", "cancel", "retry"))
            request: dict[str, Any] = {
                "model": model, "max_tokens": rng.randint(16, 400),
                "messages": [{"role": "user", "content": "x" * rng.randint(1, 300)}]}
            try:
                if kind == "plain":
                    await chat.create(**request)
                elif kind == "stream":
                    [_ async for _ in await chat.create(**request, stream=True)]
                elif kind == "cancel":
                    stream = await chat.create(**request, stream=True)
                    async for _ in stream:
                        if rng.random() < 0.5:
                            break
                    await stream.close()
                else:
                    once = {"Idempotency-Key": uuid.uuid4().hex}
                    pair = await asyncio.gather(
                        *(chat.create(**request, extra_headers=once) for _ in range(2)),
                        return_exceptions=True)
                    ids = {a.id for a in pair if not isinstance(a, BaseException)}
                    assert len(ids) <= 1
                    if not ids:
                        raise next(e for e in pair if isinstance(e, BaseException))
                seen["provider_calls"] += 1
            except openai.APIStatusError as refused:
                seen[str(refused.code)] += 1
                refusals += refused.code == "budget_exceeded"

    await asyncio.gather(*(client(i) for i in range(LOAD_CLIENTS)))
    period = await asyncio.to_thread(settled, admin, tag)
    bill = billed(stub, model)
    assert set(seen) <= {"provider_calls", "budget_exceeded", "budget_busy"}, seen
    assert seen["budget_exceeded"] > 0  # the ceiling was reached
    assert bill.cost_micros <= LOAD_CEILING_MICROS  # overrun 0% by the provider's bill
    assert (period["committed_micros"], period["reserved_micros"]) == (bill.cost_micros, 0)
    assert bill.calls == seen["provider_calls"]  # one provider call per idempotent pair
    with contextlib.suppress(Exception):
        print(f"\nload: {dict(seen)}, billed {bill.cost_micros} of {LOAD_CEILING_MICROS}")
