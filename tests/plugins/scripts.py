"""The scripts store kind: RedisStore on the session Redis, each call run as a script of its own.

A server without functions (before Redis 7.0) runs the ledger's operations so (core/stores/
scripts.py): each script built from its own file and what it uses, its common case first.
Registering the kind here puts that path in the conformance suite and the state machine, so it
keeps the same semantics as the library's functions.
"""

from __future__ import annotations

from core.stores.redis import RedisStore
from tests.support import CONTENTION_CALL_TIMEOUT_S, STORE_FACTORIES

STORE_FACTORIES["redis-scripts"] = lambda request, clock: RedisStore(
    request.getfixturevalue("redis_server").url, clock=clock, functions=False,
    call_timeout_s=CONTENTION_CALL_TIMEOUT_S,
)
