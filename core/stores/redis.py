"""RedisStore: the ledger on one Redis (or a managed Redis) through redis-py's asyncio client.

The scripts, two or more on every call the service serves, go out on the client the store's
`script_client` names (ScriptClient; CEILING_REDIS_SCRIPT_CLIENT when it is not given), the one
place where the ledger bypasses redis-py:

- `resp` (the default): a connection of the transport's own (`RedisTransport.run`,
  core/stores/redis_resp.py: hiredis over an asyncio protocol, to where redis-py's client
  connects), one per event loop, carrying its calls pipelined: redis-py's command path costs
  several times what sending the command does, and a connection per call in flight costs the
  server and the service a wake-up and a system call per command (docs/measured.md).
- `redis-py`: redis-py's client, like everything else; also what `resp` falls back to for a
  connection setting redis_resp.py does not carry out (a Unix socket, a credential provider).

Everything else (key records, health, budgets, loading the scripts) goes through the client,
where its response callbacks shape the replies.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from enum import StrEnum
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis import exceptions as rex
from redis.asyncio.client import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from core.errors import InvariantBroken, LedgerUnavailable
from core.stores.durability import Durability, durability_of
from core.stores.redis_resp import (
    ERRORS_BY_CODE,
    ArgumentRefused,
    Command,
    Endpoint,
    RespConnection,
    pack,
)
from core.stores.scripted import Clock, ScriptedStore
from core.stores.scripts import Script, function_missing, functions_unknown, library, library_exists

# One ledger call may take this long, retries included, before the caller fails closed. A
# reserve is one round trip of well under a millisecond; two seconds is an outage, not load.
LEDGER_CALL_TIMEOUT_S = 2.0
# Connections one instance keeps to Redis for redis-py's client (key records, health, budgets):
# enough for the concurrency of one serverless instance or one uvicorn worker; a pool that is
# too small queues calls instead of failing them. The scripts share one connection of their own.
POOL_CONNECTIONS_MAX = 64
# Seconds a connection may sit idle before it is checked (PING) on its next use: one a Redis
# restart broke is found before a ledger call is sent on it.
HEALTH_CHECK_S = 30
# Retries of one command after a connection error: enough to get past connections that a Redis
# restart or failover broke, few enough to stay inside LEDGER_CALL_TIMEOUT_S.
RETRIES_MAX = 2
RETRY_BACKOFF_S_MAX = 0.05
RETRY_BACKOFF_S_BASE = 0.01
T = TypeVar("T")
# The setting that picks the scripts' client when a store is not given one (ScriptClient).
SCRIPT_CLIENT_SETTING = "CEILING_REDIS_SCRIPT_CLIENT"


class ScriptClient(StrEnum):
    """What the ledger's scripts go out on; see the module docstring."""

    RESP = "resp"
    REDIS_PY = "redis-py"


def script_client(environ: Mapping[str, str] = os.environ) -> ScriptClient:
    """The client SCRIPT_CLIENT_SETTING names (resp when it is unset); InvariantBroken for any
    other value, as for any other argument a store is built with that it cannot carry out."""
    given = environ.get(SCRIPT_CLIENT_SETTING, "").strip().lower()
    try:
        return ScriptClient(given or ScriptClient.RESP)
    except ValueError:
        raise InvariantBroken(f"{SCRIPT_CLIENT_SETTING} must be one of "
                              f"{', '.join(ScriptClient)}, not {given!r}") from None


class ConnectionTornDown(rex.ConnectionError):
    """A redis-py client call failed with a TypeError or AttributeError from inside the client.

    redis-py's asyncio connection, writing on a connection its peer or another task has just
    closed, can raise the torn-down transport's internals ("'NoneType' object is not callable",
    "... has no attribute 'writelines'") instead of ConnectionError; seen here in a Redis Cluster
    failover. `client_call` knows where the error came from: from the awaited call, after its
    arguments were bound. A TypeError or AttributeError raised by this project's own code is
    not one of these and goes out as it is, a bug."""


