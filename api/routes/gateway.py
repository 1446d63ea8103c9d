"""The OpenAI-compatible gateway: POST /v1/chat/completions and /v1/responses, enforced.

Each call goes price -> reserve -> call -> settle (core/gateway.py decides the money), with API
keys that have the `gateway` role. Every answer says what the call held and cost:

  x-ceiling-reservation-id         the call's reservation, for an operator's correction
                                   (POST /v1/admin/reservations/{id}/settle); it grants the key
                                   nothing: the reservation is not the key's to settle or release
  x-ceiling-reserved-micros        what was held for the call
  x-ceiling-charged-micros         what it was charged (for an unknown outcome: what expiry will
                                   charge unless a settle corrects it)
  x-ceiling-remaining-micros       the tightest budget on the key's path, after this call
  x-ceiling-run-remaining-micros   the run's budget, with X-Ceiling-Run-Id
  x-ceiling-billing-outcome        billed | estimated | unknown | released (core.gateway.Outcome)
  x-ceiling-clamped-output-tokens  the output cap sent, when X-Ceiling-Clamp: 1 lowered it

A stream's headers leave before its charge is known: they carry the reservation id, the amount
reserved and the remaining budgets with the hold in place; the charge, the remaining budgets
after it and the outcome follow in an SSE comment at the end of the stream (before the chat
stream's `data: [DONE]`), one `: <header>: <value>` line each, which SSE clients skip.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from api import errors
from api.openai_errors import OpenAIErrorRoute, openai_error_response
from api.routes.sidecar import authenticated
from api.runtime import runtime
from api.upstream import NotSent, Unanswered, Upstream, relayed_headers, upstream
from core import gateway, idempotency, replies
from core.errors import CeilingError, IdempotencyConflict
from core.gateway import (
    Api,
    Bill,
    Call,
    Outcome,
    Plan,
    StreamTally,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from core.ledger import Role, StoredReply
from core.replies import REPLY_BYTES_MAX, Ticket
from core.service import Caller, CeilingService

if TYPE_CHECKING:
    import httpx

router = APIRouter(prefix="/v1", route_class=OpenAIErrorRoute)
LENGTHS = gateway.OutputLengths()
SETTLED = frozenset({Outcome.BILLED, Outcome.ESTIMATED})
DONE_EVENT = b"data: [DONE]\n\n"


@router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await serve(request, Api.CHAT)


@router.post("/responses")
async def responses(request: Request) -> Response:
    return await serve(request, Api.RESPONSES)


async def serve(request: Request, api: Api) -> Response:
    svc, who = await authenticated(request, Role.GATEWAY)
    config = runtime().config
    call_plan = (
        gateway.plan(api, await request.body(), config.output_tokens_default)
        if config else gateway.plan(api, await request.body())
    )
    clamp = request.headers.get("x-ceiling-clamp") == "1"
    idempotency_key = request.headers.get("idempotency-key")
    if idempotency_key is None:
        return await forward(svc, who, call_plan, clamp, None)
    claimed = await replies.claim(
        svc.store.replies,
        replies.reply_ref(who, idempotency_key),
        idempotency.fingerprint(api.value, call_plan.body, who.run_id, clamp),
        wait=not call_plan.stream,
        in_flight_ttl_ms=svc.lease_ttl_ms,
    )
    if isinstance(claimed, StoredReply):
        return Response(claimed.body.encode(), status_code=claimed.status,
                        headers={**dict(claimed.headers), "x-ceiling-replayed": "true"})
    try:
        return await forward(svc, who, call_plan, clamp, claimed)
    except BaseException:
        await claimed.abandon()
        raise


def bill_headers(bill: Bill, call: Call, *, final: bool = True) -> dict[str, str]:
    headers = {
        "x-ceiling-reservation-id": bill.reservation_id,
        "x-ceiling-reserved-micros": str(bill.reserved_micros),
    }
    if final:
        headers["x-ceiling-charged-micros"] = str(bill.charged_micros)
        headers["x-ceiling-billing-outcome"] = bill.outcome.value
    if bill.remaining_micros is not None:
        headers["x-ceiling-remaining-micros"] = str(bill.remaining_micros)
    if bill.run_remaining_micros is not None:
        headers["x-ceiling-run-remaining-micros"] = str(bill.run_remaining_micros)
    if call.hold.clamped:
        headers["x-ceiling-clamped-output-tokens"] = str(call.hold.plan.output_tokens_max)
    if final and bill.outcome is Outcome.UNKNOWN:
        headers["x-should-retry"] = "false"  # a blind retry could pay for the call twice
    return headers


async def give_back(ticket: Ticket | None) -> None:
    """Free the idempotency key of a call that leaves no answer to replay."""
    if ticket is not None:
        await ticket.abandon()


async def keep(ticket: Ticket | None, status: int, headers: dict[str, str], body: bytes | None,
               outcome: Outcome) -> None:
    """Keep a settled call's answer for its idempotency key (None: too large to keep, so a
    retry learns only that the call finished); give the key back if it was not settled."""
    if ticket is None or outcome not in SETTLED:
        await give_back(ticket)
        return
    if body is None or len(body) > REPLY_BYTES_MAX:
        tombstone = openai_error_response(IdempotencyConflict(
            "the call with this Idempotency-Key finished, but its answer was too large to keep "
            "for replay; use a new key to call again"), {})
        status, body = tombstone.status_code, bytes(tombstone.body)
        headers = {k: v for k, v in tombstone.headers.items() if k != "content-length"}
    reply = StoredReply(status, tuple(headers.items()), body.decode(errors="replace"))
    await ticket.complete(reply)


class KeptResponse(Response):
    """A non-streaming answer, kept for its idempotency key once it has been sent.

    The client need not wait for a ledger round trip that only a retry reads: a retry that
    comes meanwhile finds the key in flight and waits for the answer (non-streaming retries
    wait). It is kept even if sending failed, since that client is the one that retries; and
    within the request, so a shutdown or a serverless runtime lets it finish. A ledger failure
    here has no one left to tell: the in-flight marker then lives out its lease, and a retry
    after that makes a new call, which reserves for itself."""

    def __init__(self, body: bytes, status_code: int, headers: dict[str, str], ticket: Ticket,
                 outcome: Outcome) -> None:
        super().__init__(body, status_code=status_code, headers=headers)
        self._kept = (ticket, status_code, headers, body, outcome)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(CeilingError):
                await keep(*self._kept)


async def forward(
    svc: CeilingService, who: Caller, call_plan: Plan, clamp: bool, ticket: Ticket | None
) -> Response:
    up = upstream()  # a gateway with no provider refuses before it holds anything
    config = runtime().config
    p95 = bool(config and config.hold_p95)
    call = Call(svc, who, await gateway.hold(svc, who, call_plan, LENGTHS, clamp=clamp, p95=p95),
                LENGTHS)
    deadline = asyncio.get_running_loop().time() + up.timeout_s
    try:
        async with asyncio.timeout_at(deadline):
            response = await up.open(call.hold.plan)
    except NotSent as exc:
        bill = await call.release()
        await give_back(ticket)
        return openai_error_response(UpstreamUnreachable(
            f"the provider could not be reached ({exc}); nothing was sent and the reservation "
            "was released"), bill_headers(bill, call))
    except (Unanswered, TimeoutError):
        return await unanswered(call, up, ticket)
    if response.status_code >= 400:
        body = await up.error_body(response)
        bill = await call.release() if gateway.billed_nothing(response.status_code) else (
            call.leave_open())
        await give_back(ticket)
        return Response(body, status_code=response.status_code,
                        headers={**relayed_headers(response), **bill_headers(bill, call)})
    if call.hold.plan.stream:
        relay = Relay(call, response, deadline, ticket)
        return StreamingResponse(relay.body(), headers=relay.headers)
    try:
        async with asyncio.timeout_at(deadline):
            raw = await up.read(response)
    except (Unanswered, TimeoutError):
        await response.aclose()
        return await unanswered(call, up, ticket)
    found = gateway.body_outcome(call.hold.plan, raw)
    bill = call.leave_open() if found is None else await call.settle(found[0])
    headers = {**relayed_headers(response), **bill_headers(bill, call)}
    if ticket is None:
        return Response(raw, status_code=response.status_code, headers=headers)
    return KeptResponse(raw, response.status_code, headers, ticket, bill.outcome)


async def unanswered(call: Call, up: Upstream, ticket: Ticket | None) -> Response:
    bill = call.leave_open()
    await give_back(ticket)
    return openai_error_response(UpstreamTimeout(
        f"no complete answer from the provider within {up.timeout_s} s; the call may have been "
        f"billed, so its reservation {bill.reservation_id} stays held: it expires charged "
        "unless an operator corrects it from the provider's bill"), bill_headers(bill, call))


class Relay:
    """Relays a provider's stream to the client, reading it to its end whatever the client does.

    A provider bills what it generated whether or not anyone reads it, and hanging up does not
    tell the gateway how much that was: providers differ in whether and when a closed connection
    stops generation. So a client that goes away stops receiving, not the reading: a task of its
    own reads on to the usage the provider reports and settles from it, and the charge matches
    the provider's bill instead of a guess. Reading on may let a provider finish an answer it
    would have stopped; that costs at most the output cap the reservation already holds. The
    read is bounded by the call's deadline, which the lease outlives.

    A stream that ends before its terminal event (chat's `data: [DONE]`, a Responses stream's
    response.completed / .incomplete / .failed) has an unknown outcome, even if usage chunks came
    (a provider reporting cumulative usage sends one with every chunk; the provider may also have
    billed output it never sent: text lost in transit, hidden reasoning): its hold is kept, and
    the client gets an error event.
    """

    def __init__(self, call: Call, response: httpx.Response, deadline: float,
                 ticket: Ticket | None) -> None:
        self.call, self.response, self.deadline, self.ticket = call, response, deadline, ticket
        held = call.bill(call.hold.reservation.reserved_micros, Outcome.UNKNOWN)
        self.headers = {**relayed_headers(response), **bill_headers(held, call, final=False)}
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._client_gone = False
        self._recorded: list[bytes] | None = [] if ticket else None
        self._recorded_bytes = 0
        gateway.spawn(self._pump())

    def _emit(self, data: bytes) -> None:
        if not data:
            return
        if not self._client_gone:
            self._queue.put_nowait(data)
        if self._recorded is not None:
            self._recorded.append(data)
            self._recorded_bytes += len(data)
            if self._recorded_bytes > REPLY_BYTES_MAX:
                self._recorded = None  # too large to keep: stop holding it in memory

    async def body(self) -> AsyncIterator[bytes]:
        try:
            while (data := await self._queue.get()) is not None:
                yield data
        finally:
            self._client_gone = True

    async def _pump(self) -> None:
        try:
            tally = StreamTally(self.call.hold.plan)
            try:
                async with asyncio.timeout_at(self.deadline):
                    async for chunk in Upstream.chunks(self.response):
                        self._emit(tally.feed(chunk))
            except (Unanswered, TimeoutError):
                pass  # what was read is in the tally; whether it is complete decides below
            finally:
                await self.response.aclose()
            await self._finish(tally)
        finally:
            self._queue.put_nowait(None)

    async def _finish(self, tally: StreamTally) -> None:
        api = self.call.hold.plan.api
        complete = tally.finished
        bill = await self.call.settle(tally.usage) if complete else self.call.leave_open()
        if not complete:
            self._emit(broken_off_event(api, bill))
        self._emit(b"".join(f": {k}: {v}\n".encode()
                            for k, v in bill_headers(bill, self.call).items()) + b"\n")
        if complete and api is Api.CHAT:
            self._emit(DONE_EVENT)
        recorded = None if self._recorded is None else b"".join(self._recorded)
        await keep(self.ticket, 200, self.headers, recorded, bill.outcome)


def broken_off_event(api: Api, bill: Bill) -> bytes:
    """The error event a client's SDK raises on, for a stream the provider broke off."""
    exc = UpstreamTimeout(
        "the provider's stream broke off before its end; the call may have been billed, so its "
        f"reservation {bill.reservation_id} stays held: it expires charged unless an operator "
        "corrects it from the provider's bill")
    error = {"message": exc.message, "type": errors.STATUS[exc.code][1], "param": None,
             "code": exc.code}
    if api is Api.CHAT:
        return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"
    return b"event: error\ndata: " + json.dumps({"type": "error", **error}).encode() + b"\n\n"
