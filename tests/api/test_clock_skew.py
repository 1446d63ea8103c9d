"""Instances whose clocks disagree by minutes charge the same periods and expire leases at the
same moment: all ledger time is Redis TIME. The skew is real: libfaketime moves each instance
process's clock."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from datetime import UTC, datetime

import pytest
import redis

from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from tests.api.conftest import ADMIN_TOKEN, Client, client_for

LIBFAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"
SKEWS = {"fast": "+7m", "slow": "-5m"}
LEASE_MS = 60_000


@pytest.fixture(scope="module")
def skewed(redis_server: RedisServer) -> Iterator[dict[str, Client]]:
    with ExitStack() as stack:
        clients = {}
        for name, skew in SKEWS.items():
            s = stack.enter_context(ServiceProcess({
                "REDIS_URL": redis_server.url, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN,
                "LD_PRELOAD": LIBFAKETIME, "FAKETIME": skew, "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            }))
            clients[name] = stack.enter_context(client_for(s))
        yield clients


def redis_now_ms(redis_server: RedisServer) -> int:
    seconds, micros = redis.Redis.from_url(redis_server.url).time()
    return seconds * 1000 + micros // 1000


def test_the_instances_really_disagree(skewed: dict[str, Client]) -> None:
    fast = datetime.strptime(skewed["fast"].get("/health").headers["date"],
                             "%a, %d %b %Y %H:%M:%S GMT")
    slow = datetime.strptime(skewed["slow"].get("/health").headers["date"],
                             "%a, %d %b %Y %H:%M:%S GMT")
    assert (fast - slow).total_seconds() >= 11 * 60


def test_skewed_instances_charge_the_ledger_day_and_expire_by_ledger_time(
    skewed: dict[str, Client], redis_server: RedisServer
) -> None:
    fast, slow = skewed["fast"], skewed["slow"]
    tag = f"org:k{uuid.uuid4().hex[:10]}"
    fast.budget(tag, 1_000, period="day")
    key = fast.sidecar_key(tag)
    before_ms = redis_now_ms(redis_server)
    held = slow.post("/v1/reservations", headers=key,
                     json={"amount_micros": 600, "ttl_ms": LEASE_MS}).json()
    after_ms = redis_now_ms(redis_server)
    assert before_ms + LEASE_MS <= held["expires_at_ms"] <= after_ms + LEASE_MS
    ledger_day = datetime.fromtimestamp(after_ms / 1000, tz=UTC).strftime("%Y-%m-%d")
    assert held["budgets"][0]["period_key"] == f"day:{ledger_day}"
    # The fast instance's clock is 12 minutes past the slow one's lease; by the ledger's clock
    # the lease has a minute left, so it still holds: 600 + 600 does not fit under 1,000.
    r = fast.post("/v1/reservations", headers=key, json={"amount_micros": 600})
    assert (r.status_code, r.json()["error"]["code"]) == (429, "budget_busy")
    settled = fast.post(f"/v1/reservations/{held['reservation_id']}/settle", headers=key,
                        json={"actual_micros": 400})
    assert (settled.status_code, settled.json()["late"]) == (200, False)
    books = fast.admin("GET", f"/v1/admin/budgets/{tag}").json()["periods"][0]
    assert (books["period_key"], books["committed_micros"], books["reserved_micros"]) == (
        f"day:{ledger_day}", 400, 0)
