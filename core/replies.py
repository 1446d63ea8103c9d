"""Idempotent gateway calls: one provider call per Idempotency-Key, its answer kept for retries.

A client that retries (the openai SDK does, after a timeout or a 5xx) must neither start a second
call while the first still runs nor pay twice for one that finished. The first request with a
key claims it with an in-flight marker shared by every instance (lua/reply_claim.lua). A retry
that arrives meanwhile waits for the answer if it is a non-streaming call, for at most
IN_FLIGHT_WAIT_S_MAX; a streaming one, or one still waiting after that, is told to come back
(409 idempotency_in_flight, Retry-After). A finished call's answer is kept for REPLY_TTL_MS and
replayed. The same key with another request is 409 idempotency_conflict.

Only a successful answer is kept. A call that was refused, failed, or whose outcome is unknown
gives its key back, and a retry is then a new call that reserves its own worst case: retrying
can never carry spend past a ceiling. It can pay twice for a call whose first outcome was
unknown; those answers say `x-should-retry: false`, so the SDK does not retry them blindly.

Keys are namespaced by the API key that sent them and stored under the caller's hash tag, so
two keys that pick the same Idempotency-Key never meet, and on Redis Cluster a reply lives on
the shard of the budgets its call touched.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

from core.errors import CeilingError, IdempotencyConflict, InvalidRequest, ensure
from core.limits import RESERVATION_ID_LEN_MAX
from core.stores.scripts import script

if TYPE_CHECKING:
    from core.service import Caller
    from core.stores.scripted import Transport

# A finished call's answer is replayed for a day: SDK retries come within minutes, and an agent
# that resumes a run the next morning should make new calls.
REPLY_TTL_MS = 24 * 3_600_000
# Answers larger than this are not kept (a retry then learns the call finished, not its text): a
# chat answer is a few KB, a stream with its per-chunk framing tens of KB.
REPLY_BYTES_MAX = 1024 * 1024
# A non-streaming retry waits this long for the original's answer: long enough for a retry that
# raced a call about to finish, short enough not to hold a connection through a long one.
IN_FLIGHT_WAIT_S_MAX = 3.0
IN_FLIGHT_RETRY_AFTER_S = 2
# Polls of the marker while waiting: first soon (a retry often races the original's last
# milliseconds), then at most a few times a second.
POLL_S_MIN = 0.02
POLL_S_MAX = 0.25
_IDEMPOTENCY_KEY = re.compile(rf"[\x21-\x7e]{{1,{RESERVATION_ID_LEN_MAX}}}")


class IdempotencyInFlight(CeilingError):
    """The call with this Idempotency-Key is still running; retry after `retry_after_s`."""

    code = "idempotency_in_flight"


@dataclass(frozen=True)
class ReplyRef:
    """One idempotency key of one API key: the caller's hash tag and a digest of both keys."""

    tag: str
    digest: str

    @property
    def redis_key(self) -> str:
        return f"sc:{{{self.tag}}}:reply:{self.digest}"


