"""Reconciliation end to end: calls through both gateways against the stub provider, then
`ceiling reconcile` and GET /v1/admin/reconcile against the stub's cost reports.

The judge is the stub's bill, never the service's numbers or core.prices: the stub's reports
are built from what it billed per UTC day (infra/stub_costs.py), in each provider's format
(OpenAI's dollars, Anthropic's cents as strings). Reports that agree exit 0; reports of twice
the bill exit 3 naming the day and the drift, and put one `ledger.drift` event per provider,
delivered once, signed, however many times the drift is found.

A Redis of this module's own: the ledger's gateway spend per day is ledger-wide, and other
modules' gateway calls on a shared Redis would be in it, but not on this stub's bill.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from infra.alert_receiver import AlertReceiver
from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from infra.stub_costs import cost_control
from infra.stub_provider import StubProvider, fetch_bill
from tests.api.conftest import ADMIN_TOKEN, Client, account, anthropic_sdk, client_for, sdk
from tests.api.test_cli import ceiling

ADMIN_KEY = "sk-admin-of-the-provider"
SECRET = "whsec-reconcile"
HELLO: list[Any] = [{"role": "user", "content": "hello"}]
DELIVERY_WAIT_S_MAX = 15.0
# Which gateway API bills on which provider's report.
APIS = {"openai": ("chat.completions", "responses"), "anthropic": ("messages",)}


@pytest.fixture(scope="module")
def ledger_redis() -> Iterator[RedisServer]:
    with RedisServer(durable=True) as server:
        yield server


@pytest.fixture(scope="module")
def stub() -> Iterator[StubProvider]:
    with StubProvider(seed=30, latency_ms_min=0, latency_ms_max=2, output_tokens_mean=80,
                      admin_key=ADMIN_KEY) as provider:
        yield provider


@pytest.fixture(scope="module")
def receiver() -> Iterator[AlertReceiver]:
    with AlertReceiver() as r:
        yield r


def report_env(stub: StubProvider) -> dict[str, str]:
    return {"CEILING_OPENAI_ADMIN_KEY": ADMIN_KEY, "CEILING_OPENAI_ADMIN_URL": stub.url,
            "CEILING_ANTHROPIC_ADMIN_KEY": ADMIN_KEY, "CEILING_ANTHROPIC_ADMIN_URL": stub.url}


@pytest.fixture(scope="module")
def gw(ledger_redis: RedisServer, stub: StubProvider,
       receiver: AlertReceiver) -> Iterator[ServiceProcess]:
    with ServiceProcess({
        "REDIS_URL": ledger_redis.url, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN,
        "CEILING_UPSTREAM_URL": f"{stub.url}/v1", "CEILING_ANTHROPIC_URL": stub.url,
        # The stub stands in for the providers themselves: their bills.
        "CEILING_UPSTREAM_BILL": "openai", "CEILING_ANTHROPIC_BILL": "anthropic",
        "CEILING_UPSTREAM_TIMEOUT_S": "30", "CEILING_ALERT_WEBHOOK_URL": receiver.url,
        "CEILING_ALERT_WEBHOOK_SECRET": SECRET, "CEILING_ALERT_DELIVERY_INTERVAL_S": "0.2",
        **report_env(stub),
    }) as service:
        yield service


@pytest.fixture(scope="module")
def admin(gw: ServiceProcess) -> Iterator[Client]:
    with client_for(gw) as c:
        yield c


@pytest.fixture(scope="module")
def spent(gw: ServiceProcess, admin: Client, stub: StubProvider,
          ledger_redis: RedisServer) -> dict[str, int]:
    """Calls through every gateway route, streamed and not; what the stub billed, per
    provider."""
    _, key = account(admin, 10_000_000)
    openai = sdk(gw, key)
    for _ in range(2):
        openai.chat.completions.create(model="gpt-4o", max_tokens=60, messages=HELLO)
    list(openai.chat.completions.create(model="gpt-4o-mini", max_tokens=60, messages=HELLO,
                                        stream=True))
    openai.responses.create(model="gpt-4o", max_output_tokens=60, input="hello")
    claude = anthropic_sdk(gw, key)
    for _ in range(2):
        claude.messages.create(model="claude-haiku-4-5", max_tokens=60, messages=HELLO)
    with claude.messages.stream(model="claude-haiku-4-5", max_tokens=60,
                                messages=HELLO) as stream:
        stream.get_final_message()
    billed = {provider: 0 for provider in APIS}
    deadline = time.monotonic() + DELIVERY_WAIT_S_MAX
    while True:
        log = fetch_bill(stub.url).log
        for provider, apis in APIS.items():
            billed[provider] = sum(c.cost_micros for c in log if c.billed and c.api in apis)
        # A stream settles after its last byte: wait until the ledger has booked every call.
        booked = {provider: json.loads(ceiling(
            ledger_redis, "reconcile", provider, "--from", today(), "--json",
            env=report_env(stub)).stdout or "{}").get("days", [{}])[-1].get("ledger_micros")
            for provider in APIS}
        if booked == billed or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert sum(1 for c in log if c.billed) == 7
    assert all(billed.values())
    return billed


def today() -> str:
    return datetime.now(UTC).date().isoformat()


@pytest.fixture(autouse=True)
def agreeing_reports(stub: StubProvider) -> Iterator[None]:
    cost_control(stub.url, {})
    yield
    cost_control(stub.url, {})


def drift_events(receiver: AlertReceiver, count: int) -> list[Any]:
    deadline = time.monotonic() + DELIVERY_WAIT_S_MAX
    while True:
        found = [p for p in list(receiver.posts)
                 if p.status == 200 and p.json()["type"] == "ledger.drift"]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


# -- the tests --------------------------------------------------------------------------------


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_reports_that_agree_with_the_ledger_exit_0(
    provider: str, spent: dict[str, int], ledger_redis: RedisServer, stub: StubProvider
) -> None:
    done = ceiling(ledger_redis, "reconcile", provider, "--from", today(), "--to",
                   today(), "--json", env=report_env(stub))
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc == {"provider": provider, "tolerance_pct": 1.0, "within": True, "days": [
        {"day": today(), "ledger_micros": spent[provider], "provider_micros": spent[provider],
         "drift_micros": 0, "drift_pct": 0.0, "within": True}]}
    table = ceiling(ledger_redis, "reconcile", provider, "--from", today(),
                    env=report_env(stub))
    assert table.returncode == 0, table.stderr
    usd = f"{spent[provider] // 1_000_000}.{spent[provider] % 1_000_000:06d}"
    assert f"{today()}" in table.stdout
    assert table.stdout.count(usd) == 2  # the ledger's and the provider's


def test_reports_of_twice_the_bill_exit_3_naming_the_day_and_the_drift_and_alert_once(
    spent: dict[str, int], ledger_redis: RedisServer, stub: StubProvider, admin: Client,
    receiver: AlertReceiver
) -> None:
    cost_control(stub.url, {"scale": "2", "buckets_per_page_max": 1})
    env = {**os.environ, "REDIS_URL": ledger_redis.url, **report_env(stub)}
    # `ceiling reconcile` as an operator's shell (or a cron) runs it: its own process.
    runs = {provider: subprocess.Popen(
        [sys.executable, "-m", "api.cli", "reconcile", provider, "--from", today()],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for provider in APIS}
    for provider, run in runs.items():
        out, err = run.communicate(timeout=60)
        assert run.returncode == 3, (out, err)
        drift = spent[provider]  # the report says twice the bill: the drift is the bill
        usd = f"{drift // 1_000_000}.{drift % 1_000_000:06d}"
        assert f"beyond tolerance: {today()} drift +${usd} (50.00%)" in out
    # The route finds the same drift, and answers it; the events are not put again.
    for provider in APIS:
        r = admin.admin("GET", "/v1/admin/reconcile",
                        params={"provider": provider, "from": today(), "to": today()})
        assert r.status_code == 200, r.text
        assert r.json()["within"] is False
        assert r.json()["days"][0]["drift_micros"] == spent[provider]
    events = drift_events(receiver, 2)
    time.sleep(1.0)  # five more delivery passes: nothing more arrives
    events = drift_events(receiver, 2)
    assert sorted(p.json()["provider"] for p in events) == ["anthropic", "openai"]
    for post in events:
        body = post.json()
        provider = body["provider"]
        assert post.signed_by(SECRET)
        assert (body["day"], body["ledger_micros"], body["provider_micros"]) == (
            today(), spent[provider], 2 * spent[provider])
    assert len({p.json()["event_id"] for p in events}) == 2


def test_the_route_answers_the_document_and_takes_a_tolerance(
    spent: dict[str, int], admin: Client, stub: StubProvider
) -> None:
    cost_control(stub.url, {"scale": "1.005"})
    params = {"provider": "anthropic", "from": today(), "to": today()}
    r = admin.admin("GET", "/v1/admin/reconcile", params=params)
    assert r.status_code == 200, r.text
    [day] = r.json()["days"]
    assert set(r.json()) == {"provider", "tolerance_pct", "days", "within"}
    assert set(day) == {"day", "ledger_micros", "provider_micros", "drift_micros", "drift_pct",
                        "within"}
    assert day["within"] is True  # half a percent
    strict = admin.admin("GET", "/v1/admin/reconcile", params={**params, "tolerance_pct": "0.1"})
    assert strict.json()["within"] is False
    assert strict.json()["tolerance_pct"] == 0.1
    assert admin.get("/v1/admin/reconcile", params=params).status_code == 401
    assert admin.admin("GET", "/v1/admin/reconcile",
                       params={"provider": "bedrock"}).status_code == 422
    assert admin.admin("GET", "/v1/admin/reconcile",
                       params={**params, "to": "2999-01-01"}).status_code == 422


def test_the_daily_schedule_reconciles_every_configured_provider(
    spent: dict[str, int], admin: Client, stub: StubProvider
) -> None:
    # Vercel's cron calls the path alone: the week up to yesterday, for both providers.
    r = admin.admin("GET", "/v1/admin/reconcile")
    assert r.status_code == 200, r.text
    assert r.json() == {"within": True, "providers": {
        "openai": {"within": True, "days_beyond": []},
        "anthropic": {"within": True, "days_beyond": []}}}
    cost_control(stub.url, {"mode": "error"})
    failing = admin.admin("GET", "/v1/admin/reconcile").json()
    assert failing["within"] is False
    for provider in APIS:
        assert "HTTP 500" in failing["providers"][provider]["error"]["message"]


@pytest.mark.parametrize("mode", ["error", "non_usd", "malformed"])
def test_a_report_that_fails_is_an_error_never_a_zero(
    mode: str, spent: dict[str, int], admin: Client, ledger_redis: RedisServer,
    stub: StubProvider
) -> None:
    cost_control(stub.url, {"mode": mode})
    for provider in APIS:
        r = admin.admin("GET", "/v1/admin/reconcile",
                        params={"provider": provider, "from": today(), "to": today()})
        assert r.status_code == 502, r.text
        assert r.json()["error"]["provider"] == provider
        assert ADMIN_KEY not in r.text
    done = ceiling(ledger_redis, "reconcile", "anthropic", "--from", today(),
                   env=report_env(stub))
    assert done.returncode == 1
    assert done.stdout == ""
    assert json.loads(done.stderr)["error"]["reason"] in ("http_status", "currency", "malformed")


def test_a_wrong_admin_key_or_none_is_an_error(
    spent: dict[str, int], ledger_redis: RedisServer, stub: StubProvider
) -> None:
    wrong = ceiling(ledger_redis, "reconcile", "openai", "--from", today(),
                    env={**report_env(stub), "CEILING_OPENAI_ADMIN_KEY": "sk-not-admin"})
    assert wrong.returncode == 1
    assert json.loads(wrong.stderr)["error"]["status"] == 401
    unset = ceiling(ledger_redis, "reconcile", "anthropic", "--from", today(),
                    env={**report_env(stub), "CEILING_ANTHROPIC_ADMIN_KEY": ""})
    assert unset.returncode == 1
    assert "CEILING_ANTHROPIC_ADMIN_KEY" in unset.stderr
