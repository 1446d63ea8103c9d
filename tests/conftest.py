"""Fixtures: real servers on loopback, stopped by pid; an injected clock; one store per kind.

A missing redis-server is a failure, not a skip: `bash infra/test.sh` installs it.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from core.ledger import LedgerStore
from infra.redis_server import RedisServer
from tests.support import SHARED_STORE_BUILDERS, STORE_FACTORIES, ManualClock

pytest_plugins = [
    f"tests.plugins.{p.stem}"
    for p in sorted((Path(__file__).parent / "plugins").glob("[!_]*.py"))
]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Parametrized here, not in the fixture, so kinds that plugins register are included.
    if "store_kind" in metafunc.fixturenames:
        metafunc.parametrize("store_kind", sorted(STORE_FACTORIES))
    if "shared_store_kind" in metafunc.fixturenames:
        metafunc.parametrize("shared_store_kind", sorted(SHARED_STORE_BUILDERS))


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """The configuration spend-ceiling ships: AOF and noeviction, so health can say `ok`."""
    with RedisServer(durable=True) as server:
        yield server


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def tag() -> str:
    """A top scope of its own, so tests share one Redis without sharing budgets."""
    return f"org:t{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def store(
    request: pytest.FixtureRequest, store_kind: str, clock: ManualClock
) -> AsyncIterator[LedgerStore]:
    """Every store kind, each with the injected clock: the conformance suite runs on all."""
    s = STORE_FACTORIES[store_kind](request, clock)
    await s.open()
    yield s
    await s.close()
