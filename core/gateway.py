"""The OpenAI-compatible gateway's money: what a request may cost, what to hold, what it cost.

Every call goes price -> reserve -> call -> settle. This module decides everything that touches
money, from the request body and from the provider's answer; api/routes/gateway.py only moves
bytes between the client and the provider.

- The worst case comes from the request: its text bounded by its bytes, its images and audio by
  the model's rules (core/content.py), the output cap (max_tokens / max_completion_tokens /
  max_output_tokens; OUTPUT_TOKENS_DEFAULT is set and forwarded when the caller sets none) times
  `n`, at the requested service tier's rates (core/prices.py). A request whose cost its body
  cannot bound (a stored conversation, a file by id, hosted tools, audio output) is refused, not
  guessed at.
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
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from core import output_stats
from core.config import OUTPUT_TOKENS_DEFAULT
from core.content import NO_MEDIA, InputBound, Media, chat_input, json_bytes, responses_input
from core.errors import BudgetRefused, CeilingError, InputUnbounded, InvalidRequest
from core.ledger import LedgerStore, LegStatus, Reservation
from core.prices import TIER_AUTO, Usage, check_service_tier
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
# An error answer proves nothing was billed only when it is the provider refusing the request
# itself: a 4xx. Not 408 (the server gave up waiting, maybe while the model ran) nor 499 (the
# client closed, reported by a proxy while the call went on behind it). A 5xx can come after the
# model ran and billed (an error while streaming the answer back, a proxy's 502/504, a CDN's
# 520-524 while the origin kept working): every one of those keeps its hold as unknown.
REFUSAL_STATUSES = range(400, 500)
BILLING_UNKNOWN_4XX = frozenset({408, 499})
# Stream events after which a Responses API call is over, carrying its usage.
RESPONSES_TERMINAL_EVENTS = frozenset(
    {"response.completed", "response.incomplete", "response.failed"}
)


# One encoder for every forwarded body: json.dumps with options builds a new one per call.
_BODY_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


class Api(StrEnum):
    """An OpenAI-compatible route, by its path below the provider's base URL."""

    CHAT = "chat/completions"
    RESPONSES = "responses"


# The output cap's field names, the one the gateway sets last.
CAP_FIELDS = {
    Api.CHAT: ("max_tokens", "max_completion_tokens"),
    Api.RESPONSES: ("max_output_tokens",),
}
# Fields that make a call cost what its body cannot bound: refused instead of forwarded.
# chat: audio output is billed at audio rates on top of the text it speaks; rejected predicted
# tokens are billed on top of the cap. responses: a background call is billed after the answer.
# Both: Anthropic's fast mode (`speed`) is billed at rates its OpenAI-shaped usage does not name.
UNBOUNDED_FIELDS = {
    Api.CHAT: ("audio", "prediction", "speed"),
    Api.RESPONSES: ("background", "speed"),
}
# Fields that feed the model input the request does not contain (InputUnbounded): search
# results, a stored conversation, response or prompt.
UNBOUNDED_INPUT_FIELDS = {
    Api.CHAT: ("web_search_options",),
    Api.RESPONSES: ("conversation", "previous_response_id", "prompt"),
}
# Tools the client runs itself; hosted tools (web search, file search, code interpreter...)
# feed the model input the request does not contain.
CLIENT_TOOL_TYPES = frozenset({"function", "custom"})
# A usage's (input, output, input details, output details) fields.
USAGE_FIELDS = {
    Api.CHAT: ("prompt_tokens", "completion_tokens", "prompt_tokens_details",
               "completion_tokens_details"),
    Api.RESPONSES: ("input_tokens", "output_tokens", "input_tokens_details",
                    "output_tokens_details"),
}


class UpstreamUnreachable(CeilingError):
    """The request provably never reached the provider; its reservation was released."""

    code = "upstream_unreachable"


class UpstreamTimeout(CeilingError):
    """The request was sent and no complete answer came back: whether it was billed is unknown."""

    code = "upstream_timeout"


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


