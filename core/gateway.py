"""The gateway's money: what a request may cost, what to hold, what it cost.

Every call goes price -> reserve -> call -> settle, in one of the provider APIs' wire formats
(core/formats/: OpenAI's chat completions, Responses and embeddings, Anthropic's Messages). This
module runs the call (Gateway) and decides everything that touches money, from the request (its
body, and the headers its format forwards) and from the provider's answer, which comes through the
Upstream port (core/upstream.py, whose failure kinds decide what a failure does to the hold).
api/routes/gateway.py only parses the request and sends the Answer. What differs between the
formats is each format's own: the request's fields (WireFormat.plan), the usage an answer
reports (usage_of), where a stream ends (stream_event); nothing here asks which format a call
is in.

- The worst case comes from the request: its text bounded by its bytes, its images and audio by
  the model's rules (core/content.py), the output cap (its format's cap fields;
  OUTPUT_TOKENS_DEFAULT is set and forwarded when the caller sets none) times `n`, at the
  requested service tier's rates (core/prices/), and what else its format bills (Messages'
  tool-use system prompt, and web searches at their fee and their results' bound). A request
  whose cost its body cannot bound (a stored conversation, a file by id, a PDF, hosted tools,
  audio output, a field or beta the gateway does not know) is refused, not guessed at.
- A call is settled from the provider's usage (for streams, the last usage reported before the
  stream's terminal event); at its worst case when a complete answer reports none (hidden
  reasoning tokens can exceed anything the visible answer shows); and left held at its
  reservation when the outcome is unknown, where expiry charges it (always: a gateway call's
  lease expires with the 'charge' policy) and only an operator's correction lowers it.
- What a call is charged is the gateway's alone: its reservation belongs to no API key
  (core/ledger.py GATEWAY_OWNER_PREFIX), so no key can settle or release it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, Protocol, TypeAlias

from core import output_stats, replies
from core.config import Config
from core.errors import BudgetRefused, CeilingError, InvariantBroken
from core.formats import Plan, StreamTally, WireFormat
from core.gateway_request import body_outcome, count_request, plan
from core.idempotency import fingerprint
from core.ledger import LegStatus, OutputStats, ReplyStore, Reservation, StoredReply, is_user_leg
from core.prices import TIER_AUTO, Usage
from core.replies import REPLY_BYTES_MAX, ReplyNotKept, Ticket
from core.service import Caller, CallSpec, CeilingService, SettleSpec
from core.upstream import (
    AnswerTooLarge,
    Headers,
    NotSent,
    Unanswered,
    Upstream,
)
from core.upstreams import UpstreamDef

# With X-Ceiling-Clamp, a call that does not fit is sent with a smaller output cap only if at
# least this many tokens still fit: fewer would cut most answers off mid-sentence.
CLAMP_OUTPUT_TOKENS_MIN = 256
# Output-length histograms are read from the ledger at most this often per model and instance:
# a p95 moves slowly, and a read on every call would add a round trip to every call.
HISTOGRAM_CACHE_S = 30.0
# Models whose p95 an instance remembers; bounded because model names come from callers.
HISTOGRAM_MODELS_MAX = 1_024
# An instance records at most one output length per model this often. Under load that is still
# ten a second from every instance, plenty for a p95 over OBSERVATIONS_MAX; and a call does not
# pay a ledger write for it (on one event loop, a write after one answer delays the next).
# Which call is recorded does not depend on its length, so the histogram is not skewed.
OBSERVE_INTERVAL_S = 0.1
# A token count is admitted by a hold of this much, released at once: the ledger holds no less,
# and a count costs nothing.
COUNT_HOLD_MICROS = 1
# An error answer proves nothing was billed only when it is the provider refusing the request
# itself: a 4xx. Not 408 (the server gave up waiting, maybe while the model ran) nor 499 (the
# client closed, reported by a proxy while the call went on behind it). A 5xx can come after the
# model ran and billed (an error while streaming the answer back, a proxy's 502/504, a CDN's
# 520-524 while the origin kept working): every one of those keeps its hold as unknown.
REFUSAL_STATUSES = range(400, 500)
BILLING_UNKNOWN_4XX = frozenset({408, 499})


class UpstreamUnreachable(CeilingError):
    """The request provably never reached the provider; its reservation was released."""

    code = "upstream_unreachable"


class UpstreamTimeout(CeilingError):
    """The request was sent and no complete answer came back: whether it was billed is unknown."""

    code = "upstream_timeout"


class UpstreamAnswerTooLarge(CeilingError):
    """The provider answered more than the gateway reads (Upstream.answer_bytes_max): the call
    was run and billed, and its usage was left unread."""

    code = "upstream_answer_too_large"


def billed_nothing(status: int) -> bool:
    """Whether a provider's error status proves the call was not billed (its hold is released)."""
    return status in REFUSAL_STATUSES and status not in BILLING_UNKNOWN_4XX


