"""Idempotent gateway calls: one provider call per Idempotency-Key, its answer kept for retries.

A client that retries (the openai SDK does, after a timeout or a 5xx) must neither start a second
call while the first still runs nor pay twice for one that finished. The first request with a
key claims it with an in-flight marker shared by every instance (lua/reply_claim.lua). A retry
that arrives meanwhile waits for the answer if it is a non-streaming call, for at most
IN_FLIGHT_WAIT_S_MAX; a streaming one, or one still waiting after that, is told to come back
(409 idempotency_in_flight, Retry-After). A finished call's answer is kept for the idempotency
window (core/limits.py IDEMPOTENCY_WINDOW_MS) and replayed. The same key with another request is
409 idempotency_conflict.

Only a successful answer is kept. A call that was refused, failed, or whose outcome is unknown
gives its key back, and a retry is then a new call that reserves its own worst case: retrying
can never carry spend past a ceiling. It can pay twice for a call whose first outcome was
unknown; those answers say `x-should-retry: false`, so the SDK does not retry them blindly.

What is kept is bounded: an answer is kept compressed, at most REPLY_STORED_BYTES_MAX of it, and
each API key keeps at most REPLY_BYTES_PER_KEY_MAX of answers and claims at most
REPLIES_PER_KEY_MAX keys a window (core/limits.py; past the claims, 429 state_quota). An answer
that is not kept leaves a note instead: a retry is answered 409 reply_not_kept with what became
of the call and what it was charged, never sent to the provider again.

Keys are namespaced by the API key that sent them (core/idempotency.py) and stored under the
caller's hash tag, so two keys that pick the same Idempotency-Key never meet, and on Redis
Cluster a reply lives on the shard of the budgets its call touched. The state behind them is the
store's (core/ledger.py ReplyStore); this module is the workflow one attempt goes through.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from core.errors import CeilingError, IdempotencyConflict, ensure
from core.idempotency import key_digest
from core.ledger import GATEWAY_OWNER_PREFIX, ClaimKind, Kept, ReplyRef, ReplyStore, StoredReply
from core.limits import IDEMPOTENCY_WINDOW_MS

if TYPE_CHECKING:
    from core.service import Caller

# Answers larger than this are not recorded while they are relayed (a retry then learns what
# became of the call, not its text): a chat answer is a few KB, a stream with its per-chunk
# framing tens of KB. It bounds what one call holds in memory to keep its answer.
REPLY_BYTES_MAX = 1024 * 1024
# An answer is kept compressed, and only if it then takes at most this: a stream's framing and
# logprobs compress several times over, and a key's quota (REPLY_BYTES_PER_KEY_MAX) then holds
# a dozen or more of the largest.
REPLY_STORED_BYTES_MAX = 256 * 1024
# Marks a body kept compressed (zlib, then base64: the store keeps text).
PACKED_PREFIX = "z:"
# zlib's default trade of speed for size; a kept answer is compressed once and rarely read.
ZLIB_LEVEL = 6
# A non-streaming retry waits this long for the original's answer: long enough for a retry that
# raced a call about to finish, short enough not to hold a connection through a long one.
IN_FLIGHT_WAIT_S_MAX = 3.0
IN_FLIGHT_RETRY_AFTER_S = 2
# Polls of the marker while waiting: first soon (a retry often races the original's last
# milliseconds), then at most a few times a second.
POLL_S_MIN = 0.02
POLL_S_MAX = 0.25


class ReplyNotKept(CeilingError):
    """The call with this Idempotency-Key finished, but its answer was not kept (too large, or
    past its key's quota of kept answers): the answer names what became of the call (`outcome`)
    and what it was charged (`charged_micros`); calling again needs a new key."""

    code = "reply_not_kept"


class IdempotencyInFlight(CeilingError):
    """The call with this Idempotency-Key is still running; retry after `retry_after_s`."""

    code = "idempotency_in_flight"


def reply_ref(caller: Caller, idempotency_key: str) -> ReplyRef:
    return ReplyRef(caller.tag, key_digest(caller.key.key_id, idempotency_key),
                    GATEWAY_OWNER_PREFIX + caller.key.key_id)


def packed(reply: StoredReply) -> StoredReply:
    """`reply` with its body compressed, as it is kept."""
    body = base64.b64encode(zlib.compress(reply.body.encode(), ZLIB_LEVEL)).decode()
    return StoredReply(reply.status, reply.headers, PACKED_PREFIX + body)


def unpacked(reply: StoredReply) -> StoredReply:
    """A kept reply as it was answered."""
    if not reply.body.startswith(PACKED_PREFIX):
        return reply
    body = zlib.decompress(base64.b64decode(reply.body.removeprefix(PACKED_PREFIX)))
    return StoredReply(reply.status, reply.headers, body.decode())


@dataclass(frozen=True)
class Ticket:
    """The claim one attempt holds on its idempotency key, until it completes or abandons it."""

    store: ReplyStore
    ref: ReplyRef
    token: str

    async def complete(self, reply: StoredReply | None, not_kept: StoredReply) -> Kept:
        """Keep `reply` (None: it was too large to record) for the key's retries, compressed;
        where it cannot be kept (too large, or past the key's quota), keep `not_kept`, the
        answer a retry gets instead."""
        ensure(reply is None or len(reply.body) <= REPLY_BYTES_MAX,
               "an answer to keep fits REPLY_BYTES_MAX")
        if reply is not None:
            kept = packed(reply)
            if len(kept.body) <= REPLY_STORED_BYTES_MAX:
                done = await self.store.complete(self.ref, self.token, kept,
                                                 IDEMPOTENCY_WINDOW_MS)
                if done is not Kept.OVER:
                    return done
        await self.store.complete(self.ref, self.token, packed(not_kept), IDEMPOTENCY_WINDOW_MS,
                                  counted=False)
        return Kept.OVER

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

    `request_fingerprint`: core.idempotency.fingerprint of what makes the request this call.
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
            return unpacked(found.reply)
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
