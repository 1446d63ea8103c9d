"""The connection the ledger's scripts go out on: RESP over an asyncio protocol, parsed by hiredis.

Two or more scripts run on every call the service serves, and redis-py's layers around one
command (its client's pool, retry object, response callbacks and telemetry; its connection's
stream reader and writer, health checks and per-read timeouts) cost several times what writing
the command and parsing its reply do. Here a command is packed by hiredis, written, and its
reply parsed by hiredis as it arrives, nothing else. Where to connect and how (host, port,
database, user and password, TLS) is what redis-py made of the URL (`Endpoint.of`): both
connect to the same server the same way. A setting this module does not carry out (a Unix
socket, a credential provider, any other connection class) leaves the scripts on redis-py's
client (`Endpoint.of` answers None).

One connection carries every call of its event loop, pipelined: the commands the loop's tasks
send while it runs one pass of its ready callbacks go out together in one write, at the end of
that pass, and Redis answers them in order, in as few writes. A connection per call in flight
made the server and the service each wake and make a system call for every command; under load
that was most of what a call cost Redis beyond its scripts. Replies are matched to commands by
their order alone, so a call that stops waiting (its task cancelled, its time bound passed)
breaks the connection: its reply, if it came, would be taken for the next command's. Every call
still in flight on a connection that breaks fails with redis-py's ConnectionError, which the
transport retries on a fresh connection (core/stores/redis.py): every script is safe to run
twice.

A call's time bound is an instant (`deadline_s`, on the event loop's clock) that the connection
watches for all its calls with one timer, re-armed for the earliest call still waiting when it
fires: a timer per call (asyncio.timeout), made and cancelled around every command, was a
share of every call's CPU, and nearly every call is answered long before its bound.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from dataclasses import dataclass
from typing import Any, cast

import hiredis
from redis import exceptions as rex
from redis.asyncio.client import Redis
from redis.asyncio.connection import Connection, SSLConnection


class ArgumentRefused(rex.ResponseError):
    """BADARG: a ledger script refused an argument before writing anything (lua/lib.lua). The
    arguments are ours, so this is a programmer error (core/stores/redis.py translates it)."""


# Error replies by their code, as redis-py raises them (its parser's table; BADARG, the ledger
# scripts' own code, is ours): an error reply carries no type but its first word. NOSCRIPT is how
# EVALSHA says to load the script; LOADING, NOAUTH and WRONGPASS are redis-py's ConnectionErrors
# (the connection cannot serve: retried on another one, unless the password is wrong); the
# others are refusals the transport reports as they are (core/stores/redis.py's FAILURES).
ERRORS_BY_CODE: dict[str, type[rex.RedisError]] = {
    "NOSCRIPT": rex.NoScriptError,
    "LOADING": rex.BusyLoadingError,
    "NOAUTH": rex.AuthenticationError,
    "WRONGPASS": rex.AuthenticationError,
    "NOPERM": rex.NoPermissionError,
    "READONLY": rex.ReadOnlyError,
    "OOM": rex.OutOfMemoryError,
    "BADARG": ArgumentRefused,
}

Command = tuple[str | int, ...]
# A call without a time bound of its own: its caller bounds it (RespConnection.acknowledged).
UNBOUNDED_S = float("inf")


def pack(command: Command) -> bytes:
    """A command as RESP."""
    # hiredis' stub types its argument as a 1-tuple; it takes a command of any length.
    packed: bytes = hiredis.pack_command(command)  # type: ignore[arg-type]
    return packed


def reply_error(message: str) -> rex.RedisError:
    """An error reply as the exception redis-py raises for it, its message whole."""
    return ERRORS_BY_CODE.get(message.split(" ", 1)[0], rex.ResponseError)(message)


@dataclass(frozen=True)
class Endpoint:
    """Where the scripts' connections go, and how they sign in."""

    host: str
    port: int
    db: int
    username: str | None
    password: str | None
    ssl_context: ssl.SSLContext | None
    connect_timeout_s: float | None
    encoding: str | None  # replies as str in this encoding, as the client decodes them; None: bytes

    @classmethod
    def of(cls, client: Redis) -> Endpoint | None:
        """The endpoint of `client`'s connections, as redis-py parsed it from the URL; None for
        a setting this module does not carry out (see the module docstring)."""
        pool = client.connection_pool
        if pool.connection_class not in (Connection, SSLConnection):
            return None
        # The connection redis-py would open, made but not opened: its settings are redis-py's
        # own reading of the URL and the client's arguments, its defaults and TLS settings
        # (certificates, verification, versions) included. Only public attributes are read:
        # tests/core/stores/test_redis_resp.py's test_the_endpoint_is_what_redis_py_made_of_the_url
        # fails if one of them moves.
        made = pool.connection_class(**pool.connection_kwargs)
        if not isinstance(made, Connection) or made.credential_provider is not None:
            return None
        return cls(made.host, made.port, int(made.db), made.username, made.password,
                   made.ssl_context.get() if isinstance(made, SSLConnection) else None,
                   made.socket_connect_timeout,
                   made.encoder.encoding if made.encoder.decode_responses else None)

    async def connect(self) -> RespConnection:
        """A connection, signed in and on the database, ready for a command."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout_s):
            _, connection = await loop.create_connection(
                lambda: RespConnection(self.encoding), self.host, self.port, ssl=self.ssl_context)
        try:
            if self.password is not None:
                await connection.call(pack(("AUTH", self.username, self.password)
                                           if self.username else ("AUTH", self.password)))
            if self.db:
                await connection.call(pack(("SELECT", self.db)))
        except BaseException:
            connection.close()
            raise
        return connection


class RespConnection(asyncio.Protocol):
    """One connection to Redis, carrying its calls pipelined; see the module docstring."""

    def __init__(self, encoding: str | None = "utf-8") -> None:
        self._reader = hiredis.Reader(encoding=encoding, replyError=reply_error)
        self._transport: asyncio.Transport | None = None
        # The calls sent and not yet answered, in the order their commands were written, each
        # with the instant it stops waiting (UNBOUNDED_S: its caller bounds it).
        self._waiting: deque[tuple[asyncio.Future[Any], float]] = deque()
        # The timer that fails the calls waiting past their bound (`_overdue`), and its instant.
        self._watch: asyncio.TimerHandle | None = None
        self._watch_at_s = UNBOUNDED_S
        # Commands of this pass of the event loop, written together at its end (`_flush`).
        self._unsent: list[bytes] = []
        self._broken: str | None = None
        # A WAIT written in this pass of the event loop, not yet sent: calls whose writes were
        # answered before it share it (`acknowledged`).
        self._wait_unsent: tuple[tuple[int, int], asyncio.Future[Any]] | None = None

    @property
    def usable(self) -> bool:
        return self._broken is None and self._transport is not None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are asyncio's by their methods, not by their classes.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        try:
            while (reply := self._reader.gets()) is not False:
                if not self._waiting:
                    self._break("the ledger sent a reply no command asked for")
                    return
                waiting, _ = self._waiting.popleft()
                if not waiting.done():
                    waiting.set_result(reply)
        except hiredis.ProtocolError as exc:
            self._break(f"the ledger's reply could not be parsed: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        self._break(f"the connection to the ledger was lost: {exc or 'closed by the server'}")

    def _break(self, why: str) -> None:
        self._broken = self._broken or why
        waiting, self._waiting = self._waiting, deque()
        self._unsent.clear()
        for call, _ in waiting:
            if not call.done():
                call.set_exception(rex.ConnectionError(self._broken))
        if self._watch is not None:
            self._watch.cancel()
        self._watch, self._watch_at_s = None, UNBOUNDED_S
        self.close()

    def _arm(self, loop: asyncio.AbstractEventLoop, deadline_s: float) -> None:
        """The watch fires by `deadline_s` at the latest (no watch is armed at UNBOUNDED_S)."""
        if deadline_s < self._watch_at_s:
            if self._watch is not None:
                self._watch.cancel()
            self._watch = loop.call_at(deadline_s, self._overdue)
            self._watch_at_s = deadline_s

    def _overdue(self) -> None:
        """Fail the calls waiting past their bound with TimeoutError, which breaks the
        connection (see the module docstring); else watch for the earliest bound left."""
        self._watch, self._watch_at_s = None, UNBOUNDED_S
        loop = asyncio.get_running_loop()
        now_s = loop.time()
        late = [call for call, deadline_s in self._waiting if deadline_s <= now_s]
        if late:
            for call in late:
                if not call.done():
                    # No message, as asyncio.timeout's: the transport says what it means.
                    call.set_exception(TimeoutError())
            self._break("a command's reply did not come within its time limit")
        elif self._waiting:
            self._arm(loop, min(deadline_s for _, deadline_s in self._waiting))

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def _flush(self) -> None:
        unsent, self._unsent = self._unsent, []
        self._wait_unsent = None
        if unsent and self._broken is None and self._transport is not None:
            self._transport.write(b"".join(unsent))

    def _queue(self, packed: bytes, deadline_s: float = UNBOUNDED_S) -> asyncio.Future[Any]:
        if self._broken is not None or self._transport is None:
            raise rex.ConnectionError(self._broken or "not connected")
        loop = asyncio.get_running_loop()
        waiting = loop.create_future()
        self._waiting.append((waiting, deadline_s))
        if deadline_s < self._watch_at_s:  # else the watch fires before this call's bound
            self._arm(loop, deadline_s)
        if not self._unsent:
            # Runs once the loop's callbacks ready now have run, and sent what they sent.
            loop.call_soon(self._flush)
        self._unsent.append(packed)
        return waiting

    async def acknowledged(self, replicas: int, timeout_ms: int) -> int:
        """Redis WAIT: how many replicas acknowledged every write this connection sent before
        now, waiting up to `timeout_ms` for `replicas` of them. Every call whose writes were
        answered before the WAIT goes out shares it: Redis blocks the connection for a WAIT, and
        one per call would queue each call's acknowledgement behind the one before."""
        shared = self._wait_unsent
        if shared is None or shared[0] != (replicas, timeout_ms):
            shared = ((replicas, timeout_ms),
                      self._queue(pack(("WAIT", str(replicas), str(timeout_ms)))))
            self._wait_unsent = shared
        # Shielded: one caller cancelled must not cancel the WAIT the others read.
        reply = await asyncio.shield(shared[1])
        if isinstance(reply, Exception):
            raise reply
        return int(reply)

    async def call(self, packed: bytes, deadline_s: float = UNBOUNDED_S) -> Any:
        """Send one packed command and return its reply; an error reply is raised, and
        TimeoutError once the event loop's clock passes `deadline_s` without it."""
        waiting = self._queue(packed, deadline_s)
        try:
            reply = await waiting
        except BaseException:
            if waiting.cancelled():
                # Stopped waiting before its reply: the reply may still come.
                self._break("a command's reply was not read")
            raise
        if isinstance(reply, Exception):
            raise reply
        return reply
