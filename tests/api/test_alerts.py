"""Alerts end to end (issue 16): service instances as real processes, a real receiver on
loopback, the background delivery of `ceiling serve`, the pause and its resume, and a key
holder's own spend series, attacked."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from infra.alert_receiver import AlertReceiver
from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from tests.api.conftest import ADMIN_TOKEN, Client, client_for

SECRET = "whsec-e2e"
# Background delivery passes in these tests: fast, so a test waits a fraction of a second.
INTERVAL_S = "0.2"
DELIVERY_WAIT_S_MAX = 15.0


@pytest.fixture(scope="module")
def receiver() -> Iterator[AlertReceiver]:
    with AlertReceiver() as r:
        yield r


def alerting_env(redis_server: RedisServer, receiver: AlertReceiver) -> dict[str, str]:
    return {"REDIS_URL": redis_server.url, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN,
            "CEILING_ALERT_WEBHOOK_URL": receiver.url, "CEILING_ALERT_WEBHOOK_SECRET": SECRET,
            "CEILING_ALERT_DELIVERY_INTERVAL_S": INTERVAL_S}


@pytest.fixture(scope="module")
def alerting(redis_server: RedisServer, receiver: AlertReceiver) -> Iterator[Client]:
    with ServiceProcess(alerting_env(redis_server, receiver)) as s, client_for(s) as c:
        yield c


def budget(http: Client, budget_id: str, ceiling_micros: int, alerts: dict[str, object],
           period: str = "day") -> dict[str, object]:
    r = http.admin("PUT", f"/v1/admin/budgets/{budget_id}", json={
        "limits": [{"period": period, "ceiling_micros": ceiling_micros}], "alerts": alerts})
    assert r.status_code == 200, r.text
    return dict(r.json())


def spend(http: httpx.Client, key: dict[str, str], micros: int) -> httpx.Response:
    r = http.post("/v1/reservations", headers=key, json={"amount_micros": micros})
    if r.status_code != 201:
        return r
    rid = r.json()["reservation_id"]
    settled = http.post(f"/v1/reservations/{rid}/settle", headers=key,
                        json={"actual_micros": micros})
    assert settled.status_code == 200, settled.text
    return settled


def received(receiver: AlertReceiver, tag: str, count: int) -> list[dict[str, object]]:
    """The events about `tag` the receiver accepted, once `count` of them have arrived."""
    deadline = time.monotonic() + DELIVERY_WAIT_S_MAX
    while True:
        mine = [p.json() for p in list(receiver.posts)
                if p.status == 200 and p.json()["budget_id"].startswith(tag)]
        if len(mine) >= count or time.monotonic() > deadline:
            return mine
        time.sleep(0.05)


def test_the_background_task_delivers_each_event_once_signed(
    alerting: Client, receiver: AlertReceiver
) -> None:
    tag = f"org:a{uuid.uuid4().hex[:10]}"
    shown = budget(alerting, tag, 1_000, {"thresholds_pct": [50, 100]})
    assert shown["alerts"] == {"thresholds_pct": [50, 100], "velocity": None}
    key = alerting.sidecar_key(tag)
    for _ in range(10):
        assert spend(alerting, key, 100).status_code == 200
    assert spend(alerting, key, 100).status_code == 402  # the first refusal: budget.exceeded
    assert spend(alerting, key, 100).status_code == 402
    events = received(receiver, tag, 3)
    time.sleep(4 * float(INTERVAL_S))  # a few more passes: nothing more arrives
    events = received(receiver, tag, 3)
    assert sorted((e["type"], e["threshold_pct"]) for e in events) == [
        ("budget.exceeded", None), ("budget.threshold_crossed", 50),
        ("budget.threshold_crossed", 100)]
    assert len({e["event_id"] for e in events}) == 3
    posts = [p for p in receiver.posts if p.json()["budget_id"] == tag]
    assert all(p.signed_by(SECRET) for p in posts)
    log = alerting.admin("GET", "/v1/admin/alerts").json()
    mine = [a for a in log["alerts"] if a["budget_id"] == tag]
    assert log["webhook_configured"] is True
    assert sorted(a["delivery"]["state"] for a in mine) == ["delivered"] * 3
    assert alerting.get("/v1/admin/alerts").status_code == 401
    assert alerting.post("/v1/admin/alerts/deliver").status_code == 401


def test_a_velocity_alarm_pauses_the_budget_until_an_operator_resumes_it(
    alerting: Client, receiver: AlertReceiver, redis_server: RedisServer
) -> None:
    tag = f"org:v{uuid.uuid4().hex[:10]}"
    budget(alerting, tag, 10**9, {"thresholds_pct": [],
                                  "velocity": {"window_s": 300, "max_micros": 500,
                                               "pause": True}})
    key = alerting.sidecar_key(tag)
    for _ in range(5):
        assert spend(alerting, key, 100).status_code == 200
    assert spend(alerting, key, 1).status_code == 200  # 501 in five minutes: the alarm
    refused = spend(alerting, key, 1)
    assert refused.status_code == 402
    assert refused.json()["error"]["code"] == "budget_paused"
    assert refused.json()["error"]["budget_id"] == tag
    [event] = received(receiver, tag, 1)
    assert (event["type"], event["committed_micros"], event["ceiling_micros"]) == (
        "budget.velocity", 501, 500)
    shown = alerting.admin("GET", f"/v1/admin/budgets/{tag}").json()
    assert shown["paused_at_ms"] is not None
    # The operator's command line lifts it (the same ledger, its own process).
    cli = subprocess.run(
        [sys.executable, "-m", "api.cli", "budgets", "resume", tag],
        env={**os.environ, "REDIS_URL": redis_server.url}, capture_output=True, text=True,
        timeout=60, check=False)
    assert cli.returncode == 0, cli.stderr
    assert '"resumed": true' in cli.stdout
    assert spend(alerting, key, 1).status_code == 200
    again = alerting.admin("POST", f"/v1/admin/budgets/{tag}/resume").json()
    assert again == {"budget_id": tag, "resumed": False}


def test_usage_me_shows_the_callers_own_budgets_and_nobody_elses(alerting: Client) -> None:
    tag = f"org:u{uuid.uuid4().hex[:10]}"
    budget(alerting, tag, 10**6, {}, period="month")
    budget(alerting, f"{tag}/key:mine", 10**5, {})
    budget(alerting, f"{tag}/key:theirs", 10**5, {})
    budget(alerting, f"org:other{uuid.uuid4().hex[:8]}", 10**5, {})
    mine = alerting.key(f"{tag}/key:mine", run_ceiling_micros=1_000)
    theirs = alerting.sidecar_key(f"{tag}/key:theirs")
    assert spend(alerting, theirs, 700).status_code == 200
    r = alerting.get("/v1/usage/me", headers=mine)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["budget_id"] == f"{tag}/key:mine"
    assert [b["budget_id"] for b in body["budgets"]] == [tag, f"{tag}/key:mine"]
    own = body["budgets"][1]
    assert own["series"] == []
    assert own["periods"][0]["committed_micros"] == 0
    # The org's series is its own budget's: the scope this key is charged against too.
    assert sum(p["committed_micros"] for p in body["budgets"][0]["series"]) == 700
    # Attacks: another key's budget by parameter, by a crafted path, by another key's run.
    for params in ({"budget_id": f"{tag}/key:theirs"}, {"key_id": "x"},
                   {"budget_id": f"{tag}/key:mine/../key:theirs"}):
        refused = alerting.get("/v1/usage/me", headers=mine, params=params)
        assert refused.status_code == 422, params
        assert "theirs" not in refused.text.replace(str(params), "")
    for path in (f"/v1/usage/{tag}/key:theirs", "/v1/usage/me/../../admin/alerts",
                 f"/v1/usage/me/{tag}%2Fkey:theirs"):
        assert alerting.get(path, headers=mine).status_code in (401, 404), path
    with_run = alerting.get("/v1/usage/me", headers={**mine, "X-Ceiling-Run-Id": "their-run"})
    assert [b["budget_id"] for b in with_run.json()["budgets"]] == [tag, f"{tag}/key:mine"]
    assert alerting.get("/v1/usage/me").status_code == 401
    assert alerting.get("/v1/usage/me", params={"hours": "0"}, headers=mine).status_code == 422


SCHEDULED_DRIVER = r"""
import json
from api.lambda_handler import handler
# EventBridge's scheduled event, as serverless.yml's `schedule` sends it.
print(json.dumps(handler({"source": "aws.events", "detail-type": "Scheduled Event"}, None)))
"""


def test_the_lambda_schedule_runs_a_delivery_pass(
    redis_server: RedisServer, receiver: AlertReceiver
) -> None:
    import asyncio

    from core.alerts import AlertConfig
    from core.budgets import Period
    from core.stores.redis import RedisStore
    from tests.core.stores.test_alerts import put
    from tests.core.stores.test_alerts import spend as book

    tag = f"org:s{uuid.uuid4().hex[:10]}"

    async def crossing() -> None:
        store = RedisStore(redis_server.url)
        await put(store, tag, (Period.TOTAL, 100), alerts=AlertConfig(thresholds_pct=(50,)))
        await book(store, tag, tag, 60)
        await store.close()

    asyncio.run(crossing())
    done = subprocess.run([sys.executable, "-c", SCHEDULED_DRIVER],
                          env={**os.environ, **alerting_env(redis_server, receiver)},
                          capture_output=True, text=True, timeout=60, check=True)
    assert '"webhook_configured": true' in done.stdout.splitlines()[-1]
    [event] = received(receiver, tag, 1)
    assert (event["type"], event["threshold_pct"]) == ("budget.threshold_crossed", 50)
