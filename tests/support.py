"""Shared by fixtures and plugins: the injected clock and the registry of store kinds."""

from __future__ import annotations

import atexit
import json
import multiprocessing
import os
from collections.abc import Callable
from datetime import UTC, datetime
from functools import cache, partial
from multiprocessing import forkserver
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from core.ledger import LedgerStore
from core.stores.memory import MemoryStore
from core.stores.redis import RedisStore

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


# Hypothesis profiles. CI (.ci/run sets CI=true) draws each property's own count, on top of
# Hypothesis's own ci profile (derandomized, no example database); the dev loop draws a quarter
# of it, enough to exercise every path a property has while a change is being made, with CI's
# larger draw still between it and main. HYPOTHESIS_PROFILE=ci runs CI's counts anywhere.
CI_EXAMPLES = 100
DEV_EXAMPLES = 25
settings.register_profile("ci", parent=settings.get_profile("ci"), max_examples=CI_EXAMPLES)
settings.register_profile("dev", max_examples=DEV_EXAMPLES)
settings.load_profile(os.environ.get(
    "HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI", "") not in ("", "0", "false") else "dev"))


def examples(in_ci: int) -> int:
    """A property's example count: `in_ci` under the ci profile, scaled down as the loaded
    profile is (the dev loop's quarter)."""
    return max(1, in_ci * settings.default.max_examples // CI_EXAMPLES)


StoreFactory = Callable[[pytest.FixtureRequest, ManualClock], LedgerStore]

# The call timeout of every store the shared suites open (conformance, state machine,
# concurrency). Generous: these tests count what is admitted under contention (hundreds of calls
# at once, tests running in parallel workers on a shared 2-core machine), and a call that times
# out would fail closed and not be counted. The timeouts themselves are tested with stores of
# their own (test_redis.py, test_upstash.py).
CONTENTION_CALL_TIMEOUT_S = 60.0

# Every store kind the conformance suite runs against. Plugins in tests/plugins/ add the kinds
# that need a server of their own (an Upstash REST bridge, a Redis Cluster).
STORE_FACTORIES: dict[str, StoreFactory] = {
    "memory": lambda request, clock: MemoryStore(clock=clock),
    "redis": lambda request, clock: RedisStore(
        request.getfixturevalue("redis_server").url, clock=clock,
        call_timeout_s=CONTENTION_CALL_TIMEOUT_S,
    ),
}


SharedStoreBuilder = Callable[[pytest.FixtureRequest], Callable[[], LedgerStore]]

# Store kinds that several OS processes can share, as a picklable builder (a functools.partial
# of the store class) that a child process calls to open its own connection. Production path:
# no injected clock, the ledger's own time.
SHARED_STORE_BUILDERS: dict[str, SharedStoreBuilder] = {
    "redis": lambda request: partial(
        RedisStore, request.getfixturevalue("redis_server").url,
        call_timeout_s=CONTENTION_CALL_TIMEOUT_S,
    ),
}


# The modules whose functions the cross-process tests run in child processes.
CHILD_MODULES = ("tests.core.stores.test_concurrency", "tests.core.stores.test_alerts")


@cache
def _reap_forkserver_at_exit() -> None:
    """The forkserver outlives the tests; multiprocessing leaves it to init at exit. Stopped
    and reaped here instead: nothing is left running, and its CPU counts to this process."""
    atexit.register(forkserver._forkserver._stop)


def process_context() -> BaseContext:
    """The cross-process tests' children: separate processes with their own stores and
    connections, forked from one server process that has imported them once (multiprocessing's
    forkserver). A spawned child imports the stores and the test module again, each time; a
    child forked from a test worker would copy the locks its threads hold."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(CHILD_MODULES))
    _reap_forkserver_at_exit()
    return ctx


def write_prices(tmp_path_factory: pytest.TempPathFactory, name: str,
                 document: dict[str, Any]) -> str:
    """A prices file (CEILING_PRICES_FILE) of `document`, in a directory of its own."""
    path = Path(tmp_path_factory.mktemp(name)) / "prices.json"
    path.write_text(json.dumps(document))
    return str(path)
