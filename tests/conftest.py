"""Fixtures: real servers on loopback, stopped by pid; an injected clock; one store per kind.

A missing redis-server is a failure, not a skip: `bash infra/test.sh` installs it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from core.ledger import LedgerStore
from infra.redis_server import RedisServer
from tests.support import SHARED_STORE_BUILDERS, STORE_FACTORIES, ManualClock

# Every Python process the suite starts (its workers, service instances, `ceiling` runs, stub
# servers) imports the app. Where PYTHONDONTWRITEBYTECODE is set for every shell, none of them
# finds core/, api/ or infra/ compiled and each compiles them again at its start: most of a
# start's CPU. The suite's children write and reuse bytecode as Python does by default (into the
# gitignored __pycache__ directories, which no package or deploy build copies).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

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


# Workers per core under `-n auto`: most of the suite waits on the servers it started (Redis,
# service instances, the stub provider), so one worker per core leaves the cores idle much of
# the run.
WORKERS_PER_CORE = 2


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (pyproject's addopts): WORKERS_PER_CORE per core; with `-s`, one process: what
    tests print (the reliability runs' figures) reaches the terminal only from there, not from
    workers."""
    if config.getoption("capture") == "no":
        return 0
    return WORKERS_PER_CORE * (os.cpu_count() or 1)


# The modules that run fleets of instances or build artifacts, longest first. A scheduling hint
# only: a module missing here (or a name that no longer exists) just starts later.
LONGEST_FIRST = (
    "tests/test_proof.py",
    "tests/clients/test_py_clients.py",
    "tests/clients/test_js_clients.py",
    "tests/reliability/test_crashes.py",
    "tests/deploy/test_built_artifacts.py",
    "tests/reliability/test_ledger_outage.py",
    "tests/reliability/test_soak.py",
    "tests/api/test_hostile.py",
    "tests/api/test_hostile_users.py",
    "tests/api/test_gateway.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest modules first, then the others with slow tests, then the rest; each
    module's tests in their own order.

    With parallel workers (infra/test.sh runs `-n`, whole modules per worker) the run lasts as
    long as its busiest worker: the long modules start at once and the short ones fill the
    other workers around them.
    """
    slow_modules = {item.module for item in items if item.get_closest_marker("slow")}

    def rank(item: pytest.Item) -> tuple[int, int]:
        path = Path(item.path).relative_to(Path(__file__).parent.parent).as_posix()
        if path in LONGEST_FIRST:
            return (0, LONGEST_FIRST.index(path))
        return (1 if item.module in slow_modules else 2, 0)

    items.sort(key=rank)


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