async def client_call(call: Awaitable[T]) -> T:
    """The result of a redis-py client call, a lost connection in torn-down clothing raised as
    the lost connection it is (ConnectionTornDown)."""
    try:
        return await call
    except (TypeError, AttributeError) as exc:
        raise ConnectionTornDown(f"{type(exc).__name__}: {exc}") from exc


# Every exception a Redis call fails with, and the core error it is, in one table: the first row
# whose type the exception is (by `error_kind`) decides, so a subclass comes before its base.
# A reason of None is a programmer error (InvariantBroken); any other is LedgerUnavailable's.
Failures = tuple[tuple[type[BaseException], str | None, str], ...]
FAILURES: Failures = (
    (ArgumentRefused, None, "the ledger refused an argument"),
    (rex.DataError, None, "the client refused an argument"),
    (rex.AuthenticationError, "ledger_auth", "the ledger refused the credentials"),
    (rex.NoPermissionError, "ledger_auth", "the ledger's user may not run the command"),
    (ConnectionTornDown, "ledger_unreachable",
     "the ledger is unreachable: the connection was lost"),
    (rex.BusyLoadingError, "ledger_unreachable",
     "the ledger is unreachable: it is loading its data"),
    (rex.ConnectionError, "ledger_unreachable", "the ledger is unreachable"),
    (rex.TimeoutError, "ledger_unreachable", "the ledger is unreachable"),
    # asyncio.timeout's, with no message of its own; Python's TimeoutError is an OSError.
    (TimeoutError, "ledger_unreachable",
     "the ledger is unreachable: no answer within the call's time limit"),
    (OSError, "ledger_unreachable", "the ledger is unreachable"),
    (rex.RedisError, "ledger_error", "the ledger answered with an error"),
)
# The errors a redis-py client call fails with, each translated (translate) into a core error.
CLIENT_ERRORS: tuple[type[BaseException], ...] = tuple(kind for kind, _, _ in FAILURES)


def error_kind(exc: BaseException) -> type[BaseException]:
    """The type `exc` is. An error reply carries no type but its code, its first word; redis-py
    raises a code its parser does not know (the ledger scripts' BADARG) as a plain ResponseError,
    with the code left in the message. Such a reply is the type the scripts' own connection
    raises for its code (redis_resp.ERRORS_BY_CODE)."""
    if type(exc) is rex.ResponseError:
        return ERRORS_BY_CODE.get(str(exc).split(" ", 1)[0], rex.ResponseError)
    return type(exc)


def translate(exc: BaseException, failures: Failures = FAILURES,
              kind: type[BaseException] | None = None) -> Exception:
    """The core error for a redis-py exception (of `kind`, error_kind's by default), by the first
    row of `failures` it is an instance of; stores never let a client exception out."""
    kind = kind or error_kind(exc)
    for failure, reason, what in failures:
        if issubclass(kind, failure):
            message = f"{what}: {exc}" if str(exc) else what
            if reason is None:
                return InvariantBroken(message)
            return LedgerUnavailable(message, reason=reason)
    return InvariantBroken(f"an exception no table row translates: {exc!r}")


@contextmanager
def translated(translator: Callable[[BaseException], Exception] | None = None,
               errors: tuple[type[BaseException], ...] = CLIENT_ERRORS) -> Iterator[None]:
    """Inside: a client call's failure (`errors`) leaves as the core error `translator`
    (translate by default) makes of it."""
    try:
        yield
    except errors as exc:
        raise (translator or translate)(exc) from exc


