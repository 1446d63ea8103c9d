"""ScriptedReplies: the ReplyStore (core/ledger.py) of every backend that runs the lua/ scripts."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from core.errors import state_quota
from core.ledger import Claim, ClaimKind, Kept, ReplyRef, StoredReply
from core.stores import keys
from core.stores.scripts import script

if TYPE_CHECKING:  # the transport's module makes the store, which makes its ScriptedReplies
    from core.stores.scripted_core import Transport

class ScriptedReplies:
    """ReplyStore on a Redis-speaking backend, through the transport its ledger store uses."""

    def __init__(self, transport: Transport) -> None:
        self._t = transport

    async def claim(self, ref: ReplyRef, fingerprint: str, token: str, ttl_ms: int) -> Claim:
        reply = await self._t.run(
            script("reply_claim"),
            (keys.reply(ref.tag, ref.digest), keys.quota(ref.tag, ref.owner)),
            [fingerprint, token, str(ttl_ms)],
        )
        if reply[0] == "state_quota":
            raise state_quota(str(reply[1]), int(reply[2]))
        kind = ClaimKind(reply[0])
        if kind is not ClaimKind.DONE:
            return Claim(kind)
        headers = tuple((str(k), str(v)) for k, v in json.loads(reply[2]))
        return Claim(kind, StoredReply(int(reply[1]), headers, str(reply[3])))

    async def complete(self, ref: ReplyRef, token: str, reply: StoredReply, ttl_ms: int,
                       *, counted: bool = True) -> Kept:
        result = await self._t.run(
            script("reply_complete"),
            (keys.reply(ref.tag, ref.digest), keys.quota(ref.tag, ref.owner)),
            [token, str(reply.status), json.dumps(reply.headers), reply.body, str(ttl_ms),
             "1" if counted else "0"],
        )
        return Kept(result[0])

    async def abandon(self, ref: ReplyRef, token: str) -> None:
        await self._t.run(script("reply_abandon"), (keys.reply(ref.tag, ref.digest),), [token])