@dataclass(frozen=True)
class Plan:
    """One request, priced: the body to forward and the bounds of what it may cost."""

    api: Api
    model: str
    body: dict[str, Any]
    stream: bool
    text_tokens_max: int  # the input's text, framing included
    output_tokens_max: int  # per choice
    choices: int
    usage_wanted: bool  # a chat stream whose client asked for the usage chunk itself
    media: Media = NO_MEDIA  # the input's images and audio, priced by the model's rules
    service_tier: str = TIER_AUTO  # as asked for; a request that names none is `auto`

    def spec(self, output_tokens_max: int | None = None) -> CallSpec:
        return CallSpec(
            model=self.model, input_tokens=self.text_tokens_max,
            output_tokens_max=output_tokens_max or self.output_tokens_max, choices=self.choices,
            media=self.media, service_tier=self.service_tier,
        )

    def clamped(self, output_tokens_max: int) -> Plan:
        body = dict(self.body)
        for field in CAP_FIELDS[self.api]:
            if body.get(field) is not None:
                body[field] = output_tokens_max
        return replace(self, body=body, output_tokens_max=output_tokens_max)

    def content(self) -> bytes:
        """The body as priced, encoded anew rather than forwarded as the client's bytes: a key
        given twice is resolved by each JSON parser its own way (first or last wins, or an
        error), and the provider must read the document the gateway priced."""
        return _BODY_ENCODER.encode(self.body).encode()


def _positive_int(value: object, field: str) -> int:
    if type(value) is not int or value < 1:
        raise InvalidRequest(f"{field} must be a positive integer", field=field)
    return value


def _prompt(api: Api, body: dict[str, Any]) -> InputBound:
    """The bound of what a call is prompted with (core/content.py): its messages or input."""
    tools = body.get("tools") or []
    if not isinstance(tools, list) or any(
        not isinstance(t, dict) or not isinstance(t.get("type"), str)
        or t["type"] not in CLIENT_TOOL_TYPES for t in tools
    ):
        raise InputUnbounded(
            "only function and custom tools are supported: a hosted tool feeds the model input "
            "whose cost the request cannot bound", field="tools",
        )
    if api is Api.CHAT:
        if not isinstance(body.get("messages"), list):
            raise InvalidRequest("messages must be a list", field="messages")
        return chat_input(body["messages"])
    return responses_input(body.get("input"))


def plan(api: Api, raw: bytes, output_tokens_default: int = OUTPUT_TOKENS_DEFAULT) -> Plan:
    """Price a request body; InvalidRequest before anything is reserved if it cannot be.

    A call that sets no output cap is sent with `output_tokens_default` (CEILING_DEFAULT_MAX_
    OUTPUT_TOKENS): without a cap there is no worst case."""
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise InvalidRequest("the body must be JSON") from exc
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model is required", field="model")
    for field in UNBOUNDED_FIELDS[api]:
        if body.get(field) not in (None, False):
            raise InvalidRequest(
                f"{field} is not supported: the gateway cannot bound its cost from the request",
                field=field,
            )
    # Audio output is asked for by `modalities` (`audio` only picks a voice and format, which a
    # provider may default): billed at audio rates, and refused like `audio`.
    modalities = body.get("modalities") if api is Api.CHAT else None
    if modalities is not None and (
        not isinstance(modalities, list) or any(m != "text" for m in modalities)
    ):
        raise InvalidRequest(
            "modalities other than text are not supported: audio output is billed at audio "
            "rates the gateway cannot bound from the request", field="modalities",
        )
    for field in UNBOUNDED_INPUT_FIELDS[api]:
        if body.get(field) not in (None, False):
            raise InputUnbounded(
                f"{field} feeds the model input the request does not contain, of a size it "
                "cannot show", field=field,
            )
    service_tier = check_service_tier(body.get("service_tier")) or TIER_AUTO
    prompt = _prompt(api, body)
    caps = {_positive_int(body[f], f) for f in CAP_FIELDS[api] if body.get(f) is not None}
    if len(caps) > 1:
        raise InvalidRequest(
            "give one output cap (max_tokens or max_completion_tokens), or equal values",
            field=CAP_FIELDS[api][-1],
        )
    if not caps:
        body[CAP_FIELDS[api][-1]] = output_tokens_default
    choices = body.get("n")
    choices = 1 if api is Api.RESPONSES or choices is None else _positive_int(choices, "n")
    stream = body.get("stream") is True
    usage_wanted = False
    if stream and api is Api.CHAT:
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise InvalidRequest("stream_options must be an object", field="stream_options")
        usage_wanted = options.get("include_usage") is True
        body["stream_options"] = {**options, "include_usage": True}
    # Everything else in the body as forwarded that the provider may tokenize (instructions,
    # tools, schemas) is bounded by its bytes too; the framing fields counted with it only raise
    # the bound, and two requests that forward the same body are priced the same.
    prompt_field = "messages" if api is Api.CHAT else "input"
    rest = {k: v for k, v in body.items() if k != prompt_field}
    text_tokens = prompt.text_tokens + json_bytes(rest)
    return Plan(
        api, model, body, stream, text_tokens, caps.pop() if caps else output_tokens_default,
        choices, usage_wanted, prompt.media, service_tier,
    )