class RedisTransport:
    backend = "redis"

    def __init__(self, client: Redis, *, call_timeout_s: float = LEDGER_CALL_TIMEOUT_S,
                 functions: bool = True, scripts_on: ScriptClient | None = None) -> None:
        self._client = client
        self._call_timeout_s = call_timeout_s
        # Whether to call the library's functions: a server without them (before Redis 7.0)
        # says so at the first call, and each call then runs as a script of its own.
        self._functions = functions
        # The scripts' connection (core/stores/redis_resp.py), to where the client connects;
        # None: the scripts go through the client, as chosen or for a setting only it carries
        # out.
        self.scripts_on = scripts_on or script_client()
        self._endpoint = Endpoint.of(client) if self.scripts_on is ScriptClient.RESP else None
        # Made per event loop, as is the lock that lets one call at a time open it: a serverless
        # runtime may run each invocation on a loop of its own.
        self._connection: RespConnection | None = None
        self._connecting = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[str]) -> Any:
        # FCALL of the script's function, loading the library when the server does not know it;
        # on a server without functions, EVALSHA, and on NOSCRIPT load and retry once: what
        # redis-py's Script object does, without its per-call import and its isinstance()
        # through typing.Protocol. What translated() does, written out: every call of the
        # gateway runs two scripts, and a context manager made of a generator costs each of
        # them a generator and its steps. The whole of it, retries included, is bounded by one
        # instant (`deadline_s`), which the scripts' connection watches without a timer of
        # the call's own (core/stores/redis_resp.py).
        deadline_s = asyncio.get_running_loop().time() + self._call_timeout_s
        try:
            if self._functions and script.function:
                command: Command = ("FCALL", script.function, len(keys), *keys, *args)
                try:
                    return await self._send(command, deadline_s)
                except rex.ResponseError as exc:
                    if function_missing(str(exc)):
                        async with asyncio.timeout_at(deadline_s):
                            await self._load_library()
                        return await self._send(command, deadline_s)
                    if not functions_unknown(str(exc)):
                        raise
                    self._functions = False
            command = ("EVALSHA", script.sha1, len(keys), *keys, *args)
            try:
                return await self._send(command, deadline_s)
            except rex.NoScriptError:
                async with asyncio.timeout_at(deadline_s):
                    await client_call(self._client.script_load(script.source))
                return await self._send(command, deadline_s)
        except CLIENT_ERRORS as exc:
            raise translate(exc) from exc

    async def _send(self, command: Command, deadline_s: float) -> Any:
        """One command on the scripts' connection, and its reply (an error reply raised as
        redis-py's exception for it), by `deadline_s` (TimeoutError after it). A call whose
        connection breaks is retried on a fresh one, RETRIES_MAX times: every script is safe
        to run twice."""
        if self._endpoint is None:
            async with asyncio.timeout_at(deadline_s):
                return await client_call(
                    self._client.execute_command(*command))  # type: ignore[no-untyped-call]
        packed = pack(command)
        loop = asyncio.get_running_loop()
        for attempt in range(RETRIES_MAX + 1):
            try:
                # This loop's open connection, else one opened (`_connected`, a coroutine that
                # every call would otherwise make and step).
                connection = self._connection
                if connection is None or self._loop is not loop or not connection.usable:
                    connection = await self._connected(deadline_s)
                return await connection.call(packed, deadline_s)
            except rex.AuthenticationError:
                raise  # a refused password is refused again on a fresh connection
            except (rex.ConnectionError, rex.TimeoutError, OSError):
                # TimeoutError is an OSError: past the deadline, nothing is retried.
                if attempt == RETRIES_MAX or loop.time() >= deadline_s:
                    raise
            # Never past the deadline: the next attempt then fails at once, as TimeoutError.
            await asyncio.sleep(min(RETRY_BACKOFF_S_MAX, RETRY_BACKOFF_S_BASE * 2**attempt,
                                    max(0.0, deadline_s - loop.time())))
        raise InvariantBroken("the retry loop returns or raises")

    async def _connected(self, deadline_s: float) -> RespConnection:
        """This loop's connection for the scripts, opened by `deadline_s` if it is not open (or
        broke)."""
        assert self._endpoint is not None
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._connection, self._connecting, self._loop = None, asyncio.Lock(), loop
        connection = self._connection
        if connection is not None and connection.usable:
            return connection
        async with asyncio.timeout_at(deadline_s), self._connecting:
            # Calls that waited here take the connection the first of them opened.
            if self._connection is None or not self._connection.usable:
                self._connection = await self._endpoint.connect()
            return self._connection

    async def _load_library(self) -> None:
        try:
            await client_call(self._client.function_load(library().source))
        except rex.ResponseError as exc:
            if not library_exists(str(exc)):
                raise

    async def execute(self, *args: str) -> Any:
        with translated():
            async with asyncio.timeout(self._call_timeout_s):
                return await client_call(
                    self._client.execute_command(*args))  # type: ignore[no-untyped-call]

    async def durability(self) -> Durability:
        with translated():
            async with asyncio.timeout(self._call_timeout_s):
                try:
                    info = await client_call(self._client.info())
                except rex.ResponseError:
                    return Durability()  # a service that refuses INFO tells nothing
        return durability_of(info)

    async def run_acknowledged(self, script: Script, keys: Sequence[str], args: Sequence[str],
                               replicas: int, timeout_ms: int) -> tuple[Any, int]:
        """`run`, then Redis WAIT on the connection the script's writes went out on: the reply,
        and how many replicas acknowledged them (and every write before them) within
        `timeout_ms`. Without the scripts' own connection, the two go out as one pipeline."""
        with translated():
            if self._endpoint is None:
                return await self._pipelined_acknowledged(script, keys, args, replicas,
                                                          timeout_ms)
            connection = await self._connected(
                asyncio.get_running_loop().time() + self._call_timeout_s)
        reply = await self.run(script, keys, args)
        with translated():
            async with asyncio.timeout(self._call_timeout_s + timeout_ms / 1000):
                # On the connection the script ran on: another one's WAIT would not wait for
                # these writes. A connection that broke since fails the call (unknown: held).
                return reply, await connection.acknowledged(replicas, timeout_ms)

    async def _pipelined_acknowledged(self, script: Script, keys: Sequence[str],
                                      args: Sequence[str], replicas: int, timeout_ms: int
                                      ) -> tuple[Any, int]:
        """The script by EVALSHA and its WAIT in one pipeline, on one of the client's
        connections; on NOSCRIPT the script is loaded and the two sent again (every script is
        safe to run twice)."""
        for attempt in range(2):
            try:
                async with asyncio.timeout(self._call_timeout_s + timeout_ms / 1000):
                    pipe = self._client.pipeline(transaction=False)
                    pipe.evalsha(script.sha1, len(keys), *keys, *args)
                    pipe.execute_command("WAIT", str(replicas), str(timeout_ms))
                    reply, acknowledged = await client_call(pipe.execute())
                    return reply, int(acknowledged)
            except rex.NoScriptError:
                if attempt:
                    raise
                await client_call(self._client.script_load(script.source))
        raise InvariantBroken("the loop returns or raises")

    async def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()
        await self._client.aclose()


