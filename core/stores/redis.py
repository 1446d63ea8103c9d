"""RedisStore: the ledger on one Redis (or a managed Redis) through redis-py's asyncio client.

The scripts, two or more on every call the service serves, go out on a connection of the
transport's own (`RedisTransport.run`, core/stores/redis_resp.py: hiredis over an asyncio
protocol, to where redis-py's client connects), one per event loop, carrying its calls
pipelined: redis-py's command path costs several times what sending the command does, and a
connection per call in flight costs the server and the service a wake-up and a system call per
command. Everything else (key records, health, budgets, loading the scripts) goes through the
client, where its response callbacks shape the replies.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import redis.asyncio as aioredis
from redis import exceptions as rex
from redis.asyncio.client import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from core.errors import InvariantBroken, LedgerUnavailable
from core.stores.redis_resp import Command, Endpoint, RespConnection, pack
from core.stores.scripted import Clock, ScriptedStore
from core.stores.scripts import Script, function_missing, functions_unknown, library, library_exists

# One ledger call may take this long, retries included, before the caller fails closed. A
# reserve is one round trip of well under a millisecond; two seconds is an outage, not load.
LEDGER_CALL_TIMEOUT_S = 2.0
# Connections one instance keeps to Redis for redis-py's client (key records, health, budgets):
# enough for the concurrency of one serverless instance or one uvicorn worker; a pool that is
# too small queues calls instead of failing them. The scripts share one connection of their own.
POOL_CONNECTIONS_MAX = 64
# Retries of one command after a connection error: enough to get past connections that a Redis
# restart or failover broke, few enough to stay inside LEDGER_CALL_TIMEOUT_S.
RETRIES_MAX = 2
RETRY_BACKOFF_S_MAX = 0.05
RETRY_BACKOFF_S_BASE = 0.01


# redis-py's asyncio connection, writing on a connection its peer has just closed, can raise
# the torn-down transport's internals ("'NoneType' object is not callable", "... has no
# attribute 'writelines'") instead of ConnectionError (redis/redis-py#4287; seen here in a Redis
# Cluster failover): a lost connection all the same. Known by where it was raised, the innermost
# frame in asyncio's or redis-py's connection code; any other TypeError or AttributeError is a
# bug and goes out as it is.
TORN_DOWN = (TypeError, AttributeError)
TORN_DOWN_FILES = ("/asyncio/selector_events.py", "/asyncio/streams.py",
                   "/redis/asyncio/connection.py")
# The errors a redis-py client call fails with, each translated (translate) into a core error.
CLIENT_ERRORS: tuple[type[BaseException], ...] = (rex.RedisError, OSError, TimeoutError)


def lost_connection(exc: BaseException) -> bool:
    if not isinstance(exc, TORN_DOWN):
        return False
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.endswith(TORN_DOWN_FILES)


@contextmanager
def translated(translator: Callable[[BaseException], Exception] | None = None,
               errors: tuple[type[BaseException], ...] = CLIENT_ERRORS) -> Iterator[None]:
    """Inside: a client call's failure (`errors`, or a lost connection in torn-down clothing)
    leaves as the core error `translator` (translate by default) makes of it."""
    try:
        yield
    except errors as exc:
        raise (translator or translate)(exc) from exc
    except TORN_DOWN as exc:
        if not lost_connection(exc):
            raise
        raise (translator or translate)(exc) from exc


def translate(exc: BaseException) -> Exception:
    """The core error for a redis-py exception; stores never let a client exception out."""
    if lost_connection(exc):
        return LedgerUnavailable(f"the ledger is unreachable: the connection was lost ({exc})",
                                 reason="ledger_unreachable")
    if isinstance(exc, rex.ResponseError) and str(exc).startswith("BADARG"):
        return InvariantBroken(f"the ledger refused an argument: {exc}")
    if isinstance(exc, rex.ConnectionError | rex.TimeoutError | TimeoutError | OSError):
        # asyncio.timeout raises a TimeoutError with no message of its own.
        why = str(exc) or "no answer within the call's time limit"
        return LedgerUnavailable(f"the ledger is unreachable: {why}", reason="ledger_unreachable")
    return LedgerUnavailable(f"the ledger answered with an error: {exc}", reason="ledger_error")


class RedisTransport:
    backend = "redis"

    def __init__(self, client: Redis, *, call_timeout_s: float = LEDGER_CALL_TIMEOUT_S,
                 functions: bool = True) -> None:
        self._client = client
        self._call_timeout_s = call_timeout_s
        # Whether to call the library's functions: a server without them (before Redis 7.0)
        # says so at the first call, and each call then runs as a script of its own.
        self._functions = functions
        # The scripts' connection (core/stores/redis_resp.py), to where the client connects;
        # None: a setting only the client carries out, and the scripts go through it.
        self._endpoint = Endpoint.of(client)
        # Made per event loop, as is the lock that lets one call at a time open it: a serverless
        # runtime may run each invocation on a loop of its own.
        self._connection: RespConnection | None = None
        self._connecting = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[str]) -> Any:
        # FCALL of the script's function, loading the library when the server does not know it;
        # on a server without functions, EVALSHA, and on NOSCRIPT load and retry once: what
        # redis-py's Script object does, without its per-call import and its isinstance()
        # through typing.Protocol.
        with translated():
            async with asyncio.timeout(self._call_timeout_s):
                if self._functions and script.function:
                    command: Command = ("FCALL", script.function, len(keys), *keys, *args)
                    try:
                        return await self._send(command)
                    except rex.ResponseError as exc:
                        if function_missing(str(exc)):
                            await self._load_library()
                            return await self._send(command)
                        if not functions_unknown(str(exc)):
                            raise
                        self._functions = False
                command = ("EVALSHA", script.sha1, len(keys), *keys, *args)
                try:
                    return await self._send(command)
                except rex.NoScriptError:
                    await self._client.script_load(script.source)
                    return await self._send(command)

    async def _send(self, command: Command) -> Any:
        """One command on the scripts' connection, and its reply (an error reply raised as
        redis-py's exception for it). A call whose connection breaks is retried on a fresh one,
        RETRIES_MAX times: every script is safe to run twice."""
        if self._endpoint is None:
            return await self._client.execute_command(*command)  # type: ignore[no-untyped-call]
        packed = pack(command)
        for attempt in range(RETRIES_MAX + 1):
            try:
                return await (await self._connected()).call(packed)
            except (rex.ConnectionError, rex.TimeoutError, OSError):
                if attempt == RETRIES_MAX:
                    raise
            await asyncio.sleep(min(RETRY_BACKOFF_S_MAX, RETRY_BACKOFF_S_BASE * 2**attempt))
        raise InvariantBroken("the retry loop returns or raises")

    async def _connected(self) -> RespConnection:
        """This loop's connection for the scripts, opened if it is not open (or broke)."""
        assert self._endpoint is not None
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._connection, self._connecting, self._loop = None, asyncio.Lock(), loop
        connection = self._connection
        if connection is not None and connection.usable:
            return connection
        async with self._connecting:
            # Calls that waited here take the connection the first of them opened.
            if self._connection is None or not self._connection.usable:
                self._connection = await self._endpoint.connect()
            return self._connection

    async def _load_library(self) -> None:
        try:
            await self._client.function_load(library().source)
        except rex.ResponseError as exc:
            if not library_exists(str(exc)):
                raise

    async def execute(self, *args: str) -> Any:
        with translated():
            async with asyncio.timeout(self._call_timeout_s):
                return await self._client.execute_command(*args)  # type: ignore[no-untyped-call]

    async def durable(self) -> bool | None:
        with translated():
            try:
                async with asyncio.timeout(self._call_timeout_s):
                    config = await self._client.config_get("appendonly")
                    config.update(await self._client.config_get("save"))
            except (rex.ResponseError, TimeoutError):
                return None  # managed Redis often disables CONFIG; durability cannot be told
        return config.get("appendonly") == "yes" or bool(config.get("save"))

    async def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()
        await self._client.aclose()


