"""Booking unseen spend end to end: calls made straight to the stub provider with its own key (the
spend no gateway sees: a console, a script, a tool that bypassed it), then `ceiling reconcile
... --book-into` and GET /v1/admin/reconcile?book_into= against the stub's cost reports, in
OpenAI's dollars and Anthropic's cents, on a real redis-server.

The judge is the stub's bill: what is booked must be exactly what the stub billed for the calls
that did not go through the gateway, once; a later report with more such spend books exactly the
new calls' cost; and the next gateway call that no longer fits is refused before the stub sees
it (its call log does not grow).

A Redis of this module's own: the ledger's gateway spend per day, and what is booked for it, are
ledger-wide; another module's calls on a shared Redis would be in them, not on this stub's bill.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from infra.stub_costs import cost_control
from infra.stub_provider import StubProvider, fetch_bill
from tests.api.conftest import ADMIN_TOKEN, Client, account, as_key, client_for
from tests.api.test_cli import ceiling

ADMIN_KEY = "sk-admin-of-the-provider"
HELLO: list[Any] = [{"role": "user", "content": "hello"}]
# The budget each provider's test books into: small enough that a few dozen of the stub's calls
# made around the gateway leave it no room.
CEILING_MICROS = 40_000
DIRECT_CALLS_MAX = 400
SETTLE_WAIT_S_MAX = 10.0
MODEL = {"openai": "gpt-4o", "anthropic": "claude-haiku-4-5"}
# The budget the scheduled run books into (CEILING_RECONCILE_BOOK_INTO).
SCHEDULE_BUDGET = "org:scheduled-bill"


@pytest.fixture(scope="module")
def ledger_redis() -> Iterator[RedisServer]:
    with RedisServer(durable=True) as server:
        yield server


@pytest.fixture(scope="module")
def stub() -> Iterator[StubProvider]:
    with StubProvider(seed=38, latency_ms_min=0, latency_ms_max=1, output_tokens_mean=80,
                      admin_key=ADMIN_KEY) as provider:
        yield provider


def report_env(stub: StubProvider) -> dict[str, str]:
    return {"CEILING_OPENAI_ADMIN_KEY": ADMIN_KEY, "CEILING_OPENAI_ADMIN_URL": stub.url,
            "CEILING_ANTHROPIC_ADMIN_KEY": ADMIN_KEY, "CEILING_ANTHROPIC_ADMIN_URL": stub.url}


@pytest.fixture(scope="module")
def gw(ledger_redis: RedisServer, stub: StubProvider) -> Iterator[ServiceProcess]:
    with ServiceProcess({
        "REDIS_URL": ledger_redis.url, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN,
        "CEILING_UPSTREAM_URL": f"{stub.url}/v1", "CEILING_ANTHROPIC_URL": stub.url,
        # The stub stands in for the providers themselves: their bills.
        "CEILING_UPSTREAM_BILL": "openai", "CEILING_ANTHROPIC_BILL": "anthropic",
        "CEILING_UPSTREAM_TIMEOUT_S": "30", "CEILING_RECONCILE_BOOK_INTO": SCHEDULE_BUDGET,
        **report_env(stub),
    }) as service:
        yield service


@pytest.fixture(scope="module")
def admin(gw: ServiceProcess) -> Iterator[Client]:
    with client_for(gw) as c:
        yield c


@pytest.fixture(autouse=True)
def agreeing_reports(stub: StubProvider) -> Iterator[None]:
    cost_control(stub.url, {})
    yield
    cost_control(stub.url, {})


def today() -> str:
    return datetime.now(UTC).date().isoformat()


def yesterday() -> str:
    return (datetime.now(UTC).date() - timedelta(days=1)).isoformat()


def gateway_call(gw: ServiceProcess, provider: str, key: str) -> httpx.Response:
    body = {"model": MODEL[provider], "max_tokens": 60, "messages": HELLO}
    if provider == "openai":
        return httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers=as_key(key),
                          timeout=30)
    return httpx.post(f"{gw.url}/v1/messages", json=body, timeout=30,
                      headers={"x-api-key": key, "anthropic-version": "2023-06-01"})


def direct_calls(stub: StubProvider, provider: str, count: int) -> int:
    """`count` calls straight to the provider, around the gateway: what the stub billed them."""
    before = len(fetch_bill(stub.url).log)
    body = {"model": MODEL[provider], "max_tokens": 200, "messages": HELLO}
    path = "/v1/chat/completions" if provider == "openai" else "/v1/messages"
    with httpx.Client(base_url=stub.url, timeout=30) as client:
        for _ in range(count):
            r = client.post(path, json=body, headers={
                "authorization": "Bearer sk-direct", "x-api-key": "sk-direct",
                "anthropic-version": "2023-06-01"})
            assert r.status_code == 200, r.text
    made = list(fetch_bill(stub.url).log)[before:]
    assert len(made) == count
    assert all(c.billed for c in made)
    return sum(c.cost_micros for c in made)


def committed(admin: Client, budget_id: str) -> int:
    r = admin.admin("GET", f"/v1/admin/budgets/{budget_id}")
    assert r.status_code == 200, r.text
    (total,) = [p for p in r.json()["periods"] if p["period"] == "total"]
    return int(total["committed_micros"])


def route(admin: Client, provider: str, **params: str) -> dict[str, Any]:
    r = admin.admin("GET", "/v1/admin/reconcile",
                    params={"provider": provider, "from": today(), "to": today(), **params})
    assert r.status_code == 200, r.text
    return dict(r.json())


def settled(admin: Client, provider: str, budget_id: str, spent: int) -> None:
    """Wait until the gateway's calls are settled: the budget holds what they cost."""
    deadline = time.monotonic() + SETTLE_WAIT_S_MAX
    while committed(admin, budget_id) != spent and time.monotonic() < deadline:
        time.sleep(0.05)
    assert committed(admin, budget_id) == spent


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_unseen_spend_is_booked_once_then_the_difference_then_the_gateway_refuses(
    provider: str, gw: ServiceProcess, admin: Client, stub: StubProvider,
    ledger_redis: RedisServer
) -> None:
    budget_id, key = account(admin, CEILING_MICROS)
    # A call through the gateway: the ledger sees it, and the provider bills it. The day's
    # count is the whole ledger's (this module's other calls too): it grows by what the stub
    # billed the call.
    saw_before = route(admin, provider)["days"][0]["ledger_micros"]
    log_before = len(fetch_bill(stub.url).log)
    r = gateway_call(gw, provider, key)
    assert r.status_code == 200, r.text
    through = list(fetch_bill(stub.url).log)[log_before:]
    assert len(through) == 1
    settled(admin, provider, budget_id, through[0].cost_micros)
    ledger_saw = saw_before + through[0].cost_micros
    assert route(admin, provider)["days"][0]["ledger_micros"] == ledger_saw

    # Spend the gateway never saw: booked, exactly as the stub billed it, once.
    unseen = direct_calls(stub, provider, 3)
    done = ceiling(ledger_redis, "reconcile", provider, "--from", today(), "--to", today(),
                   "--book-into", budget_id, "--json", env=report_env(stub))
    assert done.returncode == 3, done.stderr  # the drift still shows: booked is not "seen"
    doc = json.loads(done.stdout)
    (day,) = doc["days"]
    assert (doc["book_into"], day["booked_now_micros"], day["booked_micros"]) == (
        budget_id, unseen, unseen)
    assert day["ledger_micros"] == ledger_saw
    assert committed(admin, budget_id) == through[0].cost_micros + unseen

    # Again, by the route: nothing new, nothing booked.
    again = route(admin, provider, book_into=budget_id)
    assert (again["booked_now_micros"], again["days"][0]["booked_micros"]) == (0, unseen)
    assert committed(admin, budget_id) == through[0].cost_micros + unseen

    # More spend around the gateway, past what the budget has left: only it is booked.
    more, calls = 0, 0
    while through[0].cost_micros + unseen + more <= CEILING_MICROS:
        more += direct_calls(stub, provider, 1)
        calls += 1
        assert calls < DIRECT_CALLS_MAX
    later = route(admin, provider, book_into=budget_id)
    assert (later["booked_now_micros"], later["days"][0]["booked_micros"]) == (
        more, unseen + more)
    assert committed(admin, budget_id) == through[0].cost_micros + unseen + more

    # The next gateway call no longer fits: refused before the provider sees anything.
    calls_before = len(fetch_bill(stub.url).log)
    refused = gateway_call(gw, provider, key)
    assert refused.status_code == 402, refused.text
    assert "budget_exceeded" in refused.text
    assert len(fetch_bill(stub.url).log) == calls_before

    # One ledger.unseen_booked event per booking, naming the provider, the day and the amount.
    r = admin.admin("GET", "/v1/admin/alerts")
    assert r.status_code == 200, r.text
    events = [e for e in r.json()["alerts"]
              if e["type"] == "ledger.unseen_booked" and e["budget_id"] == budget_id]
    assert sorted((e["provider"], e["day"], e["booked_micros"]) for e in events) == sorted([
        (provider, today(), unseen), (provider, today(), more)])
    # And one audit entry per booking.
    r = admin.admin("GET", "/v1/admin/audit")
    assert r.status_code == 200, r.text
    audited = [e for e in r.json()["items"]
               if e["what"] == "ledger.unseen_booked" and e["target"] == budget_id]
    assert sorted(e["detail"]["booked_micros"] for e in audited) == sorted([unseen, more])


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_two_processes_at_once_book_a_day_once(
    provider: str, admin: Client, stub: StubProvider, ledger_redis: RedisServer
) -> None:
    """After the test above booked every call of today around the gateway: two `ceiling
    reconcile --book-into` at once, each its own process and connection, book the new calls'
    cost once between them."""
    budget_id, _ = account(admin, 10_000_000)
    unseen = direct_calls(stub, provider, 2)
    env = {**os.environ, "REDIS_URL": ledger_redis.url, **report_env(stub)}
    runs = [subprocess.Popen(
        [sys.executable, "-m", "api.cli", "reconcile", provider, "--from", today(), "--to",
         today(), "--book-into", budget_id, "--json"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    booked = []
    for run in runs:
        out, err = run.communicate(timeout=60)
        assert run.returncode == 3, (out, err)
        booked.append(json.loads(out)["booked_now_micros"])
    assert sorted(booked) == [0, unseen]
    assert committed(admin, budget_id) == unseen


def test_a_key_cannot_book(gw: ServiceProcess, admin: Client) -> None:
    budget_id, key = account(admin, CEILING_MICROS)
    before = committed(admin, budget_id)
    r = httpx.get(f"{gw.url}/v1/admin/reconcile", headers=as_key(key), timeout=30, params={
        "provider": "openai", "from": today(), "to": today(), "book_into": budget_id})
    assert r.status_code == 401, r.text
    assert committed(admin, budget_id) == before


@pytest.mark.parametrize(("book_into", "status", "code"), [
    ("org:nobody-here", 404, "budget_not_found"),
    ("org:a/run:batch", 422, "invalid_request"),
    ("org:a/user:bob", 422, "invalid_request"),
])
def test_a_budget_that_is_not_one_to_book_into_is_refused(
    admin: Client, book_into: str, status: int, code: str
) -> None:
    r = admin.admin("GET", "/v1/admin/reconcile", params={
        "provider": "anthropic", "from": today(), "to": today(), "book_into": book_into})
    assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text


@pytest.mark.parametrize("mode", ["error", "non_usd", "malformed"])
@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_a_report_that_cannot_be_read_books_nothing(
    provider: str, mode: str, admin: Client, stub: StubProvider
) -> None:
    budget_id, _ = account(admin, CEILING_MICROS)
    direct_calls(stub, provider, 1)
    cost_control(stub.url, {"mode": mode})
    r = admin.admin("GET", "/v1/admin/reconcile", params={
        "provider": provider, "from": today(), "to": today(), "book_into": budget_id})
    assert r.json()["error"]["code"] == "cost_report_failed", r.text
    assert committed(admin, budget_id) == 0


def test_the_scheduled_run_books_into_its_setting_once(
    admin: Client, stub: StubProvider
) -> None:
    """GET /v1/admin/reconcile with no parameter is the daily schedule's run: the week up to
    yesterday, booked into CEILING_RECONCILE_BOOK_INTO. Yesterday's bill is the stub's
    `billed_elsewhere` (the stub started today), in dollars and in cents."""
    admin.budget(SCHEDULE_BUDGET, 10_000_000)
    billed = {"openai": 123_457, "anthropic": 7_891}
    cost_control(stub.url, {"billed_elsewhere": [
        {"provider": p, "day": yesterday(), "cost_micros": c} for p, c in billed.items()]})
    for booked_now in (billed, {"openai": 0, "anthropic": 0}):
        r = admin.admin("GET", "/v1/admin/reconcile")
        assert r.status_code == 200, r.text
        providers = r.json()["providers"]
        for provider, micros in booked_now.items():
            assert providers[provider] == {
                "within": False, "days_beyond": [yesterday()], "book_into": SCHEDULE_BUDGET,
                "booked_now_micros": micros}, providers
    assert committed(admin, SCHEDULE_BUDGET) == sum(billed.values())


@pytest.mark.parametrize(("setting", "code"), [
    ("org:x/run:r1", "invalid_configuration"),  # no budget an operator can name
    ("org:never-put", "budget_not_found"),  # deleted, or never put
])
def test_a_bad_booking_setting_fails_the_booking_loudly_not_the_drift_check(
    ledger_redis: RedisServer, stub: StubProvider, setting: str, code: str, tmp_path: Path
) -> None:
    """The daily drift check runs (and says what it found) whatever CEILING_RECONCILE_BOOK_INTO
    says; the booking fails, and says so in the answer and the log."""
    cost_control(stub.url, {"billed_elsewhere": [
        {"provider": p, "day": yesterday(), "cost_micros": 5_555} for p in MODEL]})
    log = tmp_path / "service.log"
    with ServiceProcess({
        "REDIS_URL": ledger_redis.url, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN,
        "CEILING_RECONCILE_BOOK_INTO": setting, **report_env(stub),
    }, log_path=str(log)) as service, client_for(service) as c:
        r = c.admin("GET", "/v1/admin/reconcile")
    assert r.status_code == 200, r.text
    assert r.json()["booking_failed"] is True
    for provider in MODEL:
        outcome = r.json()["providers"][provider]
        assert (outcome["within"], outcome["days_beyond"]) == (False, [yesterday()]), outcome
        assert outcome["booking_error"]["code"] == code, outcome
        assert "book_into" not in outcome
    assert "unseen spend was not booked" in log.read_text()
