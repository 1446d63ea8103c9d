"""The gateway: one route per wire format (core/formats FORMATS): POST /v1/chat/completions and
/v1/responses (OpenAI's) and /v1/messages (Anthropic's), enforced.

Each call goes price -> reserve -> call -> settle (core/gateway.py decides the money), with API
keys that have the `gateway` role (sent as a bearer token, or as the format's own clients send
theirs: `x-api-key` on /v1/messages). Refusals come in the route's format's error shape
(api/refusals.py). Every answer says what the call held and cost:

  x-ceiling-reservation-id         the call's reservation, for an operator's correction
                                   (POST /v1/admin/reservations/{id}/settle); it grants the key
                                   nothing: the reservation is not the key's to settle or release
  x-ceiling-reserved-micros        what was held for the call
  x-ceiling-charged-micros         what it was charged (for an unknown outcome: what expiry will
                                   charge unless a settle corrects it)
  x-ceiling-remaining-micros       the tightest budget on the key's path, after this call
  x-ceiling-run-remaining-micros   the run's budget, with X-Ceiling-Run-Id
  x-ceiling-billing-outcome        billed | estimated | unknown | released (core.gateway.Outcome)
  x-ceiling-clamped-output-tokens  the output cap sent, when X-Ceiling-Clamp: 1 (or the budget's
                                   `clamp`) lowered it
  x-ceiling-bounds-added           the bounds the gateway set where the request gave none, as
                                   `field=value, ...` (the output cap; max_tool_calls or a web
                                   search tool's max_uses)

A stream's headers leave before its charge is known: they carry the reservation id, the amount
reserved and the remaining budgets with the hold in place; the charge, the remaining budgets
after it and the outcome follow in an SSE comment at the end of the stream (after a Responses or
Messages stream's last event; before the chat stream's `data: [DONE]`, which its format holds
back for after it: WireFormat.stream_end), one `: <header>: <value>` line each, which SSE
clients skip.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from api.refusals import error_event, refusal_response, refusals_in
from api.routes.sidecar import authenticated
from api.routing import HotRoute, format_route
from api.runtime import runtime
from api.upstream import (
    AnswerTooLarge,
    NotSent,
    Unanswered,
    Upstream,
    relayed_headers,
    upstream,
)
from core import gateway, idempotency, replies
from core.errors import CeilingError, ensure
from core.formats import FORMATS, Api, Plan, StreamTally, WireFormat
from core.gateway import (
    Bill,
    Call,
    Outcome,
    UpstreamAnswerTooLarge,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from core.ledger import Role, StoredReply
from core.replies import REPLY_BYTES_MAX, ReplyNotKept, Ticket
from core.service import Caller, CeilingService

if TYPE_CHECKING:
    import httpx

LENGTHS = gateway.OutputLengths()
# Headers the gateway reads beyond the key and the run (api/routing.py HEADERS_COMMON).
HEADERS = ("Idempotency-Key", "X-Ceiling-Clamp")
SETTLED = frozenset({Outcome.BILLED, Outcome.ESTIMATED})
# The request bodies the OpenAPI document shows (documentation only), by format.
BODIES = {api: wire.body_schema for api, wire in FORMATS.items()}


async def serve(request: Request, wire: WireFormat) -> Response:
    svc, who = await authenticated(request, Role.GATEWAY, x_api_key=wire.key_header is not None)
    config = runtime().config
    forwarded = wire.forwarded_headers
    headers = tuple((k, v) for k, v in request.headers.items()
                    if k in forwarded) if forwarded else ()
    call_plan = (
        gateway.plan(wire.api, await request.body(), config.output_tokens_default, headers,
                     config.gateway_fields_allowed, config.gateway_betas_allowed)
        if config else gateway.plan(wire.api, await request.body(), headers=headers)
    )
    # The body's user field is checked whether or not the header names the user; the header
    # wins.
    body_user = wire.end_user(call_plan.body)
    if who.user is None:
        who = who.for_user(body_user)
    clamp = request.headers.get("x-ceiling-clamp") == "1"
    idempotency_key = request.headers.get("idempotency-key")
    if idempotency_key is None:
        return await forward(svc, who, call_plan, clamp, None)
    claimed = await replies.claim(
        runtime().store().replies,
        replies.reply_ref(who, idempotency_key),
        idempotency.fingerprint(wire.api.value, call_plan.body, who.run_id, clamp,
                                call_plan.headers, *(() if who.user is None else (who.user,))),
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
    if bill.user_remaining_micros is not None:
        headers["x-ceiling-user-remaining-micros"] = str(bill.user_remaining_micros)
    if call.hold.clamped:
        headers["x-ceiling-clamped-output-tokens"] = str(call.hold.plan.output_tokens_max)
    if call.hold.plan.bounds_added:
        headers["x-ceiling-bounds-added"] = ", ".join(
            f"{field}={value}" for field, value in call.hold.plan.bounds_added)
    if final and bill.outcome is Outcome.UNKNOWN:
        headers["x-should-retry"] = "false"  # a blind retry could pay for the call twice
    return headers


async def give_back(ticket: Ticket | None) -> None:
    """Free the idempotency key of a call that leaves no answer to replay."""
    if ticket is not None:
        await ticket.abandon()


async def keep(ticket: Ticket | None, status: int, headers: dict[str, str], body: bytes | None,
               bill: Bill, *, api: Api) -> None:
    """Keep a settled call's answer for its idempotency key (None: too large to record), or
    where it cannot be kept, what a retry is told instead (409 reply_not_kept, with what became
    of the call and what it was charged); give the key back if it was not settled."""
    if ticket is None or bill.outcome not in SETTLED:
        await give_back(ticket)
        return
    note = refusal_response(FORMATS[api], ReplyNotKept(
        "the call with this Idempotency-Key finished, but its answer was not kept for replay "
        "(too large, or past this key's quota of kept answers): it was not called again. Use a "
        "new key to call again", outcome=bill.outcome.value, charged_micros=bill.charged_micros,
        reservation_id=bill.reservation_id), {})
    not_kept = StoredReply(note.status_code, tuple(
        (k, v) for k, v in note.headers.items() if k != "content-length"),
        bytes(note.body).decode())
    reply = None if body is None or len(body) > REPLY_BYTES_MAX else StoredReply(
        status, tuple(headers.items()), body.decode(errors="replace"))
    await ticket.complete(reply, not_kept)


def kept_while_sent(raw: bytes, status: int, headers: dict[str, str], ticket: Ticket,
                    bill: Bill, *, api: Api) -> Response:
    """A non-streaming answer, kept for its idempotency key while it is sent.

    The client need not wait for a ledger round trip that only a retry reads: the keeping runs
    in a task of its own beside the sending, and a retry that comes meanwhile finds the key in
    flight and waits for the answer (non-streaming retries wait). It is kept even if sending
    fails, since that client is the one that retries; and a request that was answered ends only
    once it is kept, so a shutdown or a serverless runtime lets it finish. A ledger failure here
    has no one left to tell: the in-flight marker then lives out its lease, and a retry after
    that makes a new call, which reserves for itself."""

    async def keep_quietly() -> None:
        with contextlib.suppress(CeilingError):
            await keep(ticket, status, headers, raw, bill, api=api)

    keeping = gateway.spawn(keep_quietly())

    async def kept() -> None:
        await asyncio.shield(keeping)  # a request cancelled meanwhile does not cancel the keeping

    return Response(raw, status_code=status, headers=headers, background=BackgroundTask(kept))


async def forward(
    svc: CeilingService, who: Caller, call_plan: Plan, clamp: bool, ticket: Ticket | None
) -> Response:
    wire = call_plan.wire
    up = upstream(wire)  # a gateway with no provider refuses before it holds anything
    config = runtime().config
    p95 = bool(config and config.hold_p95)
    call = Call(svc, who, await gateway.hold(svc, who, call_plan, LENGTHS, clamp=clamp, p95=p95),
                LENGTHS)
    deadline = asyncio.get_running_loop().time() + up.timeout_s
    # An answer that is not streamed is read under the same deadline as it was sent, in one
    # timeout: `reading` is the answer being read, once it is (NotSent comes only from the
    # sending, AnswerTooLarge only from the reading).
    reading: httpx.Response | None = None
    raw = b""
    try:
        async with asyncio.timeout_at(deadline):
            response = await up.open(call.hold.plan)
            if response.status_code < 400 and not call.hold.plan.stream:
                reading = response
                raw = await up.read(response)
    except NotSent as exc:
        bill = await call.release()
        await give_back(ticket)
        return refusal_response(wire, UpstreamUnreachable(
            f"the provider could not be reached ({exc}); nothing was sent and the reservation "
            "was released"), bill_headers(bill, call))
    except (Unanswered, TimeoutError):
        if reading is not None:
            await reading.aclose()
        return await unanswered(call, up, ticket)
    except AnswerTooLarge:
        return await too_large(call, up, ticket)
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
    found = gateway.body_outcome(call.hold.plan, raw)
    bill = call.leave_open() if found is None else await call.settle(found[0])
    headers = {**relayed_headers(response), **bill_headers(bill, call)}
    if ticket is None:
        return Response(raw, status_code=response.status_code, headers=headers)
    return kept_while_sent(raw, response.status_code, headers, ticket, bill, api=wire.api)


async def unanswered(call: Call, up: Upstream, ticket: Ticket | None) -> Response:
    bill = call.leave_open()
    await give_back(ticket)
    return refusal_response(call.hold.plan.wire, UpstreamTimeout(
        f"no complete answer from the provider within {up.timeout_s} s; the call may have been "
        f"billed, so its reservation {bill.reservation_id} stays held: it expires charged "
        "unless an operator corrects it from the provider's bill"), bill_headers(bill, call))


async def too_large(call: Call, up: Upstream, ticket: Ticket | None) -> Response:
    """An answer larger than the gateway holds (api/upstream.py UPSTREAM_ANSWER_BYTES_MAX): the
    provider ran the call and billed it, and the usage it reported was left unread, so the
    outcome is unknown and the hold stays, as for an answer cut off. Nothing is kept for the
    idempotency key: a retry makes a new call, which holds for itself."""
    bill = call.leave_open()
    await give_back(ticket)
    return refusal_response(call.hold.plan.wire, UpstreamAnswerTooLarge(
        f"the provider's answer is larger than the {up.answer_bytes_max} bytes the gateway "
        "reads of an answer that is not streamed; the call was billed, so its reservation "
        f"{bill.reservation_id} stays held: it expires charged unless an operator corrects it "
        "from the provider's bill. Ask for fewer choices or logprobs, or stream the answer",
        answer_bytes_max=up.answer_bytes_max), bill_headers(bill, call))


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
    response.completed / .incomplete / .failed, a Messages stream's message_stop) has an unknown
    outcome, even if usage chunks came
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
        wire = self.call.hold.plan.wire
        complete = tally.finished
        bill = await self.call.settle(tally.usage) if complete else self.call.leave_open()
        if not complete:
            self._emit(broken_off_event(wire, bill))
        self._emit(b"".join(f": {k}: {v}\n".encode()
                            for k, v in bill_headers(bill, self.call).items()) + b"\n")
        if complete:
            self._emit(wire.stream_end)
        recorded = None if self._recorded is None else b"".join(self._recorded)
        await keep(self.ticket, 200, self.headers, recorded, bill, api=wire.api)


def broken_off_event(wire: WireFormat, bill: Bill) -> bytes:
    """The error event a client's SDK raises on, for a stream the provider broke off."""
    return error_event(wire, UpstreamTimeout(
        "the provider's stream broke off before its end; the call may have been billed, so its "
        f"reservation {bill.reservation_id} stays held: it expires charged unless an operator "
        "corrects it from the provider's bill"))


