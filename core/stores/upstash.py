"""UpstashStore: the ledger over Upstash's REST API, through the upstash-redis SDK's asyncio client.

What the SDK (1.8) does, and what this module does about it:
- Its httpx client is created with `timeout=None`: a request to an endpoint that stopped
  answering waits forever. Every call here is bounded by `asyncio.timeout`.
- It replays a request after any exception, a lost reply included (`rest_retries`, default one
  replay after a 3 s pause). A script whose reply was lost runs again: that is safe only because
  every script is idempotent by reservation id (see lua/reserve.lua) and every other command
  ScriptedStore sends (reads, SET NX, HSET, DEL, ZADD, FUNCTION LOAD) means the same when
  repeated. The replay
  is kept, after a short pause, because the common lost reply is a keep-alive connection the
  server closed while idle, which a new connection cures.
- It does not look at the HTTP status: a wrong token comes back as the error `Unauthorized`,
  which is told apart here and reported as `ledger_auth`.
- Replies are base64 on the wire and decoded by the SDK, then shaped per command (TIME as a pair
  of ints, SET as a bool) much as redis-py shapes them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

import httpx
from upstash_redis.asyncio import Redis as UpstashRedis
from upstash_redis.errors import UpstashError

from core.errors import CeilingError, InvariantBroken, LedgerUnavailable, ensure
from core.stores.durability import Durability, durability_of
from core.stores.scripted import Clock, ScriptedStore
from core.stores.scripts import (
    Script,
    function_missing,
    functions_unknown,
    library,
    library_exists,
)

# One ledger call, the SDK's replay and a script load included, before the caller fails closed.
# Upstash answers from its region in tens of milliseconds and a new TLS connection adds a few
# round trips; two seconds is an outage, not load.
UPSTASH_CALL_TIMEOUT_S = 2.0
# Replays of a request whose reply was lost, and the pause before one: long enough to let a
# closed connection be replaced, short enough to fit in the call's timeout.
REPLAYS_MAX = 1
REPLAY_PAUSE_S = 0.05
# How Upstash (and Redis behind it) says the token is wrong or missing. The SDK raises one type,
# UpstashError, for every error reply and for a refused token alike, with the reply's text and
# not its HTTP status: the text's start (Redis's error code, or Upstash's "Unauthorized") is all
# that tells them apart. Transport failures have httpx's types and are told apart by type.
AUTH_ERRORS = ("Unauthorized", "WRONGPASS", "NOAUTH")


def translate(exc: BaseException, call_timeout_s: float) -> CeilingError:
    """The core error for an SDK or httpx exception; stores never let a client exception out."""
    if isinstance(exc, UpstashError):
        message = str(exc)
        if message.startswith("BADARG"):
            return InvariantBroken(f"the ledger refused an argument: {message}")
        if message.startswith(AUTH_ERRORS):
            return LedgerUnavailable(
                f"Upstash refused the token ({message}): check UPSTASH_REDIS_REST_TOKEN "
                "(or KV_REST_API_TOKEN); it is the REST token, not the database password",
                reason="ledger_auth",
            )
        return LedgerUnavailable(f"the ledger answered with an error: {message}",
                                 reason="ledger_error")
    if isinstance(exc, TimeoutError):
        return LedgerUnavailable(f"Upstash did not answer within {call_timeout_s} s",
                                 reason="ledger_unreachable")
    if isinstance(exc, httpx.TransportError | OSError):
        return LedgerUnavailable(f"Upstash is unreachable: {exc!r}", reason="ledger_unreachable")
    # A body that is not Upstash's JSON (a proxy's HTML error page, a reply without "result").
    return LedgerUnavailable(f"the ledger's reply is not Upstash's protocol: {exc!r}",
                             reason="ledger_error")


def is_noscript(exc: UpstashError) -> bool:
    """Whether EVALSHA found no script: Redis's NOSCRIPT code, or the words of Redis's NOSCRIPT
    message should a reply come without its code (redis-py, for one, moves a known code out of
    the message)."""
    message = str(exc)
    return message.startswith("NOSCRIPT") or "no matching script" in message.lower()


class UpstashTransport:
    backend = "upstash"

    def __init__(
        self, client: UpstashRedis, *, call_timeout_s: float = UPSTASH_CALL_TIMEOUT_S,
        functions: bool = True,
    ) -> None:
        self._client = client
        self._call_timeout_s = call_timeout_s
        # Whether to call the library's functions (Upstash has them): a server without them
        # says so at the first call, and each call then runs as a script of its own.
        self._functions = functions

    @contextlib.asynccontextmanager
    async def _call(self) -> AsyncIterator[None]:
        """Bounds one ledger call in time and turns whatever the SDK raises into a core error."""
        try:
            async with asyncio.timeout(self._call_timeout_s):
                yield
        except (UpstashError, httpx.HTTPError, OSError, TimeoutError, ValueError, KeyError) as exc:
            raise translate(exc, self._call_timeout_s) from exc

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[str]) -> Any:
        async with self._call():
            if self._functions and script.function:
                fcall = ["FCALL", script.function, str(len(keys)), *keys, *args]
                try:
                    return await self._client.execute(fcall)
                except UpstashError as exc:
                    if function_missing(str(exc)):
                        await self._load_library()
                        return await self._client.execute(fcall)
                    if not functions_unknown(str(exc)):
                        raise
                    self._functions = False
            evalsha = ["EVALSHA", script.sha1, str(len(keys)), *keys, *args]
            try:
                return await self._client.execute(evalsha)
            except UpstashError as exc:
                if not is_noscript(exc):
                    raise
            # SCRIPT LOAD, not EVAL: it guarantees the next EVALSHA finds the script.
            loaded = await self._client.execute(["SCRIPT", "LOAD", script.source])
            ensure(loaded == script.sha1, f"the ledger hashed {script.name} as we do")
            return await self._client.execute(evalsha)

    async def _load_library(self) -> None:
        try:
            await self._client.execute(["FUNCTION", "LOAD", library().source])
        except UpstashError as exc:
            if not library_exists(str(exc)):
                raise

    async def execute(self, *args: str) -> Any:
        async with self._call():
            return await self._client.execute(list(args))

    async def durability(self) -> Durability:
        # Upstash persists every write to its own storage (its documentation), whatever its
        # INFO says of AOF; the rest of what it says (an eviction policy, keys evicted, a
        # server id) counts.
        try:
            async with self._call():
                return replace(durability_of(await self._client.execute(["INFO"])), aof=None)
        except LedgerUnavailable as exc:
            if exc.reason != "ledger_error":
                raise
            return Durability()  # INFO refused: nothing told

    async def close(self) -> None:
        await self._client.close()


def upstash_client(url: str, token: str) -> UpstashRedis:
    return UpstashRedis(
        url,
        token,
        rest_retries=REPLAYS_MAX,
        rest_retry_interval=REPLAY_PAUSE_S,
        # Headers naming our runtime on every decision tell the provider nothing it needs.
        allow_telemetry=False,
        # Each reply's sync token makes the next read of this client see its writes, even where
        # Upstash serves reads from a replica.
        read_your_writes=True,
    )


class UpstashStore(ScriptedStore):
    """The shared ledger on Upstash. Safe to replay: every script is idempotent by id."""

    def __init__(
        self,
        url: str,
        token: str,
        *,
        clock: Clock | None = None,
        call_timeout_s: float = UPSTASH_CALL_TIMEOUT_S,
        functions: bool = True,
    ) -> None:
        super().__init__(
            UpstashTransport(upstash_client(url, token), call_timeout_s=call_timeout_s,
                             functions=functions),
            clock=clock,
        )