class Outcome(StrEnum):
    """What is known of a call's bill, in the x-ceiling-billing-outcome header."""

    BILLED = "billed"  # settled from the provider's usage
    # A complete answer without usage, settled at its worst case: an upper bound, never a guess
    # below what the provider can bill.
    ESTIMATED = "estimated"
    # Held at the reservation: expiry charges it unless an operator corrects it.
    UNKNOWN = "unknown"
    RELEASED = "released"  # the provider billed nothing; the reservation was released


async def admit_count(svc: CeilingService, who: Caller, model_name: str,
                      provider: str | None = None) -> None:
    """Count a token counting request against the caller's rate and concurrency limits: the
    provider bills nothing for it, so it holds the least amount the ledger takes (COUNT_HOLD_
    MICROS), released at once. A budget with no room at all refuses it, as it would the call
    the count is for; so does an allow-list that does not name `model_name`, the count's model
    (priced by `provider`'s table), which a budget's model rules count it by."""
    reservation = await svc.reserve(who, CallSpec(
        amount_micros=COUNT_HOLD_MICROS, model_name=model_name, provider=provider))
    await svc.release(who, reservation.reservation_id)


_background: set[asyncio.Task[None]] = set()


def spawn(work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    """Run `work` in a task of its own, kept referenced until it finishes."""
    task = asyncio.create_task(work)
    _background.add(task)
    task.add_done_callback(_background.discard)
    return task


class OutputLengths:
    """One instance's view of output lengths: each model's p95 from the ledger's shared
    histograms, cached, and the lengths it records into them, sampled."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._cache: dict[str, tuple[float, int | None]] = {}
        self._recorded_at_s: dict[str, float] = {}

    def record(self, stats: OutputStats, model: str, output_tokens: int) -> None:
        """Count one call's output length (per choice), unless this model was counted just now."""
        key = model.lower()
        now_s = self._clock()
        if now_s - self._recorded_at_s.get(key, -OBSERVE_INTERVAL_S) < OBSERVE_INTERVAL_S:
            return
        if len(self._recorded_at_s) >= HISTOGRAM_MODELS_MAX:
            self._recorded_at_s.clear()
        self._recorded_at_s[key] = now_s
        spawn(_observe(stats, model, output_tokens))

    async def p95_tokens(self, stats: OutputStats, model: str) -> int | None:
        key = model.lower()
        now_s = self._clock()
        cached = self._cache.get(key)
        if cached is not None and cached[0] > now_s:
            return cached[1]
        try:
            histogram = await stats.output_histogram(model)
        except CeilingError:
            histogram = {}  # no p95 without the ledger: the full worst case is held
        tokens = output_stats.p95(histogram)
        if len(self._cache) >= HISTOGRAM_MODELS_MAX:
            self._cache.clear()
        self._cache[key] = (now_s + HISTOGRAM_CACHE_S, tokens)
        return tokens


@dataclass(frozen=True)
class Hold:
    """A call's reservation, and the plan as it is forwarded (its output cap maybe clamped)."""

    reservation: Reservation
    plan: Plan
    clamped: bool


def _room_micros(legs: tuple[LegStatus, ...]) -> int:
    return min((leg.remaining_micros for leg in legs), default=0)


async def hold(
    svc: CeilingService, who: Caller, call_plan: Plan, lengths: OutputLengths, *, clamp: bool,
    p95: bool,
) -> Hold:
    """Reserve for a call: its worst case; with `p95` (CEILING_HOLD_P95=1, off by default) its
    p95 while the budget is far from its ceiling.

    Reserving every call's full output cap locks a small budget after a few concurrent calls,
    though most use a fraction of it; so while a budget is far from its ceiling the hold is the
    model's p95 output length. A call may then use more than its hold; settle charges it in full
    and records the overshoot. The p95 hold is kept only if, with it in place, every budget of
    the call still has the call's full worst case left (the margin): even if this call runs to
    its cap, what the provider bills for it fits under the ceiling. Within the margin the full
    worst case is held.

    The margin covers one call's overshoot. Several calls held at their p95 at once can each
    overshoot, and the holds admitted after them fill the room the margin kept: if k of them run
    past their p95 near the ceiling, the bill can exceed it by up to the sum of their (worst case
    - p95). No hold smaller than the worst case can rule that out under concurrency; only the
    worst case does, which is what is held as soon as the margin is reached.

    With `clamp` (X-Ceiling-Clamp: 1), or a budget on the path that says `clamp`, a call whose
    worst case does not fit is sent with the largest output cap that does, if that is at least
    CLAMP_OUTPUT_TOKENS_MIN; else it is refused.
    """
    if call_plan.long_context and len(svc.prices.rates(
            call_plan.model, call_plan.prices_provider).input) < 2:
        # Priced by input size only where the rates have a tier by it (the long-context one).
        raise call_plan.wire.long_context_refusal(call_plan.model)
    p95_tokens = await lengths.p95_tokens(svc.store, call_plan.model) if p95 else None
    if p95_tokens is not None and p95_tokens < call_plan.output_tokens_max:
        try:
            reservation = await svc.reserve(who, call_plan.spec(p95_tokens))
        except BudgetRefused as refusal:
            return await _clamped_or_refused(svc, who, call_plan, refusal, clamp)
        if _room_micros(reservation.legs) >= svc.worst_case_micros(call_plan.spec())[0]:
            return Hold(reservation, call_plan, clamped=False)
        await svc.release(who, reservation.reservation_id)
    try:
        return Hold(await svc.reserve(who, call_plan.spec()), call_plan, clamped=False)
    except BudgetRefused as refusal:
        return await _clamped_or_refused(svc, who, call_plan, refusal, clamp)


async def _clamped_or_refused(
    svc: CeilingService, who: Caller, call_plan: Plan, refusal: BudgetRefused, clamp: bool
) -> Hold:
    if not clamp and not await svc.clamps(who):
        raise refusal
    # The room of this call's model: another model's per_model limit does not bind it.
    room_micros = _room_micros(await svc.my_budgets(who, call_plan.spec()))
    # The largest cap whose worst case fits the room; the worst case grows with the cap.
    low, high = 0, call_plan.output_tokens_max - 1
    while low < high:
        middle = (low + high + 1) // 2
        if svc.worst_case_micros(call_plan.spec(middle))[0] <= room_micros:
            low = middle
        else:
            high = middle - 1
    if low < CLAMP_OUTPUT_TOKENS_MIN:
        raise refusal
    clamped = call_plan.clamped(low)
    return Hold(await svc.reserve(who, clamped.spec()), clamped, clamped=True)


@dataclass(frozen=True)
class Bill:
    """A call's figures for its answer: held, charged (or to be charged), and what is left."""

    reservation_id: str
    reserved_micros: int
    charged_micros: int
    outcome: Outcome
    remaining_micros: int | None  # the tightest budget of the call's path
    run_remaining_micros: int | None  # the run's budget, when the call named a run
    user_remaining_micros: int | None = None  # its end user's, when its budget counts users


class Call:
    """One call's reservation, from the hold to the one way it is resolved."""

    def __init__(self, svc: CeilingService, who: Caller, held: Hold,
                 lengths: OutputLengths) -> None:
        self.svc, self.who, self.hold, self.lengths = svc, who, held, lengths

    def bill(self, charged_micros: int, outcome: Outcome) -> Bill:
        """Figures as of the reservation's snapshot of its budgets, with this call resolved."""
        reservation = self.hold.reservation
        held = reservation.reserved_micros
        run = self.who.run_limit()
        user = self.who.user
        remaining = run_remaining = user_remaining = None
        for leg in reservation.legs:
            left = max(0, leg.ceiling_micros - leg.committed_micros - leg.reserved_micros
                       + held - charged_micros)
            if run is not None and leg.budget_id == run.budget_id.path:
                run_remaining = left
            else:
                remaining = left if remaining is None else min(remaining, left)
                if user is not None and is_user_leg(leg, user):
                    user_remaining = left if user_remaining is None else min(user_remaining, left)
        return Bill(reservation.reservation_id, held, charged_micros, outcome, remaining,
                    run_remaining, user_remaining)

    def leave_open(self) -> Bill:
        """Unknown outcome: keep the hold. Expiry charges it (outcome 'unknown'); an operator
        who reads the provider's bill may correct it by the reservation id in the answer
        (POST /v1/admin/reservations/{id}/settle). No API key can."""
        return self.bill(self.hold.reservation.reserved_micros, Outcome.UNKNOWN)

    async def release(self) -> Bill:
        try:
            await self.svc.release(self.who, self.hold.reservation.reservation_id)
        except CeilingError:
            return self.leave_open()
        return self.bill(0, Outcome.RELEASED)

    async def settle(self, usage: Usage | None) -> Bill:
        """Settle a complete answer from the provider's usage; without usage, at the call's
        worst case (the whole hold, or more under a p95 hold): the visible answer does not bound
        what was billed (hidden reasoning tokens), and the worst case does."""
        call_plan = self.hold.plan
        if usage is not None and usage.service_tier == TIER_AUTO != call_plan.service_tier:
            # The answer names no tier: it was served at the one the request named, if any.
            usage = replace(usage, service_tier=call_plan.service_tier)
        try:
            # A routed call's spend counts on its upstream's own bill (core/upstreams.py
            # bill_of): Bedrock's, Vertex's or Azure's spend is in no report reconcile reads,
            # and counted as OpenAI's or Anthropic's it would hide their unseen spend.
            upstream = call_plan.billed
            # Priced by the table the call was held by (Plan.prices_provider), whichever bill
            # it is on: a shorthand's provider at another host is on the `other` bill.
            prices_provider = call_plan.prices_provider
            spec = SettleSpec(
                usage, upstream=upstream, prices_provider=prices_provider,
            ) if usage is not None else SettleSpec(
                actual_micros=max(self.hold.reservation.reserved_micros,
                                  self.svc.worst_case_micros(call_plan.spec())[0]),
                upstream=upstream)
            settled = await self.svc.settle(
                self.who, self.hold.reservation.reservation_id, spec
            )
        except CeilingError:
            # The lease is still held; expiry charges it. So is a usage that cannot be priced
            # (audio for a model with no audio rate, a tier with no known rates): never low.
            return self.leave_open()
        if usage is None:
            return self.bill(settled.charged_micros, Outcome.ESTIMATED)
        # A call that writes nothing (an embedding) has no output length to learn.
        if call_plan.output_tokens_max:
            self.lengths.record(self.svc.store, call_plan.model,
                                math.ceil(usage.output_tokens / call_plan.choices))
        return self.bill(settled.charged_micros, Outcome.BILLED)


async def _observe(stats: OutputStats, model: str, output_tokens: int) -> None:
    try:
        await stats.observe_output(model, output_tokens)
    except CeilingError:
        return  # a lost observation moves a p95 by nothing; no money depends on it


def bill_headers(bill: Bill, call: Call, *, final: bool = True) -> dict[str, str]:
    """The headers that say what `call` held and cost (docs/gateway.md, docs/reference.md);
    with `final` False, only what is known before a stream's end.

      x-ceiling-reservation-id         the call's reservation, for an operator's correction
                                       (POST /v1/admin/reservations/{id}/settle); it grants the
                                       key nothing: the reservation is not the key's to settle
      x-ceiling-reserved-micros        what was held for the call
      x-ceiling-charged-micros         what it was charged (for an unknown outcome: what expiry
                                       will charge unless a settle corrects it)
      x-ceiling-remaining-micros       the tightest budget on the key's path, after this call
      x-ceiling-run-remaining-micros   the run's budget, with X-Ceiling-Run-Id
      x-ceiling-user-remaining-micros  the end user's, when its budget counts users
      x-ceiling-billing-outcome        billed | estimated | unknown | released (Outcome)
      x-ceiling-clamped-output-tokens  the output cap sent, when X-Ceiling-Clamp: 1 (or the
                                       budget's `clamp`) lowered it
      x-ceiling-bounds-added           the bounds the gateway set where the request gave none,
                                       as `field=value, ...` (the output cap; max_tool_calls or
                                       a web search tool's max_uses)

    and on an answer kept for its Idempotency-Key and replayed, x-ceiling-replayed: true.

    A stream's headers leave before its charge is known: they carry the reservation id, the
    amount reserved and the remaining budgets with the hold in place; the charge, the remaining
    budgets after it and the outcome follow in an SSE comment at the end of the stream (after a
    Responses or Messages stream's last event; before the chat stream's `data: [DONE]`, which
    its format holds back for after it: WireFormat.stream_end), one `: <header>: <value>` line
    each, which SSE clients skip (Relay)."""
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


# What the client is answered, sent by the route as it is: (status, headers, body, background).
# `body`: whole, or a stream's bytes as the client is to get them. `background`: None, or what
# is awaited once the answer was sent (or sending it failed), before the request ends: a
# request that was answered ends only once its work is done, so a shutdown or a serverless
# runtime lets it finish. A plain tuple, as core/upstream.py Sent is: one is made on every call.
Answer: TypeAlias = tuple[int, dict[str, str], bytes | AsyncIterator[bytes],
                          Callable[[], Awaitable[None]] | None]


@dataclass(frozen=True)
class Refused:
    """A refusal that comes after a hold: `error` in the call's format's error shape, with the
    bill's `headers` (which say what became of the hold)."""

    error: CeilingError
    headers: dict[str, str]


class Shapes(Protocol):
    """The core's errors in a format's shapes, as the route renders them (api/refusals.py)."""

    def kept(self, wire: WireFormat, error: CeilingError) -> StoredReply:
        """`error` answered in `wire`'s shape, as it is kept for an idempotency key's retries."""
        ...

    def event(self, wire: WireFormat, error: CeilingError) -> bytes:
        """The event a stream in `wire`'s format already answered 200 ends on."""
        ...


SETTLED = frozenset({Outcome.BILLED, Outcome.ESTIMATED})  # the outcomes whose answer is kept


async def give_back(ticket: Ticket | None) -> None:
    """Free the idempotency key of a call that leaves no answer to replay."""
    if ticket is not None:
        await ticket.abandon()


async def keep(ticket: Ticket | None, status: int, headers: dict[str, str], body: bytes | None,
               bill: Bill, wire: WireFormat, shapes: Shapes) -> None:
    """Keep a settled call's answer for its idempotency key (None: too large to record), or
    where it cannot be kept, what a retry is told instead (409 reply_not_kept, with what became
    of the call and what it was charged); give the key back if it was not settled."""
    if ticket is None or bill.outcome not in SETTLED:
        await give_back(ticket)
        return
    not_kept = shapes.kept(wire, ReplyNotKept(
        "the call with this Idempotency-Key finished, but its answer was not kept for replay "
        "(too large, or past this key's quota of kept answers): it was not called again. Use a "
        "new key to call again", outcome=bill.outcome.value, charged_micros=bill.charged_micros,
        reservation_id=bill.reservation_id))
    reply = None if body is None or len(body) > REPLY_BYTES_MAX else StoredReply(
        status, tuple(headers.items()), body.decode(errors="replace"))
    await ticket.complete(reply, not_kept)


def kept_while_sent(raw: bytes, status: int, headers: dict[str, str], ticket: Ticket,
                    bill: Bill, wire: WireFormat, shapes: Shapes) -> Answer:
    """A non-streaming answer, kept for its idempotency key while it is sent.

    The client need not wait for a ledger round trip that only a retry reads: the keeping runs
    in a task of its own beside the sending, and a retry that comes meanwhile finds the key in
    flight and waits for the answer (non-streaming retries wait). It is kept even if sending
    fails, since that client is the one that retries; and the answer's background waits for it.
    A ledger failure here has no one left to tell: the in-flight marker then lives out its
    lease, and a retry after that makes a new call, which reserves for itself."""

    async def keep_quietly() -> None:
        with contextlib.suppress(CeilingError):
            await keep(ticket, status, headers, raw, bill, wire, shapes)

    keeping = spawn(keep_quietly())

    async def kept() -> None:
        await asyncio.shield(keeping)  # a request cancelled meanwhile does not cancel the keeping

    return status, headers, raw, kept


class Gateway:
    """Runs gateway calls: plan -> hold -> forward through the provider's Upstream -> settle,
    release or leave open -> keep the answer for its idempotency key. The route parses the
    request and sends what this answers.

    `upstream_of`: the provider's client for a format (ConfigError when none is configured,
    before anything is held); `client_of`: a named upstream's (CEILING_UPSTREAMS), for a call
    routed to one (Plan.routed_to). `replies_of`: the store of idempotency keys, asked for only by a
    call that names one. `shapes`: the route's rendering of refusals that go into a kept answer
    or a stream."""

    def __init__(self, upstream_of: Callable[[WireFormat], Upstream],
                 replies_of: Callable[[], ReplyStore], shapes: Shapes,
                 lengths: OutputLengths | None = None,
                 client_of: Callable[[UpstreamDef], Upstream] | None = None) -> None:
        self.upstream_of, self.replies_of, self.shapes = upstream_of, replies_of, shapes
        self.client_of = client_of
        self.lengths = OutputLengths() if lengths is None else lengths

    def serve(self, svc: CeilingService, who: Caller, wire: WireFormat, raw: bytes,
              headers: Headers, config: Config | None, *, clamp: bool,
              idempotency_key: str | None,
              path_model: str | None = None) -> Awaitable[Answer | Refused]:
        """One call of `wire`'s route, to be awaited: `raw` its body, `headers` the client's its
        format forwards, `clamp` X-Ceiling-Clamp: 1, `path_model` the model named in the
        route's path (WireFormat.model_in_path). With an idempotency key, at most one
        provider call is made for it (core/replies.py): a retry of a settled call gets its kept
        answer.

        The request is priced here, before anything is awaited (InvalidRequest at once), and
        what is returned is the call's own coroutine rather than one more wrapped around it:
        every time a call resumes from the ledger or the provider, each coroutine it is awaited
        through is resumed too."""
        call_plan = (
            plan(wire.api, raw, config.output_tokens_default, headers,
                 config.gateway_fields_allowed, config.gateway_betas_allowed, config.upstreams,
                 path_model)
            if config else plan(wire.api, raw, headers=headers, path_model=path_model)
        )
        if config and call_plan.routed_to is None:
            # A one-upstream shorthand's provider at another host than its own: another bill.
            bill = wire.provider.bill(config)
            if bill is not call_plan.billed:
                call_plan = replace(call_plan, bill=bill)
        # The body's user field is checked whether or not the header names the user; the
        # header wins.
        body_user = wire.end_user(call_plan.body)
        if who.user is None:
            who = who.for_user(body_user)
        p95 = bool(config and config.hold_p95)
        if idempotency_key is None:
            return self.forward(svc, who, call_plan, clamp, p95, None)
        return self._idempotent(svc, who, call_plan, clamp, p95, idempotency_key)

    async def _idempotent(self, svc: CeilingService, who: Caller, call_plan: Plan, clamp: bool,
                          p95: bool, idempotency_key: str) -> Answer | Refused:
        claimed = await replies.claim(
            self.replies_of(),
            replies.reply_ref(who, idempotency_key),
            fingerprint(call_plan.wire.api.value, call_plan.body, who.run_id, clamp,
                        call_plan.headers, *(() if who.user is None else (who.user,)),
                        # Two upstreams may be sent the same body (`a/m` and `b/m` send `m`).
                        *(() if call_plan.routed_to is None else (
                            "upstream:" + call_plan.routed_to.name,))),
            wait=not call_plan.stream,
            in_flight_ttl_ms=svc.lease_ttl_ms,
        )
        if isinstance(claimed, StoredReply):
            return (claimed.status, {**dict(claimed.headers), "x-ceiling-replayed": "true"},
                    claimed.body.encode(), None)
        try:
            return await self.forward(svc, who, call_plan, clamp, p95, claimed)
        except BaseException:
            await claimed.abandon()
            raise

    async def forward(self, svc: CeilingService, who: Caller, call_plan: Plan, clamp: bool,
                      p95: bool, ticket: Ticket | None) -> Answer | Refused:
        """Hold for the call, send it, and decide its money by what came back."""
        # No provider: refused before anything is held.
        routed_to = call_plan.routed_to
        up = self.upstream_of(call_plan.wire) if routed_to is None else self._client(routed_to)
        lengths = self.lengths
        call = Call(svc, who, await hold(svc, who, call_plan, lengths, clamp=clamp, p95=p95),
                    lengths)
        deadline_s = asyncio.get_running_loop().time() + up.timeout_s
        try:
            status, relayed, body = await up.send(call.hold.plan, deadline_s)
        except NotSent as exc:
            bill = await call.release()
            await give_back(ticket)
            return Refused(UpstreamUnreachable(
                f"the provider could not be reached ({exc}); nothing was sent and the "
                "reservation was released"), bill_headers(bill, call))
        except Unanswered:
            bill = call.leave_open()
            await give_back(ticket)
            return Refused(UpstreamTimeout(
                f"no complete answer from the provider within {up.timeout_s} s; the call may "
                f"have been billed, so its reservation {bill.reservation_id} stays held: it "
                "expires charged unless an operator corrects it from the provider's bill"),
                bill_headers(bill, call))
        except AnswerTooLarge:
            return await self._too_large(call, up, ticket)
        if status >= 400:
            bill = await call.release() if billed_nothing(status) else call.leave_open()
            await give_back(ticket)
            relayed.update(bill_headers(bill, call))
            return status, relayed, body, None
        if not isinstance(body, bytes):
            relay = Relay(call, relayed, body, deadline_s, ticket, self.shapes)
            return 200, relay.headers, relay.body(), None
        found = body_outcome(call.hold.plan, body)
        bill = call.leave_open() if found is None else await call.settle(found[0])
        relayed.update(bill_headers(bill, call))  # the provider's headers, then the bill's
        if ticket is None:
            return status, relayed, body, None
        return kept_while_sent(body, status, relayed, ticket, bill, call_plan.wire, self.shapes)

    def _client(self, definition: UpstreamDef) -> Upstream:
        if self.client_of is None:
            raise InvariantBroken("a call was routed to a named upstream, and this gateway was "
                                  "made without a client for one")
        return self.client_of(definition)

    async def _too_large(self, call: Call, up: Upstream, ticket: Ticket | None) -> Refused:
        """An answer larger than the gateway holds (Upstream.answer_bytes_max): the provider
        ran the call and billed it, and the usage it reported was left unread, so the outcome
        is unknown and the hold stays, as for an answer cut off. Nothing is kept for the
        idempotency key: a retry makes a new call, which holds for itself."""
        bill = call.leave_open()
        await give_back(ticket)
        return Refused(UpstreamAnswerTooLarge(
            f"the provider's answer is larger than the {up.answer_bytes_max} bytes the gateway "
            "reads of an answer that is not streamed; the call was billed, so its reservation "
            f"{bill.reservation_id} stays held: it expires charged unless an operator corrects "
            "it from the provider's bill. Ask for fewer choices or logprobs, or stream the "
            "answer", answer_bytes_max=up.answer_bytes_max), bill_headers(bill, call))

    async def count(self, svc: CeilingService, who: Caller, wire: WireFormat, raw: bytes,
                    headers: Headers, config: Config | None,
                    path_model: str | None = None) -> Answer:
        """A token count (POST /v1/messages/count_tokens, Gemini's :countTokens): checked as a
        call's body and headers are, admitted against the key's rate and concurrency limits,
        forwarded; nothing is held for it, as the provider bills nothing. `path_model`: as
        serve's."""
        content, routed_to, model, priced_model = count_request(
            wire.api, raw, headers, config.gateway_fields_allowed if config else frozenset(),
            config.gateway_betas_allowed if config else frozenset(),
            config.upstreams if config else None, path_model)
        up = self.upstream_of(wire) if routed_to is None else self._client(routed_to)
        await admit_count(svc, who, priced_model,
                          None if routed_to is None else routed_to.prices_provider)
        try:
            status, relayed, body = await up.count(wire.api, content, headers, model)
        except Unanswered as exc:
            raise UpstreamUnreachable(f"the provider did not answer the token count ({exc}); "
                                      "nothing was held or billed") from exc
        return status, relayed, body, None


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
    outcome, even if usage chunks came (a provider reporting cumulative usage sends one with
    every chunk; the provider may also have billed output it never sent: text lost in transit,
    hidden reasoning): its hold is kept, and the client gets an error event.
    """

    def __init__(self, call: Call, relayed: dict[str, str], chunks: AsyncGenerator[bytes, None],
                 deadline_s: float, ticket: Ticket | None, shapes: Shapes) -> None:
        """`relayed`: the provider's headers the client gets; `chunks`: its stream (Sent)."""
        self.call, self.deadline_s, self.ticket, self.shapes = call, deadline_s, ticket, shapes
        held = call.bill(call.hold.reservation.reserved_micros, Outcome.UNKNOWN)
        self.headers = {**relayed, **bill_headers(held, call, final=False)}
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._client_gone = False
        self._recorded: list[bytes] | None = [] if ticket else None
        self._recorded_bytes = 0
        spawn(self._pump(chunks))

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
        """The bytes the client gets; closing it (the client went away) stops only that."""
        try:
            while (data := await self._queue.get()) is not None:
                yield data
        finally:
            self._client_gone = True

    async def _pump(self, chunks: AsyncGenerator[bytes, None]) -> None:
        try:
            tally = StreamTally(self.call.hold.plan)
            try:
                async with asyncio.timeout_at(self.deadline_s):
                    async for chunk in chunks:
                        self._emit(tally.feed(chunk))
            except (Unanswered, TimeoutError):
                pass  # what was read is in the tally; whether it is complete decides below
            finally:
                await chunks.aclose()
            await self._finish(tally)
        finally:
            self._queue.put_nowait(None)

    async def _finish(self, tally: StreamTally) -> None:
        wire = self.call.hold.plan.wire
        complete = tally.finished
        bill = await self.call.settle(tally.usage) if complete else self.call.leave_open()
        if not complete:
            self._emit(self.shapes.event(wire, UpstreamTimeout(
                "the provider's stream broke off before its end; the call may have been billed, "
                f"so its reservation {bill.reservation_id} stays held: it expires charged unless "
                "an operator corrects it from the provider's bill")))
        if wire.stream_trailer:
            self._emit(b"".join(f": {k}: {v}\n".encode()
                                for k, v in bill_headers(bill, self.call).items()) + b"\n")
        if complete:
            self._emit(wire.stream_end)
        recorded = None if self._recorded is None else b"".join(self._recorded)
        await keep(self.ticket, 200, self.headers, recorded, bill, wire, self.shapes)
