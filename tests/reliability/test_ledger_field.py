"""The ledger in the field: the Redis faults teams meet, each judged by the stub
provider's bill, with calls going through the gateway of two instances that keep serving.

1. A failover to a replica whose link stalled, behind the same endpoint: without waiting for
   replicas, the promoted ledger lacks the calls admitted meanwhile; the instances notice
   (`ledger_rolled_back` in health) and refuse every call, so the bill stays within the
   ceiling. With CEILING_REDIS_WAIT_REPLICAS=1 the calls admitted while the link stalled were
   refused before they reached the provider: the promoted ledger counts every billed call.
2. A Redis that only snapshots: `ceiling serve` refuses it unless accepted; health says
   `ledger_not_durable` from the start; killed and restarted from its snapshot, the instances
   say `ledger_rolled_back` and refuse.
3. An evicting maxmemory policy: refused at start unless accepted, then `degraded`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
import redis

from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from infra.stub_provider import StubProvider, StubProviderProcess, fetch_bill
from tests.api.conftest import ADMIN_TOKEN, Client, client_for
from tests.core.stores.test_durability import Pair, started_pair

pytestmark = pytest.mark.slow

MODEL = "gpt-4o-mini"
OUTPUT_TOKENS_MAX = 40
# Room for a few dozen calls at the worst case the gateway holds for each.
CEILING_MICROS = 1_500
# More calls than the ceiling admits, each phase: the rest are refused.
CALLS_PER_PHASE = 80


@pytest.fixture
def provider() -> Iterator[StubProvider]:
    with StubProviderProcess(seed=35, latency_ms_min=0, latency_ms_max=0) as stub:
        yield stub


@pytest.fixture
def pair() -> Iterator[Pair]:
    with started_pair() as started:
        yield started


def instances(stack: ExitStack, redis_url: str, provider: StubProvider,
              **env: str) -> list[Client]:
    """Two gateway instances on one ledger, and an admin client of each."""
    services = [stack.enter_context(ServiceProcess({
        "REDIS_URL": redis_url, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN,
        "CEILING_UPSTREAM_URL": f"{provider.url}/v1", **env})) for _ in range(2)]
    return [stack.enter_context(client_for(s)) for s in services]


def account(admin: Client) -> tuple[str, str]:
    """A budget of CEILING_MICROS and a gateway key for it."""
    tag = f"org:f{uuid.uuid4().hex[:10]}"
    admin.budget(tag, CEILING_MICROS)
    return tag, admin.key(tag)["Authorization"].removeprefix("Bearer ")


def calls(clients: list[Client], key: str, count: int) -> list[httpx.Response]:
    """`count` chat calls through the gateway, alternating between the instances."""
    out = []
    for i in range(count):
        out.append(clients[i % len(clients)].post(
            "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
            json={"model": MODEL, "max_tokens": OUTPUT_TOKENS_MAX,
                  "messages": [{"role": "user", "content": "hello"}]}))
    return out


def codes(responses: list[httpx.Response]) -> dict[Any, int]:
    found: dict[Any, int] = {}
    for r in responses:
        code = r.status_code if r.status_code == 200 else (
            r.status_code, r.json()["error"].get("code"))
        found[code] = found.get(code, 0) + 1
    return found


def health(client: Client) -> dict[str, Any]:
    body = client.get("/health").json()
    assert set(body) == {"status", "reasons"}  # without the admin token
    return dict(body)


def billed_micros(provider: StubProvider) -> int:
    return fetch_bill(provider.url, with_log=False).total.cost_micros


def ledger_micros(redis_port: int, tag: str) -> int:
    """committed + reserved of the budget's total, read from Redis itself."""
    raw = redis.Redis(port=redis_port, decode_responses=True)
    counter = next(k for k in raw.scan_iter(f"sc:{{{tag}}}:p:*"))
    found = raw.hgetall(counter)
    return int(found.get("committed", 0)) + int(found.get("reserved", 0))