def connection_options(call_timeout_s: float) -> dict[str, Any]:
    """What every ledger connection, to one Redis or a cluster's nodes, is made with: replies
    as text, the call's time bound on connecting and on every read, and a check of a connection
    idle for HEALTH_CHECK_S before it is used again."""
    return {"decode_responses": True, "socket_timeout": call_timeout_s,
            "socket_connect_timeout": call_timeout_s, "health_check_interval": HEALTH_CHECK_S}


def redis_client(url: str, call_timeout_s: float = LEDGER_CALL_TIMEOUT_S) -> Redis:
    # A blocking pool: past POOL_CONNECTIONS_MAX concurrent calls, a call waits for a connection
    # (within the call's timeout) instead of failing with "Too many connections".
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        **connection_options(call_timeout_s),
        max_connections=POOL_CONNECTIONS_MAX,
        timeout=call_timeout_s,
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
        wait_replicas: int = 0, wait_timeout_ms: int = 0, scripts_on: ScriptClient | None = None,
    ) -> None:
        """`scripts_on`: the scripts' client (ScriptClient); None: the one the environment
        names (script_client)."""
        transport = RedisTransport(redis_client(url, call_timeout_s),
                                   call_timeout_s=call_timeout_s, functions=functions,
                                   scripts_on=scripts_on)

        async def acknowledging(script: Script, keys: Sequence[str], args: Sequence[str]
                                ) -> tuple[Any, bool]:
            reply, acknowledged = await transport.run_acknowledged(
                script, keys, args, wait_replicas, wait_timeout_ms)
            return reply, acknowledged >= wait_replicas

        # Without replicas to wait for, a reserve is the one script call it always was.
        super().__init__(transport, clock=clock,
                         acknowledging=acknowledging if wait_replicas else None,
                         replicas_required=wait_replicas)
