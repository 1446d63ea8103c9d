"""RedisClusterStore: the ledger on a sharded Redis Cluster (redis-py's asyncio cluster client).

The scripts are the ones a single Redis runs. Every key one call touches is 'sc:{TAG}:...', so a
call's script runs whole on the master that owns its tag's slot, and tags spread over the
masters. A call can never span two slots: the transport refuses keys of two hash tags before
anything is sent, and the server refuses a script that reaches a key another node owns; both
are programmer errors (InvariantBroken).

Replication is asynchronous: a write the master acknowledged may not have reached its replica
when the master dies, and the promoted replica then serves a ledger that lacks it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from redis import exceptions as rex
from redis.asyncio.cluster import RedisCluster

from core.errors import ensure
from core.stores.durability import Durability, durability_of
from core.stores.redis import (
    FAILURES,
    LEDGER_CALL_TIMEOUT_S,
    POOL_CONNECTIONS_MAX,
    Failures,
    client_call,
    connection_options,
    error_kind,
    translate,
    translated,
)
from core.stores.scripted import Clock, ScriptedStore
from core.stores.scripts import Script

# Ledger calls one instance has in flight, the same bound as the single-Redis pool's connections.
CALLS_IN_FLIGHT_MAX = POOL_CONNECTIONS_MAX
# Per node. Twice the calls in flight: after a topology refresh redis-py closes the connections
# it marked stale in background tasks and counts them against this limit until they are closed
# (ClusterNode.release), and a call that finds the limit reached fails instead of waiting.
NODE_CONNECTIONS_MAX = 2 * CALLS_IN_FLIGHT_MAX
T = TypeVar("T")


def hash_tag(key: str) -> str | None:
    """What Redis Cluster hashes: the text between the first '{' and the next '}', if any."""
    start = key.find("{")
    end = key.find("}", start + 1)
    if start < 0 or end <= start + 1:
        return None
    return key[start + 1 : end]


def ensure_one_slot(keys: Sequence[str]) -> None:
    """One script call, one tag: the keys a script builds in Lua share KEYS[1]'s tag, so this
    is what keeps every key of the call in one slot, by construction rather than by luck of
    the hash."""
    tags = {hash_tag(key) for key in keys}
    ensure(
        bool(keys) and None not in tags and len(tags) == 1,
        f"a script call must touch one hash tag, got keys {list(keys)}",
    )


class ScriptReachedAnotherSlot(rex.ResponseError):
    """A script touched a key of a slot its call's keys are not in: a programmer error. Redis 7
    words it as a plain script error (ERR, a code redis-py's parser gives no type of its own):
    a key this node does not own; or, for a script that declares flags ('#!lua'), any other
    slot. A script without flags may touch other slots of its own node unchecked."""

    # What the error says, the only thing that tells it from any other script error.
    MESSAGES = ("non local key", "do not hash to the same slot")


# CLUSTERDOWN while a failed master's replica is not yet promoted, redirections (MOVED, ASK,
# TRYAGAIN) still unresolved after the client's retries, no reachable node: the tag's slot has
# no master that answers now. Fail closed; the same call succeeds after the failover.
SLOT_UNSERVED_ERRORS = (
    rex.ClusterError, rex.AskError, rex.TryAgainError, rex.RedisClusterException
)
# The cluster's own failures, then a single Redis's (core/stores/redis.py's FAILURES): the first
# row whose type the exception is decides.
CLUSTER_FAILURES: Failures = (
    (rex.ClusterCrossSlotError, None, "a ledger command touched keys of two slots"),
    (ScriptReachedAnotherSlot, None, "a ledger command touched keys of two slots"),
    (TimeoutError, "ledger_unreachable",
     "the ledger's cluster did not answer within the call's time bound"),
    *((kind, "ledger_unreachable", "the ledger's cluster cannot serve this slot now")
      for kind in SLOT_UNSERVED_ERRORS),
    *FAILURES,
)
CLIENT_ERRORS: tuple[type[BaseException], ...] = tuple(kind for kind, _, _ in CLUSTER_FAILURES)


def cluster_error_kind(exc: BaseException) -> type[BaseException]:
    """The type `exc` is (redis.error_kind), a script's reach into another slot included."""
    if isinstance(exc, rex.ResponseError) and any(
            m in str(exc) for m in ScriptReachedAnotherSlot.MESSAGES):
        return ScriptReachedAnotherSlot
    return error_kind(exc)


def translate_cluster(exc: BaseException) -> Exception:
    """The core error for a redis-py cluster exception, after the client's own retries."""
    return translate(exc, CLUSTER_FAILURES, cluster_error_kind(exc))


class RedisClusterTransport:
    """Carries the ledger's commands to a Redis Cluster; raises only core errors."""

    backend = "redis-cluster"

    def __init__(
        self, client: RedisCluster, *, call_timeout_s: float = LEDGER_CALL_TIMEOUT_S
    ) -> None:
        self._client = client
        self._call_timeout_s = call_timeout_s
        # redis-py's cluster client has no blocking pool: a node with all its connections in use
        # fails the next call at once (MaxConnectionsError). Calls wait here instead, within
        # their time bound, as they wait for a connection of the single-Redis pool.
        self._in_flight = asyncio.Semaphore(CALLS_IN_FLIGHT_MAX)

    async def _bounded(self, call: Callable[[], Awaitable[T]]) -> T:
        async with asyncio.timeout(self._call_timeout_s), self._in_flight:
            return await call()

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[str]) -> Any:
        ensure_one_slot(keys)
        with translated(translate_cluster, CLIENT_ERRORS):
            return await self._bounded(lambda: self._eval(script, keys, args))

    async def _eval(self, script: Script, keys: Sequence[str], args: Sequence[str]) -> Any:
        # The client routes EVALSHA and EVAL by their keys, to the slot's master.
        try:
            return await client_call(
                self._client.evalsha(script.sha1, len(keys), *keys, *args))
        except rex.NoScriptError:
            # Not SCRIPT LOAD: the cluster client sends it to every master, so one master down
            # would fail a call whose own slot is healthy. EVAL runs on the slot's master and
            # leaves the script in its cache (a replica promoted by a failover starts empty:
            # Redis 7 does not replicate the script cache).
            return await client_call(
                self._client.eval(script.source, len(keys), *keys, *args))

    async def execute(self, *args: str) -> Any:
        # Single-key commands go to their key's master; keyless ones (TIME) to any node.
        with translated(translate_cluster, CLIENT_ERRORS):
            return await self._bounded(lambda: client_call(self._client.execute_command(*args)))

    async def scan(self, pattern: str, count: int) -> list[str]:
        """The keys of every master that match `pattern`, `count` a page: for `ceiling ledger
        migrate` (core/stores/migrate.py), never on a call's path. (A SCAN sent through
        `execute` reads one node.)"""
        with translated(translate_cluster, CLIENT_ERRORS):
            return sorted({str(k) async for k in self._client.scan_iter(match=pattern,
                                                                        count=count)})

    async def durability(self) -> Durability:
        """Every master's INFO, the weakest of them: each holds the only copy of its slots'
        data that the ledger trusts (its replica may lag). A rollback on one shard shows in
        its tags' sequences, not in one server id, so none is given."""
        with translated(translate_cluster, CLIENT_ERRORS):
            try:
                infos = await self._bounded(self._master_infos)
            except SLOT_UNSERVED_ERRORS as exc:
                raise translate_cluster(exc) from exc
            except rex.ResponseError:
                return Durability()  # INFO refused: nothing told
        merged = durability_of(infos[0])
        for info in infos[1:]:
            merged = merged.merged(durability_of(info))
        return replace(merged, server_id=None)

    async def _master_infos(self) -> list[Any]:
        # Learns the masters on first use; a no-op after.
        await client_call(self._client.initialize())
        masters = self._client.get_primaries()
        ensure(bool(masters), "a cluster that answered has masters")
        return list(await asyncio.gather(
            *(client_call(self._client.info(target_nodes=master)) for master in masters)))

    async def close(self) -> None:
        await self._client.aclose()


def redis_cluster_client(url: str, call_timeout_s: float = LEDGER_CALL_TIMEOUT_S) -> RedisCluster:
    """A client that learns the whole cluster from the one node `url` names."""
    return RedisCluster.from_url(
        url,
        **connection_options(call_timeout_s),
        max_connections=NODE_CONNECTIONS_MAX,
        # A ledger call needs only its own tag's slot. With full coverage required, one slot
        # range without a master would make the client refuse every tag on every master.
        require_full_coverage=False,
    )


class RedisClusterStore(ScriptedStore):
    """The shared ledger on a Redis Cluster. Safe to replay: every script is idempotent by id."""

    def __init__(
        self, url: str, *, clock: Clock | None = None,
        call_timeout_s: float = LEDGER_CALL_TIMEOUT_S,
    ) -> None:
        super().__init__(
            RedisClusterTransport(
                redis_cluster_client(url, call_timeout_s), call_timeout_s=call_timeout_s
            ),
            clock=clock,
        )
