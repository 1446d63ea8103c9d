"""What the cloud upstreams share: api/upstream.py's pooled HTTP client, with a path of its own
for each call (the cloud APIs name the model in the path) and headers made for each call (a
signature, a token). Claude's Messages body as the clouds take it is cloud_messages.py's.

Each cloud upstream is an api.upstream.Upstream: its answers are read (whole, an error's up to
its bound, a stream's chunks) and its failures sorted (NotSent, Unanswered, AnswerTooLarge) by
that class's code; a subclass says only where a call goes, with what, and how the answer is
turned into what the gateway's format reads.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from api.upstream import Upstream, relayed_headers
from core.formats import Plan
from core.upstream import Sent, Unanswered

if TYPE_CHECKING:
    import httpx


class CloudUpstream(Upstream):
    """An api.upstream.Upstream whose answers a subclass may relay more headers of
    (`headers_relayed`) and turn into its format's shapes (`finished`), and whose calls may go
    to a path made per call with headers made per call (api.upstream.Upstream's public
    `prepared_at` and `post`, which sort the failures as every call's are)."""

    # The answer's headers the client gets beside api/upstream.py's, by prefix.
    headers_relayed: tuple[str, ...] = ()

    def __init__(self, base_url: str, auth: tuple[str, str] | None, timeout_s: float,
                 **kwargs: Any) -> None:
        super().__init__(base_url, auth, timeout_s, **kwargs)
        self.base_url = base_url.rstrip("/")

    async def send(self, call_plan: Plan, deadline_s: float) -> Sent:
        """core.upstream.Upstream.send as api/upstream.py's, the answer then `finished`."""
        try:
            async with asyncio.timeout_at(deadline_s):
                response = await self.open(call_plan)
                if response.status_code < 400 and not call_plan.stream:
                    return self.finished(call_plan, await self.answer(call_plan, response))
        except TimeoutError as exc:
            raise Unanswered(f"no complete answer within {self.timeout_s} s") from exc
        return self.finished(call_plan, await self.answer(call_plan, response))

    def finished(self, call_plan: Plan, sent: Sent) -> Sent:
        """The answer as the client and the gateway's format read it; as it came, by default."""
        del call_plan
        return sent

    def relayed(self, response: httpx.Response) -> dict[str, str]:
        """The answer's headers the client gets."""
        headers = relayed_headers(response)
        if self.headers_relayed:
            for name, value in response.headers.items():
                if name.startswith(self.headers_relayed):
                    headers[name] = value
        return headers

    async def answer(self, call_plan: Plan, response: httpx.Response) -> Sent:
        """The Sent of `response` as api/upstream.py reads it (the caller holds the deadline
        for a complete answer)."""
        headers = self.relayed(response)
        if response.status_code >= 400:
            return (response.status_code, headers, await self.error_body(response))
        if call_plan.stream:
            return (response.status_code, headers, self.chunks(response))
        return (response.status_code, headers, await self.read(response))