@dataclass(frozen=True)
class StoredReply:
    """A finished call's answer as the client got it: status, the headers to replay, the body."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: str


class ClaimKind(StrEnum):
    CLAIMED = "claimed"
    IN_FLIGHT = "in_flight"
    DONE = "done"
    CONFLICT = "conflict"


@dataclass(frozen=True)
class Claim:
    kind: ClaimKind
    reply: StoredReply | None = None


class ReplyStore(Protocol):
    """The shared state behind idempotency keys. Every operation is atomic and safe to repeat."""

    async def claim(self, ref: ReplyRef, fingerprint: str, token: str, ttl_ms: int) -> Claim:
        """Claim the key for the attempt `token` for `ttl_ms`, or say what became of it."""
        ...

    async def complete(self, ref: ReplyRef, token: str, reply: StoredReply, ttl_ms: int) -> bool:
        """Keep `reply` for `ttl_ms`; False if `token` no longer holds the key."""
        ...

    async def abandon(self, ref: ReplyRef, token: str) -> None:
        """Give the key back if `token` holds it in flight."""
        ...


def _claim_of(reply: Sequence[Any]) -> Claim:
    kind = ClaimKind(reply[0])
    if kind is not ClaimKind.DONE:
        return Claim(kind)
    headers = tuple((str(k), str(v)) for k, v in json.loads(reply[2]))
    return Claim(kind, StoredReply(int(reply[1]), headers, str(reply[3])))


class ScriptedReplies:
    """ReplyStore on a Redis-speaking backend, through the transport its ledger store uses."""

    def __init__(self, transport: Transport) -> None:
        self._t = transport

    async def claim(self, ref: ReplyRef, fingerprint: str, token: str, ttl_ms: int) -> Claim:
        reply = await self._t.run(
            script("reply_claim"), (ref.redis_key,), [fingerprint, token, str(ttl_ms)]
        )
        return _claim_of(reply)

    async def complete(self, ref: ReplyRef, token: str, reply: StoredReply, ttl_ms: int) -> bool:
        result = await self._t.run(
            script("reply_complete"), (ref.redis_key,),
            [token, str(reply.status), json.dumps(reply.headers), reply.body, str(ttl_ms)],
        )
        return bool(result[0] == "ok")

    async def abandon(self, ref: ReplyRef, token: str) -> None:
        await self._t.run(script("reply_abandon"), (ref.redis_key,), [token])


@dataclass
class _Entry:
    fingerprint: str
    token: str
    expires_at_ms: int
    reply: StoredReply | None = None


def _wall_clock_ms() -> int:
    return int(time.time() * 1000)


class MemoryReplies:
    """ReplyStore in one process's memory, beside MemoryStore; same semantics as the scripts.

    Atomic for the same reason MemoryStore is: no operation awaits between reading and writing.
    Expired entries are dropped when their key is next touched, and a bounded batch of them on
    every claim, so memory does not grow with keys nobody retries.
    """

    PRUNE_BATCH_MAX = 64

    def __init__(self, clock: Callable[[], int] = _wall_clock_ms) -> None:
        self._clock = clock
        self._entries: dict[str, _Entry] = {}

    def _live(self, key: str, now_ms: int) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is not None and entry.expires_at_ms <= now_ms:
            del self._entries[key]
            return None
        return entry

    def _prune(self, now_ms: int) -> None:
        expired = [k for k, e in itertools.islice(self._entries.items(), self.PRUNE_BATCH_MAX)
                   if e.expires_at_ms <= now_ms]
        for key in expired:
            del self._entries[key]

    async def claim(self, ref: ReplyRef, fingerprint: str, token: str, ttl_ms: int) -> Claim:
        now_ms = self._clock()
        self._prune(now_ms)
        entry = self._live(ref.redis_key, now_ms)
        if entry is None:
            self._entries[ref.redis_key] = _Entry(fingerprint, token, now_ms + ttl_ms)
            return Claim(ClaimKind.CLAIMED)
        if entry.fingerprint != fingerprint:
            return Claim(ClaimKind.CONFLICT)
        if entry.reply is not None:
            return Claim(ClaimKind.DONE, entry.reply)
        return Claim(ClaimKind.CLAIMED if entry.token == token else ClaimKind.IN_FLIGHT)

    async def complete(self, ref: ReplyRef, token: str, reply: StoredReply, ttl_ms: int) -> bool:
        entry = self._live(ref.redis_key, self._clock())
        if entry is None or entry.token != token:
            return False
        if entry.reply is None:
            entry.reply = reply
            entry.expires_at_ms = self._clock() + ttl_ms
        return True

    async def abandon(self, ref: ReplyRef, token: str) -> None:
        entry = self._live(ref.redis_key, self._clock())
        if entry is not None and entry.reply is None and entry.token == token:
            del self._entries[ref.redis_key]


def reply_ref(caller: Caller, idempotency_key: str) -> ReplyRef:
    if not _IDEMPOTENCY_KEY.fullmatch(idempotency_key):
        raise InvalidRequest(
            f"Idempotency-Key must be 1 to {RESERVATION_ID_LEN_MAX} printable ASCII characters",
            field="Idempotency-Key",
        )
    digest = hashlib.sha256(f"{caller.key.key_id}\n{idempotency_key}".encode()).hexdigest()[:32]
    return ReplyRef(caller.tag, digest)


def fingerprint(*parts: object) -> str:
    """A digest of everything that makes two requests the same call."""
    canonical = json.dumps(parts, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Ticket:
    """The claim one attempt holds on its idempotency key, until it completes or abandons it."""

    store: ReplyStore
    ref: ReplyRef
    token: str

    async def complete(self, reply: StoredReply) -> None:
        ensure(len(reply.body) <= REPLY_BYTES_MAX, "an answer to keep fits REPLY_BYTES_MAX")
        await self.store.complete(self.ref, self.token, reply, REPLY_TTL_MS)

    async def abandon(self) -> None:
        await self.store.abandon(self.ref, self.token)


async def claim(
    store: ReplyStore,
    ref: ReplyRef,
    request_fingerprint: str,
    *,
    wait: bool,
    in_flight_ttl_ms: int,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> Ticket | StoredReply:
    """The ticket to make the call, or the answer of the call already made with this key.

    Raises IdempotencyConflict for another request under the same key, IdempotencyInFlight when
    the call is still running and this attempt may not (or may no longer) wait for it.
    """
    token = uuid.uuid4().hex
    deadline = clock() + IN_FLIGHT_WAIT_S_MAX
    pause_s = POLL_S_MIN
    while True:
        found = await store.claim(ref, request_fingerprint, token, in_flight_ttl_ms)
        if found.kind is ClaimKind.CLAIMED:
            return Ticket(store, ref, token)
        if found.kind is ClaimKind.DONE:
            assert found.reply is not None
            return found.reply
        if found.kind is ClaimKind.CONFLICT:
            raise IdempotencyConflict(
                "this Idempotency-Key was used with another request; use a new key for a new "
                "call"
            )
        if not wait or clock() + pause_s > deadline:
            raise IdempotencyInFlight(
                "the call with this Idempotency-Key is still running; retry to get its answer",
                retry_after_s=IN_FLIGHT_RETRY_AFTER_S,
            )
        await sleep(pause_s)
        pause_s = min(pause_s * 2, POLL_S_MAX)