def _count(value: object) -> int:
    if value is None:
        return 0
    if type(value) is not int or value < 0:
        raise ValueError(f"not a token count: {value!r}")
    return value


def usage_of(api: Api, usage: object, service_tier: object = None) -> Usage | None:
    """The usage a provider reported, and the service tier its answer names; None if it
    reported no usage we can read (the call is then settled from an upper bound).

    Read as OpenAI reports it: cache reads and audio are parts of the input tokens, reasoning
    and audio parts of the output tokens. Where a compatible provider reports otherwise, the
    reading that costs more is taken: reasoning tokens above the output count, or a total above
    input plus output, are output the count left out; cache reads and writes reported beside
    the input count, Anthropic's way (cache_read_input_tokens, cache_creation_input_tokens), are
    input on top of it. An answer that names no tier is priced at the dearest it could be."""
    if not isinstance(usage, dict):
        return None
    input_field, output_field, input_details, output_details = USAGE_FIELDS[api]
    try:
        given_in = usage.get(input_details) or {}
        given_out = usage.get(output_details) or {}
        if not isinstance(given_in, dict) or not isinstance(given_out, dict):
            return None
        input_tokens, output_tokens = _count(usage[input_field]), _count(usage[output_field])
        # Anthropic's cache counts sit beside the input count rather than in it; the 1-hour
        # writes are split out of all writes in `cache_creation`.
        creation = usage.get("cache_creation")
        creation = creation if isinstance(creation, dict) else {}
        writes_1h = _count(creation.get("ephemeral_1h_input_tokens"))
        writes_beside = max(_count(usage.get("cache_creation_input_tokens")),
                            writes_1h + _count(creation.get("ephemeral_5m_input_tokens")))
        reads_beside = _count(usage.get("cache_read_input_tokens"))
        input_tokens += writes_beside + reads_beside
        reads = _count(given_in.get("cached_tokens")) + reads_beside
        writes = _count(given_in.get("cache_write_tokens")) + writes_beside - writes_1h
        reasoning = _count(given_out.get("reasoning_tokens"))
        if reasoning > output_tokens:
            output_tokens += reasoning
        total = usage.get("total_tokens")
        if type(total) is int and total - input_tokens > output_tokens:
            output_tokens = total - input_tokens
        return Usage(
            input_tokens, output_tokens, reads, writes, writes_1h,
            _count(given_in.get("audio_tokens")), _count(given_out.get("audio_tokens")),
            service_tier if isinstance(service_tier, str) and service_tier else TIER_AUTO,
        )
    except (KeyError, ValueError, CeilingError):
        return None


