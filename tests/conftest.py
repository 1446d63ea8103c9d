"""Fixtures: real servers on loopback, stopped by pid; an injected clock; one store per kind.

A missing redis-server is a failure, not a skip: `bash infra/test.sh` installs it.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime

import pytest

from core.ledger import LedgerStore
from core.stores.memory import MemoryStore
from core.stores.redis import RedisStore
from infra.redis_server import RedisServer

# 2026-03-14 12:00:00 UTC: mid-day, mid-month, so a test crosses a boundary only on purpose.
CLOCK_START_MS = int(datetime(2026, 3, 14, 12, tzinfo=UTC).timestamp() * 1000)


class ManualClock:
    """Ledger time that tests move by hand; nothing sleeps to make a lease expire."""

    def __init__(self, now_ms: int = CLOCK_START_MS) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms

    def advance(self, ms: int) -> None:
        self.now_ms += ms


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def tag() -> str:
    """A top scope of its own, so tests share one Redis without sharing budgets."""
    return f"org:t{uuid.uuid4().hex[:12]}"


StoreFactory = Callable[[pytest.FixtureRequest, ManualClock], LedgerStore]

STORE_FACTORIES: dict[str, StoreFactory] = {
    "memory": lambda request, clock: MemoryStore(clock=clock),
    "redis": lambda request, clock: RedisStore(
        request.getfixturevalue("redis_server").url, clock=clock
    ),
}


@pytest.fixture(params=sorted(STORE_FACTORIES))
async def store(request: pytest.FixtureRequest, clock: ManualClock) -> AsyncIterator[LedgerStore]:
    """Every store kind, each with the injected clock: the conformance suite runs on all."""
    s = STORE_FACTORIES[request.param](request, clock)
    await s.open()
    yield s
    await s.close()
