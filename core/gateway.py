"""The gateway's money: what a request may cost, what to hold, what it cost.

Every call goes price -> reserve -> call -> settle, in one of the provider APIs' wire formats
(core/formats/: OpenAI's chat completions and Responses, Anthropic's Messages). This module
decides everything that touches money, from the request (its body, and the headers its format
forwards) and from the provider's answer; api/routes/gateway.py only moves bytes between the
client and the provider. What differs between the formats is each format's own: the request's
fields (WireFormat.plan), the usage an answer reports (usage_of), where a stream ends
(stream_event); nothing here asks which format a call is in.

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
import json
import math
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from core import output_stats
from core.config import OUTPUT_TOKENS_DEFAULT
from core.errors import BudgetRefused, CeilingError, InvalidRequest
from core.formats import FORMATS, Plan, WireFormat
from core.formats import Api as Api  # plan() and usage_of() take a format by its name
from core.jsonbody import loads_answer, loads_object
from core.ledger import LegStatus, OutputStats, Reservation, is_user_leg
from core.prices import TIER_AUTO, Usage
from core.service import Caller, CallSpec, CeilingService, SettleSpec

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
_COUNT_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
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
    """The provider answered more than the gateway reads (api/upstream.py
    UPSTREAM_ANSWER_BYTES_MAX): the call was run and billed, and its usage was left unread."""

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


def plan(api: Api, raw: bytes, output_tokens_default: int = OUTPUT_TOKENS_DEFAULT,
         headers: Sequence[tuple[str, str]] = (),
         fields_allowed: frozenset[str] = frozenset(),
         betas_allowed: frozenset[str] = frozenset()) -> Plan:
    """Price a request body in `api`'s format; InvalidRequest before anything is reserved if it
    cannot be.

    A call that sets no output cap is sent with `output_tokens_default` (CEILING_DEFAULT_MAX_
    OUTPUT_TOKENS): without a cap there is no worst case. `headers`: the request's headers that
    its format forwards (WireFormat.forwarded_headers), which are forwarded with it.
    `fields_allowed`: the operator's fields forwarded besides the format's own
    (CEILING_GATEWAY_FIELDS_ALLOWED); `betas_allowed`: the operator's cost-neutral betas
    (CEILING_GATEWAY_BETAS_ALLOWED)."""
    wire = FORMATS[api]
    body, model = _checked(wire, raw, fields_allowed)
    return wire.plan(body, model, tuple(headers), output_tokens_default, betas_allowed)


def _checked(wire: WireFormat, raw: bytes,
             fields_allowed: frozenset[str]) -> tuple[dict[str, Any], str]:
    """A request body in `wire`'s format, its top-level fields checked, and the model it
    names."""
    body = loads_object(raw)
    wire.check_fields(body, fields_allowed)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model is required", field="model")
    return body, model


def count_request(api: Api, raw: bytes, headers: Sequence[tuple[str, str]] = (),
                  fields_allowed: frozenset[str] = frozenset(),
                  betas_allowed: frozenset[str] = frozenset()) -> bytes:
    """A token counting request in `api`'s format, checked as a call's fields and headers are
    (nothing unnamed is forwarded), re-encoded for the provider; InvalidRequest if it is not."""
    wire = FORMATS[api]
    body, _ = _checked(wire, raw, fields_allowed)
    wire.count_checked(body, tuple(headers), betas_allowed)
    return _COUNT_ENCODER.encode(body).encode()


async def admit_count(svc: CeilingService, who: Caller) -> None:
    """Count a token counting request against the caller's rate and concurrency limits: the
    provider bills nothing for it, so it holds the least amount the ledger takes (COUNT_HOLD_
    MICROS), released at once. A budget with no room at all refuses it, as it would the call
    the count is for."""
    reservation = await svc.reserve(who, CallSpec(amount_micros=COUNT_HOLD_MICROS))
    await svc.release(who, reservation.reservation_id)


def usage_of(api: Api, usage: object, service_tier: object = None) -> Usage | None:
    """The usage an answer in `api`'s format reports (WireFormat.usage_of)."""
    return FORMATS[api].usage_of(usage, service_tier)


def body_outcome(call_plan: Plan, raw: bytes) -> tuple[Usage | None] | None:
    """A complete non-streaming answer's usage (None inside when it reports none); None if the
    answer is not a JSON object, which leaves the call's outcome unknown."""
    doc = loads_answer(raw)
    if not isinstance(doc, dict):
        return None
    return (call_plan.wire.answer_usage(doc),)


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
            call_plan.model, call_plan.wire.provider.upstream.value).input) < 2:
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
    room_micros = _room_micros(await svc.my_budgets(who))
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
            upstream = call_plan.wire.provider.upstream
            spec = SettleSpec(usage, upstream=upstream) if usage is not None else SettleSpec(
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
        self.lengths.record(self.svc.store, call_plan.model,
                            math.ceil(usage.output_tokens / call_plan.choices))
        return self.bill(settled.charged_micros, Outcome.BILLED)


async def _observe(stats: OutputStats, model: str, output_tokens: int) -> None:
    try:
        await stats.observe_output(model, output_tokens)
    except CeilingError:
        return  # a lost observation moves a p95 by nothing; no money depends on it
