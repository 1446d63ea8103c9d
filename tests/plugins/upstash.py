"""The Upstash store kind: UpstashStore through a local Upstash REST bridge to the session Redis.

Registering it here puts it in the conformance suite, the state machine and the cross-process
concurrency test; tests/core/stores/test_upstash.py covers what only a REST transport can get
wrong (tokens, hangs, lost replies).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import pytest

from core.stores.upstash import UpstashStore
from infra.redis_server import RedisServer
from infra.upstash_bridge import UpstashBridge
from tests.support import CONTENTION_CALL_TIMEOUT_S, SHARED_STORE_BUILDERS, STORE_FACTORIES


@pytest.fixture(scope="session")
def upstash_bridge(redis_server: RedisServer) -> Iterator[UpstashBridge]:
    # Test faults are on: only tests that arm one (and disarm it after) ever see them.
    with UpstashBridge(redis_server.url, test_faults=True) as bridge:
        yield bridge


def _bridge(request: pytest.FixtureRequest) -> UpstashBridge:
    bridge = request.getfixturevalue("upstash_bridge")
    assert isinstance(bridge, UpstashBridge)
    return bridge


# The stores of the shared suites wait as long as the other kinds' contention tests do: those
# tests send the bridge hundreds of requests at once, which one Python process on a shared
# machine answers in seconds where Upstash takes milliseconds, and they count what is admitted.
# test_upstash.py tests the timeout itself, with its own.
STORE_FACTORIES["upstash"] = lambda request, clock: UpstashStore(
    _bridge(request).url, _bridge(request).token, clock=clock,
    call_timeout_s=CONTENTION_CALL_TIMEOUT_S,
)
SHARED_STORE_BUILDERS["upstash"] = lambda request: partial(
    UpstashStore, _bridge(request).url, _bridge(request).token,
    call_timeout_s=CONTENTION_CALL_TIMEOUT_S,
)