async def count(request: Request, wire: WireFormat) -> Response:
    """A token count (POST /v1/messages/count_tokens): checked as a call's body and headers are,
    admitted against the key's rate and concurrency limits, forwarded; nothing is held for it,
    as the provider bills nothing."""
    svc, who = await authenticated(request, Role.GATEWAY, x_api_key=wire.key_header is not None)
    config = runtime().config
    headers = tuple((k, v) for k, v in request.headers.items() if k in wire.forwarded_headers)
    content = gateway.count_request(
        wire.api, await request.body(), headers,
        config.gateway_fields_allowed if config else frozenset(),
        config.gateway_betas_allowed if config else frozenset())
    up = upstream(wire)
    await gateway.admit_count(svc, who)
    try:
        status, relayed, body = await up.count(wire.api, content, headers)
    except Unanswered as exc:
        raise UpstreamUnreachable(f"the provider did not answer the token count ({exc}); "
                                  "nothing was held or billed") from exc
    return Response(body, status_code=status, headers=relayed)


def route(wire: WireFormat) -> HotRoute:
    """`wire`'s hot route (api/routing.py), its refusals in its shape."""
    # authenticated() (api/routes/sidecar.py) knows one key header besides Authorization.
    ensure(wire.key_header in (None, "x-api-key"),
           f"{wire.route}: api/routes/sidecar.py reads no key from {wire.key_header}")
    return format_route(wire, serve, headers=HEADERS, body=BODIES.get(wire.api),
                        middleware=(refusals_in(wire),))


def count_route(wire: WireFormat) -> HotRoute:
    """`wire`'s token counting route, its refusals in its shape."""
    ensure(wire.count_route is not None, f"{wire.api} has no token counting route")

    async def endpoint(request: Request) -> Response:
        return await count(request, wire)

    endpoint.__name__ = endpoint.__qualname__ = f"{wire.name}_count_tokens"
    return HotRoute(str(wire.count_route), endpoint, body=BODIES.get(wire.api),
                    headers=wire.headers, middleware=(refusals_in(wire),))


# The hot routes of this module: one per wire format, and one per token counting endpoint.
ROUTES = (*(route(wire) for wire in FORMATS.values()),
          *(count_route(wire) for wire in FORMATS.values() if wire.count_route))