def redis_client(url: str, call_timeout_s: float = LEDGER_CALL_TIMEOUT_S) -> Redis:
    # A blocking pool: past POOL_CONNECTIONS_MAX concurrent calls, a call waits for a connection
    # (within the call's timeout) instead of failing with "Too many connections".
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        decode_responses=True,
        socket_timeout=call_timeout_s,
        socket_connect_timeout=call_timeout_s,
        max_connections=POOL_CONNECTIONS_MAX,
        timeout=call_timeout_s,
        health_check_interval=30,
        # A connection broken by a Redis restart fails its next command; retry on a fresh one.
        # Replaying a script is safe: every script is idempotent by reservation id.
        retry=Retry(ExponentialBackoff(cap=RETRY_BACKOFF_S_MAX, base=RETRY_BACKOFF_S_BASE),
                    RETRIES_MAX),
    )
    return aioredis.Redis(connection_pool=pool)


class RedisStore(ScriptedStore):
    """The shared ledger on one Redis. Safe to replay: every script is idempotent by id."""

    def __init__(
        self, url: str, *, clock: Clock | None = None,
        call_timeout_s: float = LEDGER_CALL_TIMEOUT_S, functions: bool = True,
    ) -> None:
        super().__init__(
            RedisTransport(redis_client(url, call_timeout_s), call_timeout_s=call_timeout_s,
                           functions=functions),
            clock=clock,
        )
