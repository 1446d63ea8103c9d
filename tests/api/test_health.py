"""Health for uptime monitors, and failing closed: no ledger, one replica, an outage, a wipe."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest
import redis

from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from tests.api.conftest import ADMIN_TOKEN, Client, client_for


def org() -> str:
    return f"org:h{uuid.uuid4().hex[:10]}"


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    with RedisServer(durable=True) as server:
        yield server


def test_health_is_ok_on_a_durable_shared_redis(http: Client) -> None:
    public = http.get("/health")
    assert (public.status_code, public.json()) == (200, {"status": "ok", "reasons": []})
    r = http.admin("GET", "/health")  # ids and the rest behind the admin token
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["ledger"]["ledger_id"]
    assert body["instance_id"]
    assert (body["status"], body["reasons"], body["single_replica"]) == ("ok", [], False)
    assert body["ledger"]["backend"] == "redis"
    assert body["ledger"]["shared"]
    assert body["ledger"]["reachable"]
    assert body["ledger"]["latency_ms"] >= 0
    assert body["instances_seen"] >= 1
    assert http.head("/health").status_code == 200
    assert http.get("/health/live").status_code == 200


def test_without_a_ledger_enforcement_is_refused_and_health_is_down() -> None:
    env = {"REDIS_URL": "", "UPSTASH_REDIS_REST_URL": "", "KV_REST_API_URL": "",
           "CEILING_SINGLE_REPLICA": "", "CEILING_ADMIN_TOKEN": ADMIN_TOKEN}
    with ServiceProcess(env, platform=True) as s, client_for(s) as http:
        r = http.get("/health")
        assert (r.status_code, r.json()["status"], r.json()["reasons"]) == (
            503, "down", ["ledger_not_shared"])
        r = http.post("/v1/reservations", json={"amount_micros": 1},
                      headers={"Authorization": "Bearer sk-ceil-x"})
        assert (r.status_code, r.json()["error"]["code"]) == (503, "ledger_not_shared")
    served = subprocess.run(
        [sys.executable, "-m", "api.cli", "serve", "--port", "1"],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=60, check=False)
    assert served.returncode != 0
    assert "CEILING_SINGLE_REPLICA=1" in served.stderr
    assert "REDIS_URL" in served.stderr


def test_single_replica_enforces_but_health_says_degraded() -> None:
    env = {"REDIS_URL": "", "CEILING_SINGLE_REPLICA": "1", "CEILING_ADMIN_TOKEN": ADMIN_TOKEN}
    with ServiceProcess(env) as s, client_for(s) as http:
        tag = org()
        http.budget(tag, 10)
        key = http.sidecar_key(tag)
        assert http.post("/v1/reservations", headers=key, json={"amount_micros": 10}
                         ).status_code == 201
        assert http.post("/v1/reservations", headers=key, json={"amount_micros": 1}
                         ).status_code == 429
        r = http.admin("GET", "/health")
        assert (r.status_code, r.json()["status"]) == (503, "degraded")
        assert "ledger_not_shared" in r.json()["reasons"]
        assert r.json()["ledger"] == {**r.json()["ledger"], "backend": "memory", "shared": False}


def test_a_ledger_outage_fails_closed_and_recovers_without_a_restart(
    own_redis: RedisServer,
) -> None:
    env = {"REDIS_URL": own_redis.url, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN}
    with ServiceProcess(env) as s, client_for(s) as http:
        tag = org()
        http.budget(tag, 1_000)
        key = http.sidecar_key(tag)
        assert http.get("/health").json()["status"] == "ok"
        own_redis.stop()
        r = http.get("/health")
        assert (r.status_code, r.json()["status"], r.json()["reasons"]) == (
            503, "down", ["ledger_unreachable"])
        r = http.post("/v1/reservations", headers=key, json={"amount_micros": 1})
        assert (r.status_code, r.json()["error"]["code"]) == (503, "ledger_unavailable")
        assert r.json()["error"]["forwarded"] is False
        own_redis.start()
        assert http.get("/health").status_code == 200
        assert http.post("/v1/reservations", headers=key, json={"amount_micros": 1}
                         ).status_code == 201


def test_outage_allowance_admits_up_to_it_and_the_journal_reaches_the_ledger(
    own_redis: RedisServer,
) -> None:
    env = {"REDIS_URL": own_redis.url, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN}
    with ServiceProcess(env) as s, client_for(s) as http:
        tag = org()
        http.budget(tag, 10_000, allowance_micros=300)
        key = http.sidecar_key(tag)
        # One call while the ledger is up teaches the instance the budget's allowance.
        first = http.post("/v1/reservations", headers=key, json={"amount_micros": 10}).json()
        http.post(f"/v1/reservations/{first['reservation_id']}/settle", headers=key,
                  json={"actual_micros": 10})
        own_redis.stop()
        admitted = [http.post("/v1/reservations", headers=key, json={"amount_micros": 100})
                    for _ in range(3)]
        assert [r.status_code for r in admitted] == [201, 201, 201]
        refused = http.post("/v1/reservations", headers=key, json={"amount_micros": 100})
        assert (refused.status_code, refused.json()["error"]["code"]) == (
            503, "ledger_unavailable")
        ids = [r.json()["reservation_id"] for r in admitted]
        for rid, actual in zip(ids[:2], (50, 70), strict=True):
            r = http.post(f"/v1/reservations/{rid}/settle", headers=key,
                          json={"actual_micros": actual})
            assert r.status_code == 200, r.text
        assert http.post(f"/v1/reservations/{ids[2]}/release", headers=key).status_code == 200
        own_redis.start()
        health = http.admin("GET", "/health").json()
        assert (health["status"], health["outage_journal_entries"]) == ("ok", 0)
        books = http.admin("GET", f"/v1/admin/budgets/{tag}").json()["periods"][0]
        assert books["committed_micros"] == 10 + 50 + 70
        assert books["reserved_micros"] == 0


def test_a_flushed_ledger_is_detected_not_served_as_empty(own_redis: RedisServer) -> None:
    env = {"REDIS_URL": own_redis.url, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN}
    with ServiceProcess(env) as s, client_for(s) as http:
        tag = org()
        http.budget(tag, 1_000)
        key = http.sidecar_key(tag)
        assert http.post("/v1/reservations", headers=key, json={"amount_micros": 1}
                         ).status_code == 201
        redis.Redis.from_url(own_redis.url).flushall()
        r = http.post("/v1/reservations", headers=key, json={"amount_micros": 1})
        assert (r.status_code, r.json()["error"]["reason"]) == (503, "ledger_reset")
        health = http.get("/health")
        assert (health.status_code, health.json()["reasons"]) == (503, ["ledger_reset"])


def test_a_lease_shorter_than_the_upstream_timeout_is_refused_at_start() -> None:
    env = {"REDIS_URL": "redis://127.0.0.1:1/0", "CEILING_UPSTREAM_TIMEOUT_S": "120",
           "CEILING_LEASE_TTL_MS": "60000"}
    served = subprocess.run(
        [sys.executable, "-m", "api.cli", "serve", "--port", "1"],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=60, check=False)
    assert served.returncode != 0
    assert "CEILING_LEASE_TTL_MS" in served.stderr
    with ServiceProcess(env, platform=True) as s, client_for(s) as http:
        r = http.get("/health")
        assert (r.status_code, r.json()["reasons"]) == (503, ["invalid_configuration"])