def test_a_failover_to_a_lagging_replica_is_refused_not_spent_twice(
        pair: Pair, provider: StubProvider) -> None:
    with ExitStack() as stack:
        clients = instances(stack, pair.endpoint.url, provider)
        _, key = account(clients[0])
        pair.stall()
        before = codes(calls(clients, key, CALLS_PER_PHASE))
        # The ceiling was reached on the primary: the calls past it were refused.
        assert set(before) == {200, (402, "budget_exceeded")}
        billed_before = billed_micros(provider)
        assert billed_before <= CEILING_MICROS
        pair.fail_over()
        after = calls(clients, key, CALLS_PER_PHASE)
        # Not one call reached the provider on the promoted ledger, which lacks the spend.
        assert codes(after) == {(503, "ledger_unavailable"): CALLS_PER_PHASE}
        assert {r.json()["error"].get("reason") for r in after} == {"ledger_rolled_back"}
        assert billed_micros(provider) == billed_before
        for client in clients:
            assert health(client) == {"status": "down", "reasons": ["ledger_rolled_back"]}


def test_with_wait_the_calls_a_failover_would_lose_were_refused(
        pair: Pair, provider: StubProvider) -> None:
    with ExitStack() as stack:
        clients = instances(stack, pair.endpoint.url, provider,
                            CEILING_REDIS_WAIT_REPLICAS="1", CEILING_REDIS_WAIT_TIMEOUT_MS="500")
        tag, key = account(clients[0])
        admitted = calls(clients, key, 5)
        assert codes(admitted) == {200: 5}
        pair.stall()
        stalled = calls(clients, key, 10)
        assert codes(stalled) == {(503, "ledger_unavailable"): 10}
        billed = billed_micros(provider)
        pair.fail_over()
        # Every call the provider billed is in the promoted ledger (settled, or still held).
        assert ledger_micros(pair.replica.port, tag) >= billed
        assert billed <= CEILING_MICROS
        # The promoted primary has no replica: every reserve is refused, and health says why.
        for client in clients:
            assert health(client) == {"status": "down", "reasons": ["ledger_not_replicated"]}


def serve(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "api.cli", "serve", "--port", "1"],
        env={**os.environ, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN, **env}, capture_output=True,
        text=True, timeout=60, check=False)


def test_a_snapshot_only_redis_is_refused_at_start_then_noticed_when_it_restarts(
        provider: StubProvider) -> None:
    with RedisServer(snapshots=True) as server, ExitStack() as stack:
        refused = serve({"REDIS_URL": server.url})
        assert refused.returncode == 2
        assert "CEILING_ACCEPT_NOT_DURABLE" in refused.stderr
        clients = instances(stack, server.url, provider, CEILING_ACCEPT_NOT_DURABLE="1")
        assert health(clients[0]) == {"status": "degraded", "reasons": ["ledger_not_durable"]}
        _, key = account(clients[0])
        redis.Redis(port=server.port).save()  # the schedule's snapshot, after the budget
        assert 200 in codes(calls(clients, key, CALLS_PER_PHASE))
        billed_before = billed_micros(provider)
        server.stop(kill=True)
        server.start()
        after = calls(clients, key, CALLS_PER_PHASE)
        assert codes(after) == {(503, "ledger_unavailable"): CALLS_PER_PHASE}
        assert billed_micros(provider) == billed_before <= CEILING_MICROS
        for client in clients:
            assert health(client)["reasons"] == ["ledger_rolled_back"]


def test_an_evicting_redis_is_refused_at_start_unless_accepted() -> None:
    with RedisServer(durable=True, maxmemory_policy="volatile-lru") as server, \
            ExitStack() as stack:
        refused = serve({"REDIS_URL": server.url})
        assert refused.returncode == 2
        assert "CEILING_ACCEPT_EVICTION" in refused.stderr
        service = stack.enter_context(ServiceProcess({
            "REDIS_URL": server.url, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN,
            "CEILING_ACCEPT_EVICTION": "1"}))
        client = stack.enter_context(client_for(service))
        assert health(client) == {"status": "degraded", "reasons": ["ledger_evicts"]}
