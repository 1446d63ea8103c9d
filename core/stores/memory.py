"""MemoryStore: the ledger in one process's memory, for a single replica.

It runs the lua/ scripts themselves, as ScriptedStore does on Redis, on an in-process Redis
(fakeredis, its Lua through lupa's Lua 5.1): one statement of the rules, not a Python copy of
them. Calls into it are synchronous, so every script runs to completion with nothing else
interleaved, as on a server. It is not a test double, and it is not shared: two processes hold
two ceilings, so it reports `shared = False` and the service refuses it unless
CEILING_SINGLE_REPLICA=1.

Time: an injected clock (tests) is the in-process server's clock too, so keys expire by it as
the scripts' `now_ms` says; without one, the wall clock, which Redis TIME answers.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from fakeredis import FakeRedis, FakeServer
from fakeredis._core import Database

from core.ledger import Probe
from core.stores.durability import POLICY_KEEPS_ALL, Durability
from core.stores.redis import translated
from core.stores.scripted import Clock, ScriptedReplies, ScriptedStore
from core.stores.scripts import Script, library

# The Redis version the in-process server answers as: one with functions (FCALL).
SERVER_VERSION = (7, 4)


class _ClockedDatabase(Database):
    """A database whose time, by which keys expire, is the injected clock's.

    fakeredis offers no public hook for its clock: this subclasses `fakeredis._core.Database`
    and replaces `FakeServer.dbs`, as fakeredis 2.41 lays them out (pyproject pins fakeredis
    below 3). tests/core/stores/test_conformance.py's expiries by the injected clock (a run
    counter dropped after a silent day, a replay window) fail if that layout changes."""

    def __init__(self, lock: Any, clock: Clock) -> None:
        self._clock = clock
        super().__init__(lock)

    @property
    def time(self) -> float:
        return self._clock() / 1000

    @time.setter
    def time(self, _value: float) -> None:
        """fakeredis sets the wall clock's time before each command; the injected one holds."""


class LocalTransport:
    """The scripts and commands of ScriptedStore, on a Redis in this process, through
    fakeredis's synchronous client: a call runs to completion before the next can start."""

    backend = "memory"

    def __init__(self, clock: Clock | None = None) -> None:
        server = FakeServer(version=SERVER_VERSION)
        if clock is not None:
            server.dbs = defaultdict(lambda: _ClockedDatabase(server.lock, clock))
        self._client = FakeRedis(server=server, decode_responses=True)
        self._client.function_load(library().source)

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[str]) -> Any:
        assert script.function is not None
        with translated():
            return self._client.fcall(script.function, len(keys), *keys, *args)

    async def execute(self, *args: str) -> Any:
        with translated():
            return self._client.execute_command(*args)  # type: ignore[no-untyped-call]

    async def durability(self) -> Durability:
        return Durability(aof=False, eviction_policy=POLICY_KEEPS_ALL, evicted_keys=0)

    async def close(self) -> None:
        return None


class MemoryStore(ScriptedStore):
    """A ledger for one process. See core.ledger.LedgerStore for the contract."""

    shared = False

    def __init__(self, *, clock: Clock | None = None) -> None:
        super().__init__(LocalTransport(clock), clock=clock)

    async def probe(self, instance_id: str) -> Probe:
        return Probe(
            self.backend, False, True, 0.0, await self.open(), False,
            ("ledger_not_shared", "ledger_not_durable"), 1,
        )


class MemoryReplies(ScriptedReplies):
    """ReplyStore in one process's memory: the reply scripts on a Redis of its own."""

    def __init__(self, clock: Clock | None = None) -> None:
        super().__init__(LocalTransport(clock))
