"""The stub provider is the witness the proof trusts: it must bill exactly what it served."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from core.estimate import input_tokens_upper_bound
from core.prices import PriceTable, Usage
from infra.redis_server import free_port
from infra.stub_provider import Bill, StubProvider, fetch_bill, reset_bill

CHAT = "/v1/chat/completions"
PRICES = PriceTable()


@pytest.fixture(scope="module")
def provider() -> Iterator[StubProvider]:
    with StubProvider(seed=3, latency_ms_min=0, latency_ms_max=5) as stub:
        yield stub


@pytest.fixture(scope="module")
def http(provider: StubProvider) -> Iterator[httpx.Client]:
    # One client: building an httpx client costs ~60 ms (its SSL context), a call a millisecond.
    with httpx.Client(base_url=provider.url, timeout=10.0) as client:
        yield client


@pytest.fixture(autouse=True)
def fresh_bill(http: httpx.Client) -> None:
    http.post("/control", json={}).raise_for_status()
    http.post("/billing/reset").raise_for_status()


def chat(model: str = "gpt-4o", content: str = "hello", max_tokens: int = 300,
         **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, **extra}


def usage_of(doc: dict[str, Any]) -> Usage:
    u = doc["usage"]
    return Usage(u["prompt_tokens"], u["completion_tokens"],
                 u["prompt_tokens_details"]["cached_tokens"])


def bill_of(http: httpx.Client) -> Bill:
    return Bill.from_json(http.get("/billing").json())


def stream_events(http: httpx.Client, body: dict[str, Any]) -> list[Any]:
    with http.stream("POST", CHAT, json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_the_bill_is_the_sum_of_what_was_served_priced_at_real_rates(
    http: httpx.Client,
) -> None:
    expected_micros, served = 0, []
    for i in range(12):
        model = ("gpt-4o", "gpt-4o-mini", "claude-sonnet-4-5")[i % 3]
        doc = http.post(CHAT, json=chat(model, "word " * i)).json()
        usage = usage_of(doc)
        expected_micros += PRICES.cost_micros(model, usage)
        served.append(usage)
    bill = bill_of(http)
    assert bill.requests == bill.total.calls == 12
    assert bill.total.cost_micros == expected_micros
    assert bill.total.input_tokens == sum(u.input_tokens for u in served)
    assert bill.total.output_tokens == sum(u.output_tokens for u in served)
    assert sum(t.cost_micros for t in bill.by_model.values()) == expected_micros
    assert {m: t.calls for m, t in bill.by_model.items()} == {
        "claude-sonnet-4-5": 4, "gpt-4o": 4, "gpt-4o-mini": 4}


def test_reset_starts_a_new_bill(provider: StubProvider, http: httpx.Client) -> None:
    http.post(CHAT, json=chat()).raise_for_status()
    assert fetch_bill(provider.url).total.calls == 1
    reset_bill(provider.url)
    bill = fetch_bill(provider.url)
    assert (bill.requests, bill.total.calls, bill.total.cost_micros, bill.by_model) == (0, 0, 0, {})


@pytest.mark.parametrize("cap_field", ["max_tokens", "max_completion_tokens"])
def test_output_never_exceeds_the_cap(http: httpx.Client, cap_field: str) -> None:
    for _ in range(30):
        body = {k: v for k, v in chat().items() if k != "max_tokens"} | {cap_field: 40}
        doc = http.post(CHAT, json=body).json()
        tokens = doc["usage"]["completion_tokens"]
        assert 1 <= tokens <= 40
        assert len(doc["choices"][0]["message"]["content"].split(" ")) == tokens
        assert doc["choices"][0]["finish_reason"] == ("length" if tokens == 40 else "stop")


def test_forced_output_tokens_are_exact_and_still_capped(http: httpx.Client) -> None:
    forced = {"X-Stub-Output-Tokens": "77"}
    exact = http.post(CHAT, json=chat(max_tokens=100), headers=forced).json()
    capped = http.post(CHAT, json=chat(max_tokens=50), headers=forced).json()
    assert exact["usage"]["completion_tokens"] == 77
    assert capped["usage"]["completion_tokens"] == 50


def test_prompt_tokens_stay_within_the_services_upper_bound(http: httpx.Client) -> None:
    for messages in (
        [{"role": "user", "content": "x"}],
        [{"role": "system", "content": "Be brief. " * 50},
         {"role": "user", "content": "Grüße, 世界 🌍 " * 20}],
        [{"role": "user", "content": [{"type": "text", "text": "parts " * 30}]}],
    ):
        doc = http.post(CHAT, json={"model": "gpt-4o", "messages": messages,
                                                    "max_tokens": 5}).json()
        assert 0 < doc["usage"]["prompt_tokens"] <= input_tokens_upper_bound(messages)


def test_a_seed_makes_sequential_calls_reproducible() -> None:
    def draws(seed: int) -> list[int]:
        with (StubProvider(seed=seed, latency_ms_min=0, latency_ms_max=0) as stub,
              httpx.Client(base_url=stub.url) as client):
            return [client.post(CHAT, json=chat(max_tokens=4_000)).json()["usage"]
                    ["completion_tokens"] for _ in range(8)]

    assert draws(11) == draws(11)
    assert draws(11) != draws(12)


def test_a_stream_carries_usage_in_its_last_chunk_when_asked(http: httpx.Client) -> None:
    events = stream_events(http, chat(max_tokens=100, stream=True,
                                              stream_options={"include_usage": True}))
    *content_chunks, usage_chunk = events
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in content_chunks)
    assert usage_chunk["choices"] == []
    usage = usage_of(usage_chunk)
    assert len(text.split(" ")) == usage.output_tokens
    assert content_chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    bill = bill_of(http)
    assert bill.total.calls == 1
    assert bill.total.cost_micros == PRICES.cost_micros("gpt-4o", usage)


def test_a_stream_without_include_usage_has_no_usage_but_is_billed(
    http: httpx.Client,
) -> None:
    events = stream_events(http, chat(stream=True))
    assert all("usage" not in e and e["choices"] for e in events)
    assert bill_of(http).total.calls == 1


def test_a_hung_call_never_answers_and_is_not_billed(http: httpx.Client) -> None:
    with pytest.raises(httpx.ReadTimeout):
        http.post(CHAT, json=chat(), headers={"X-Stub-Hang": "1"}, timeout=0.3)
    bill = bill_of(http)
    assert (bill.requests, bill.total.calls) == (1, 0)


@pytest.mark.parametrize("status", [429, 500, 503])
def test_a_failure_header_answers_that_status_unbilled(http: httpx.Client, status: int) -> None:
    response = http.post(CHAT, json=chat(),
                          headers={"X-Stub-Fail-Status": str(status)})
    assert response.status_code == status
    assert response.json()["error"]["code"] == "stub_failure"
    bill = bill_of(http)
    assert (bill.requests, bill.total.calls, bill.total.cost_micros) == (1, 0, 0)


def test_the_control_route_fails_the_next_calls_then_recovers(http: httpx.Client) -> None:
    http.post("/control", json={"fail_status": 502, "calls": 2}).raise_for_status()
    statuses = [http.post(CHAT, json=chat()).status_code for _ in range(3)]
    assert statuses == [502, 502, 200]
    assert http.get("/control").json()["calls"] == 0


def test_the_control_route_hangs_until_cleared(http: httpx.Client) -> None:
    http.post("/control", json={"hang": True}).raise_for_status()
    for _ in range(2):
        with pytest.raises(httpx.ReadTimeout):
            http.post(CHAT, json=chat(), timeout=0.3)
    http.post("/control", json={}).raise_for_status()
    assert http.post(CHAT, json=chat()).status_code == 200
    bill = bill_of(http)
    assert (bill.requests, bill.total.calls) == (3, 1)


@pytest.mark.parametrize("body", [{"fail_status": 200}, {"hang": True, "fail_status": 500},
                                  {"calls": 0, "hang": True}, {"other": 1}])
def test_the_control_route_refuses_nonsense(http: httpx.Client, body: Any) -> None:
    assert http.post("/control", json=body).status_code == 400


@pytest.mark.parametrize(("body", "status", "code"), [
    (chat(model="no-such-model-anywhere"), 404, "model_not_found"),
    (chat(n=2), 400, "invalid_request"),
    ({"model": "gpt-4o", "messages": []}, 400, "invalid_request"),
    (chat(max_tokens=0), 400, "invalid_request"),
])
def test_what_it_cannot_serve_is_refused_unbilled(
    http: httpx.Client, body: dict[str, Any], status: int, code: str
) -> None:
    response = http.post(CHAT, json=body)
    assert (response.status_code, response.json()["error"]["code"]) == (status, code)
    assert bill_of(http).total.calls == 0


def test_a_required_api_key_is_checked_before_billing() -> None:
    with StubProvider(api_key="sk-upstream", latency_ms_min=0, latency_ms_max=0) as stub:
        assert httpx.post(stub.url + CHAT, json=chat()).status_code == 401
        ok = httpx.post(stub.url + CHAT, json=chat(),
                        headers={"Authorization": "Bearer sk-upstream"})
        assert ok.status_code == 200
        assert fetch_bill(stub.url).total.calls == 1


def test_it_runs_as_its_own_process() -> None:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "infra.stub_provider", "--port", str(port), "--seed", "5"],
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"{url}/health/live", timeout=0.5).status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the stub provider did not start"
                time.sleep(0.05)
        assert httpx.post(url + CHAT, json=chat()).status_code == 200
        assert fetch_bill(url).total.calls == 1
    finally:
        os.kill(process.pid, signal.SIGTERM)
        process.wait(timeout=10)
