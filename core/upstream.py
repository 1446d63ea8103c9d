"""The gateway's port to a provider: what a call needs from whatever carries it there, and the
failures that decide the money. api/upstream.py implements it over HTTP; core/gateway.py runs a
call through it and tests/core/test_gateway_call.py through an in-memory one.

What a failure proves decides what becomes of the call's reservation:

    UpstreamFailure      (the port's; core/gateway.py turns each into a refusal of the tree)
    ├── NotSent          provably never reached the provider: the hold is released
    ├── Unanswered       may have reached it, and no complete answer came back in time (or its
    │                    stream broke off): the hold stays, as unknown
    └── AnswerTooLarge   answered more than the gateway reads (`answer_bytes_max`): the provider
                         ran the call and billed it, its usage left unread: the hold stays

Any failure after the first byte of the request left may come after the provider read it and
began billing; only one before it is NotSent.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol, TypeAlias

from core.formats import Api, Plan

Headers: TypeAlias = tuple[tuple[str, str], ...]


class UpstreamFailure(Exception):
    """A call that got no usable answer from its provider; which kind decides the money."""


class NotSent(UpstreamFailure):
    """The request provably never reached the provider."""


class Unanswered(UpstreamFailure):
    """The request may have reached the provider, and no answer came back."""


class AnswerTooLarge(UpstreamFailure):
    """The provider answered more than the gateway reads: it ran the call (and billed it); the
    rest of the answer, its usage with it, was left unread."""


# A provider's answer to a call, once its head arrived: (status, headers, body). `headers`: the
# provider's headers the client gets, a dict made for this call (the gateway adds the bill's to
# it). `body`: an error's body (what arrived of it, up to the port's bound) or a complete
# answer's, whole; or a streamed call's chunks as they come, which raise Unanswered if the
# stream breaks off and free the connection when closed. A plain tuple: one is made on every
# call, and a named tuple's constructor is a Python function, several times a tuple's cost.
Sent: TypeAlias = tuple[int, dict[str, str], bytes | AsyncGenerator[bytes, None]]


class Upstream(Protocol):
    """One provider's client, as the gateway calls it."""

    timeout_s: float  # an answer is awaited, and read, at most this long
    answer_bytes_max: int  # a complete answer's bound: past it, AnswerTooLarge

    async def send(self, call_plan: Plan, deadline_s: float) -> Sent:
        """Send the call. `deadline_s`, on the running loop's clock (loop.time()): by then its
        answer came, and a complete one (not streamed, status below 400) was read whole, or
        Unanswered. An error's body is read on past it (it is small, and its status already
        decided the money); a stream's chunks are the caller's to read under the deadline.
        NotSent, Unanswered, AnswerTooLarge as the module docstring says."""
        ...

    async def count(self, api: Api, content: bytes, headers: Headers, model: str = "") -> Sent:
        """A token count from the provider, its body whole; Unanswered for any failure: nothing
        is billed for a count, so no failure is more than the provider's or the network's.
        `model`: the name the provider knows the counted model by (a routed call's
        Routed.sent_model), for a client whose API names the model in its path (the body then
        names none); a client whose body names it reads the body's, which is the same name."""
        ...