class StreamTally:
    """What a provider's stream has said so far, and which of its bytes the client gets.

    Fed the stream's bytes as they come, it splits them into server-sent events, keeps the last
    usage reported (a provider may report cumulative usage in every chunk, vLLM's continuous
    usage stats: only the last covers the whole answer), notes the terminal event (chat's
    `data: [DONE]`; Responses' response.completed / .incomplete / .failed), and returns the
    events to forward: all of them but the usage chunk the gateway asked for on the client's
    behalf, and the chat stream's `[DONE]`, which the relay sends after its trailer. A stream is
    complete only once its terminal event came: usage seen before it may be partial.
    """

    def __init__(self, call_plan: Plan) -> None:
        self.plan = call_plan
        self.usage: Usage | None = None
        self.finished = False
        self._buffer = b""

    def feed(self, chunk: bytes) -> bytes:
        self._buffer += chunk
        if b"\r" in self._buffer:
            self._buffer = self._buffer.replace(b"\r\n", b"\n")
        out = []
        while (end := self._buffer.find(b"\n\n")) >= 0:
            event, self._buffer = self._buffer[:end], self._buffer[end + 2:]
            data = [line[5:].removeprefix(b" ") for line in event.split(b"\n")
                    if line.startswith(b"data:")]
            if not data or self._take(b"\n".join(data).decode(errors="replace")):
                out.append(event + b"\n\n")
        return b"".join(out)

    def _take(self, data: str) -> bool:
        if self.plan.api is Api.CHAT and data == "[DONE]":
            self.finished = True
            return False
        try:
            doc = json.loads(data)
        except ValueError:
            return True
        if not isinstance(doc, dict):
            return True
        if self.plan.api is Api.RESPONSES:
            if doc.get("type") in RESPONSES_TERMINAL_EVENTS:
                self.finished = True
                response = doc.get("response")
                self.usage = usage_of(
                    Api.RESPONSES, response.get("usage"), response.get("service_tier")
                ) if isinstance(response, dict) else None
            return True
        usage = usage_of(Api.CHAT, doc.get("usage"), doc.get("service_tier"))
        if usage is not None:
            self.usage = usage
        return usage is None or doc.get("choices") != [] or self.plan.usage_wanted


def body_outcome(call_plan: Plan, raw: bytes) -> tuple[Usage | None] | None:
    """A complete non-streaming answer's usage (None inside when it reports none); None if the
    answer is not a JSON object, which leaves the call's outcome unknown."""
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    return (usage_of(call_plan.api, doc.get("usage"), doc.get("service_tier")),)


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

    def record(self, store: LedgerStore, model: str, output_tokens: int) -> None:
        """Count one call's output length (per choice), unless this model was counted just now."""
        key = model.lower()
        now_s = self._clock()
        if now_s - self._recorded_at_s.get(key, -OBSERVE_INTERVAL_S) < OBSERVE_INTERVAL_S:
            return
        if len(self._recorded_at_s) >= HISTOGRAM_MODELS_MAX:
            self._recorded_at_s.clear()
        self._recorded_at_s[key] = now_s
        spawn(_observe(store, model, output_tokens))

    async def p95_tokens(self, store: LedgerStore, model: str) -> int | None:
        key = model.lower()
        now_s = self._clock()
        cached = self._cache.get(key)
        if cached is not None and cached[0] > now_s:
            return cached[1]
        try:
            histogram = await store.output_histogram(model)
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

    With `clamp` (X-Ceiling-Clamp: 1), a call whose worst case does not fit is sent with the
    largest output cap that does, if that is at least CLAMP_OUTPUT_TOKENS_MIN; else it is refused.
    """
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
    if not clamp:
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
        remaining = run_remaining = None
        for leg in reservation.legs:
            left = max(0, leg.ceiling_micros - leg.committed_micros - leg.reserved_micros
                       + held - charged_micros)
            if run is not None and leg.budget_id == run.budget_id.path:
                run_remaining = left
            else:
                remaining = left if remaining is None else min(remaining, left)
        return Bill(reservation.reservation_id, held, charged_micros, outcome, remaining,
                    run_remaining)

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
        if usage is not None and usage.service_tier == TIER_AUTO:
            # The answer names no tier: it was served at the one the request named, if any.
            usage = replace(usage, service_tier=call_plan.service_tier)
        try:
            spec = SettleSpec(usage) if usage is not None else SettleSpec(actual_micros=max(
                self.hold.reservation.reserved_micros,
                self.svc.worst_case_micros(call_plan.spec())[0]))
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


async def _observe(store: LedgerStore, model: str, output_tokens: int) -> None:
    try:
        await store.observe_output(model, output_tokens)
    except CeilingError:
        return  # a lost observation moves a p95 by nothing; no money depends on it
