"""A gateway call's money rules without HTTP: core/gateway.py Gateway through an in-memory
Upstream (core/upstream.py), on a real ledger store, judged by the ledger's own numbers.

What a failure or an answer proves decides the hold: a call never sent is released; a provider's
own refusal (4xx but 408 and 499) is released; anything that may have been billed (5xx, 408,
499, no answer, an answer too large, a stream broken off) stays held at its reservation; a
complete answer is settled at its usage, or at its worst case when it reports none. A stream is
read to its end whatever the client does. An idempotency key keeps only a settled call's
answer; any other gives the key back, so a retry is a new call.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import pytest

from core import gateway
from core.budgets import BudgetDef, BudgetId, Limit, Period
from core.config import load as load_config
from core.errors import CeilingError
from core.formats import FORMATS, Api, Plan, WireFormat
from core.gateway import (
    Answer,
    Gateway,
    Outcome,
    Refused,
    UpstreamAnswerTooLarge,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from core.gateway_request import plan
from core.ledger import LedgerStore, LegStatus, Role, StoredReply
from core.prices import PriceTable, Usage
from core.service import Caller, CeilingService
from core.upstream import AnswerTooLarge, NotSent, Sent, Unanswered, Upstream
from core.upstreams import parse as parse_upstreams
from tests.support import STORE_FACTORIES, ManualClock

CHAT = FORMATS[Api.CHAT]
CEILING_MICROS = 10_000_000
OUTPUT_TOKENS_MAX = 1_000
BODY = json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": OUTPUT_TOKENS_MAX}).encode()
STREAM_BODY = json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": OUTPUT_TOKENS_MAX, "stream": True}).encode()
# As the answers below are read: naming no tier, priced at the dearest it could have been.
USAGE = Usage(12, 7, service_tier="auto")
ANSWER = json.dumps({"id": "c1", "object": "chat.completion", "choices": [], "usage": {
    "prompt_tokens": 12, "completion_tokens": 7}}).encode()
ANSWER_WITHOUT_USAGE = json.dumps({"id": "c1", "object": "chat.completion",
                                   "choices": []}).encode()
JSON = {"content-type": "application/json"}
EVENT = b"event: error\ndata: {}\n\n"


def chunk(**fields: Any) -> bytes:
    return b"data: " + json.dumps({"object": "chat.completion.chunk", **fields}).encode() + b"\n\n"


HELLO = chunk(choices=[{"index": 0, "delta": {"content": "hello"}}])
STOP = chunk(choices=[{"index": 0, "delta": {}, "finish_reason": "stop"}])
USAGE_CHUNK = chunk(choices=[], usage={"prompt_tokens": 12, "completion_tokens": 7})
DONE = b"data: [DONE]\n\n"


class Shapes:
    """core.gateway.Shapes, recognisable: what the route renders is api/refusals.py's."""

    def kept(self, wire: WireFormat, error: CeilingError) -> StoredReply:
        return StoredReply(409, (), json.dumps({"code": error.code}))

    def event(self, wire: WireFormat, error: CeilingError) -> bytes:
        return EVENT


Reply = Callable[[Plan], Awaitable[Sent]]


class FakeUpstream:
    """core.upstream.Upstream in memory: each call answered by `reply`, and counted."""

    answer_bytes_max = 1024

    def __init__(self, reply: Reply, timeout_s: float = 30.0) -> None:
        self.reply = reply
        self.timeout_s = timeout_s
        self.calls = 0

    async def send(self, call_plan: Plan, deadline_s: float) -> Sent:
        self.calls += 1
        return await self.reply(call_plan)

    async def count(self, api: Api, content: bytes, headers: tuple[tuple[str, str], ...],
                    model: str = "") -> Sent:
        return 200, JSON, b'{"input_tokens": 3}'


def answering(status: int, body: bytes = ANSWER) -> Reply:
    async def reply(call_plan: Plan) -> Sent:
        return status, JSON, body

    return reply


def failing(failure: Exception) -> Reply:
    async def reply(call_plan: Plan) -> Sent:
        raise failure

    return reply


def streaming(*parts: bytes, broken: bool = False, gate: asyncio.Event | None = None,
              closed: list[bool] | None = None) -> Reply:
    """A stream of `parts`; with `gate`, the second part on waits for it; `broken`: it breaks
    off after the last part; `closed` is told when the stream was closed."""

    async def chunks() -> AsyncGenerator[bytes, None]:
        try:
            for i, part in enumerate(parts):
                if gate is not None and i == 1:
                    await gate.wait()
                yield part
            if broken:
                raise Unanswered("connection reset")
        finally:
            if closed is not None:
                closed.append(True)

    async def reply(call_plan: Plan) -> Sent:
        return 200, {"content-type": "text/event-stream"}, chunks()

    return reply


class Answered(NamedTuple):
    """core.gateway.Answer, by its fields' names."""

    status: int
    headers: dict[str, str]
    body: bytes | AsyncIterator[bytes]
    background: Callable[[], Awaitable[None]] | None


def named(answer: Answer | Refused) -> Answered | Refused:
    return answer if isinstance(answer, Refused) else Answered(*answer)


@dataclass
class Ledger:
    service: CeilingService
    who: Caller
    store: LedgerStore

    async def leg(self) -> LegStatus:
        (found,) = await self.service.my_budgets(self.who)
        return found

    async def books(self) -> tuple[int, int]:
        """(committed, reserved) of the caller's budget, in micro-dollars."""
        found = await self.leg()
        return found.committed_micros, found.reserved_micros

    def gateway(self, up: FakeUpstream) -> Gateway:
        def upstream_of(wire: WireFormat) -> Upstream:
            return up

        return Gateway(upstream_of, lambda: self.store.replies, Shapes())

    async def call(self, up: FakeUpstream, body: bytes = BODY, *,
                   idempotency_key: str | None = None) -> Answered | Refused:
        return named(await self.gateway(up).serve(self.service, self.who, CHAT, body, (), None,
                                                  clamp=False, idempotency_key=idempotency_key))


@pytest.fixture(params=["memory", "redis"])
async def ledger(request: pytest.FixtureRequest, tag: str,
                 clock: ManualClock) -> AsyncIterator[Ledger]:
    """A gateway key under a budget of its own, on a memory store and on redis-server."""
    store = STORE_FACTORIES[request.param](request, clock)
    await store.open()
    service = CeilingService(store, PriceTable.from_file(None))
    await service.put_budget(BudgetDef(BudgetId(tag), (Limit(Period.TOTAL, CEILING_MICROS),)))
    key = await service.create_key(BudgetId(tag), None)
    who = await service.authenticate(key.api_key, role=Role.GATEWAY)
    yield Ledger(service, who, store)
    await finished()
    await store.close()


async def finished() -> None:
    """Wait for what the gateway runs behind its answers (a stream's reading, keeping)."""
    while gateway._background:
        await asyncio.gather(*list(gateway._background))


def worst_case_micros(ledger: Ledger, body: bytes = BODY) -> int:
    return ledger.service.worst_case_micros(plan(Api.CHAT, body).spec())[0]


def usage_micros(ledger: Ledger) -> int:
    return ledger.service.prices.cost_micros("gpt-4o", USAGE, CHAT.provider.upstream.value)


async def test_a_call_never_sent_is_released_and_charged_nothing(ledger: Ledger) -> None:
    refused = await ledger.call(FakeUpstream(failing(NotSent("connection refused"))))
    assert isinstance(refused, Refused)
    assert isinstance(refused.error, UpstreamUnreachable)
    assert refused.headers["x-ceiling-billing-outcome"] == Outcome.RELEASED
    assert refused.headers["x-ceiling-reserved-micros"] == str(worst_case_micros(ledger))
    assert await ledger.books() == (0, 0)


@pytest.mark.parametrize("status", [400, 401, 404, 422, 429])
async def test_the_providers_own_refusal_is_released(ledger: Ledger, status: int) -> None:
    answer = await ledger.call(FakeUpstream(answering(status, b'{"error": "no"}')))
    assert isinstance(answer, Answered)
    assert (answer.status, answer.body) == (status, b'{"error": "no"}')
    assert answer.headers["x-ceiling-billing-outcome"] == Outcome.RELEASED
    assert await ledger.books() == (0, 0)


@pytest.mark.parametrize("status", [408, 499, 500, 502, 503, 529])
async def test_an_error_that_may_come_after_billing_is_left_held(
    ledger: Ledger, status: int
) -> None:
    answer = await ledger.call(FakeUpstream(answering(status, b"bad gateway")))
    assert isinstance(answer, Answered)
    assert answer.status == status
    assert answer.headers["x-ceiling-billing-outcome"] == Outcome.UNKNOWN
    assert answer.headers["x-should-retry"] == "false"
    assert await ledger.books() == (0, worst_case_micros(ledger))


@pytest.mark.parametrize(("failure", "error"), [
    (Unanswered("no answer within 30 s"), UpstreamTimeout),
    (AnswerTooLarge("the answer passed 1024 bytes"), UpstreamAnswerTooLarge),
])
async def test_no_answer_or_one_too_large_is_left_held(
    ledger: Ledger, failure: Exception, error: type[CeilingError]
) -> None:
    refused = await ledger.call(FakeUpstream(failing(failure)))
    assert isinstance(refused, Refused)
    assert isinstance(refused.error, error)
    held = worst_case_micros(ledger)
    assert refused.headers["x-ceiling-charged-micros"] == str(held)
    assert await ledger.books() == (0, held)


async def test_a_complete_answer_is_settled_at_its_usage(ledger: Ledger) -> None:
    answer = await ledger.call(FakeUpstream(answering(200)))
    assert isinstance(answer, Answered)
    assert (answer.status, answer.body, answer.background) == (200, ANSWER, None)
    assert answer.headers["x-ceiling-billing-outcome"] == Outcome.BILLED
    charged = usage_micros(ledger)
    assert 0 < charged < worst_case_micros(ledger)
    assert answer.headers["x-ceiling-charged-micros"] == str(charged)
    assert await ledger.books() == (charged, 0)


async def test_a_complete_answer_without_usage_is_settled_at_its_worst_case(
    ledger: Ledger
) -> None:
    answer = await ledger.call(FakeUpstream(answering(200, ANSWER_WITHOUT_USAGE)))
    assert isinstance(answer, Answered)
    assert answer.headers["x-ceiling-billing-outcome"] == Outcome.ESTIMATED
    assert await ledger.books() == (worst_case_micros(ledger), 0)


async def test_an_answer_that_is_not_json_is_left_held(ledger: Ledger) -> None:
    answer = await ledger.call(FakeUpstream(answering(200, b"<html>gateway</html>")))
    assert isinstance(answer, Answered)
    assert answer.headers["x-ceiling-billing-outcome"] == Outcome.UNKNOWN
    assert await ledger.books() == (0, worst_case_micros(ledger))


async def read_all(body: bytes | AsyncIterator[bytes]) -> bytes:
    assert not isinstance(body, bytes)
    return b"".join([part async for part in body])


async def test_a_complete_stream_is_settled_from_its_tally(ledger: Ledger) -> None:
    closed: list[bool] = []
    answer = await ledger.call(FakeUpstream(streaming(
        HELLO, STOP, USAGE_CHUNK, DONE, closed=closed)), STREAM_BODY)
    assert isinstance(answer, Answered)
    held = worst_case_micros(ledger, STREAM_BODY)
    # The headers leave before the charge is known.
    assert answer.headers["x-ceiling-reserved-micros"] == str(held)
    assert "x-ceiling-billing-outcome" not in answer.headers
    sent = await read_all(answer.body)
    await finished()
    charged = usage_micros(ledger)
    # The usage chunk the gateway asked for is not the client's; the bill comes before [DONE].
    assert sent.startswith(HELLO + STOP + b": x-ceiling-reservation-id: ")
    assert USAGE_CHUNK not in sent
    assert f": x-ceiling-charged-micros: {charged}\n".encode() in sent
    assert b": x-ceiling-billing-outcome: billed\n" in sent
    assert sent.endswith(b"\n\n" + DONE)
    assert closed == [True]
    assert await ledger.books() == (charged, 0)


async def test_a_stream_broken_off_is_left_held_and_ends_on_an_error_event(
    ledger: Ledger
) -> None:
    # Usage came, but not the terminal event: what the provider billed is unknown.
    answer = await ledger.call(FakeUpstream(streaming(HELLO, STOP, USAGE_CHUNK, broken=True)),
                               STREAM_BODY)
    assert isinstance(answer, Answered)
    sent = await read_all(answer.body)
    await finished()
    assert sent.startswith(HELLO + STOP + EVENT)
    assert b": x-ceiling-billing-outcome: unknown\n" in sent
    assert DONE not in sent
    assert await ledger.books() == (0, worst_case_micros(ledger, STREAM_BODY))


async def test_a_stream_past_its_deadline_is_left_held(ledger: Ledger) -> None:
    gate = asyncio.Event()  # never opened: the provider stalls after its first chunk
    answer = await ledger.call(FakeUpstream(streaming(HELLO, STOP, gate=gate), timeout_s=0.05),
                               STREAM_BODY)
    assert isinstance(answer, Answered)
    sent = await read_all(answer.body)
    assert sent.startswith(HELLO + EVENT)
    assert await ledger.books() == (0, worst_case_micros(ledger, STREAM_BODY))


async def test_a_stream_whose_client_went_away_is_read_to_its_end_and_settled(
    ledger: Ledger
) -> None:
    gate = asyncio.Event()
    closed: list[bool] = []
    answer = await ledger.call(FakeUpstream(streaming(
        HELLO, STOP, USAGE_CHUNK, DONE, gate=gate, closed=closed)), STREAM_BODY)
    assert isinstance(answer, Answered)
    assert not isinstance(answer.body, bytes)
    client = aiter(answer.body)
    assert await anext(client) == HELLO
    await client.aclose()  # type: ignore[attr-defined]  # the client hung up
    assert await ledger.books() == (0, worst_case_micros(ledger, STREAM_BODY))
    gate.set()
    await finished()
    assert closed == [True]
    assert await ledger.books() == (usage_micros(ledger), 0)


async def test_a_settled_answer_is_kept_for_its_idempotency_key(ledger: Ledger) -> None:
    up = FakeUpstream(answering(200))
    first = await ledger.call(up, idempotency_key="k1")
    assert isinstance(first, Answered)
    assert first.background is not None
    await first.background()
    again = await ledger.call(up, idempotency_key="k1")
    assert isinstance(again, Answered)
    assert (again.status, again.body) == (200, ANSWER)
    assert again.headers["x-ceiling-replayed"] == "true"
    assert again.headers["x-ceiling-charged-micros"] == str(usage_micros(ledger))
    assert up.calls == 1
    assert await ledger.books() == (usage_micros(ledger), 0)  # charged once


async def test_a_settled_stream_is_kept_for_its_idempotency_key(ledger: Ledger) -> None:
    up = FakeUpstream(streaming(HELLO, STOP, USAGE_CHUNK, DONE))
    first = await ledger.call(up, STREAM_BODY, idempotency_key="s1")
    assert isinstance(first, Answered)
    sent = await read_all(first.body)
    await finished()
    again = await ledger.call(up, STREAM_BODY, idempotency_key="s1")
    assert isinstance(again, Answered)
    assert (again.body, again.headers["x-ceiling-replayed"], up.calls) == (sent, "true", 1)


@pytest.mark.parametrize(("reply", "body"), [
    (answering(503, b"overloaded"), BODY),
    (answering(400, b"bad request"), BODY),
    (failing(NotSent("refused")), BODY),
    (failing(Unanswered("reset")), BODY),
    (failing(AnswerTooLarge("too large")), BODY),
    (answering(200, b"not json"), BODY),
    (streaming(HELLO, broken=True), STREAM_BODY),
])
async def test_a_call_not_settled_gives_its_idempotency_key_back(
    ledger: Ledger, reply: Reply, body: bytes
) -> None:
    up = FakeUpstream(reply)
    for _ in range(2):
        answer = await ledger.call(up, body, idempotency_key="u1")
        if isinstance(answer, Answered) and not isinstance(answer.body, bytes):
            await read_all(answer.body)
        await finished()
        assert isinstance(answer, Refused) or "x-ceiling-replayed" not in answer.headers
    assert up.calls == 2  # the retry was a new call, which held for itself


async def test_a_token_count_holds_nothing(ledger: Ledger) -> None:
    answer = Answered(*await ledger.gateway(FakeUpstream(answering(200))).count(
        ledger.service, ledger.who, FORMATS[Api.MESSAGES], json.dumps({
            "model": "claude-sonnet-4-5", "messages": [{"role": "user", "content": "hi"}],
        }).encode(), (), None))
    assert (answer.status, answer.body) == (200, b'{"input_tokens": 3}')
    assert await ledger.books() == (0, 0)


class CountingUpstream(FakeUpstream):
    """A named upstream's client that answers a token count only for the model it knows."""

    def __init__(self, known: str) -> None:
        super().__init__(answering(200))
        self.known = known
        self.asked: list[str] = []

    async def count(self, api: Api, content: bytes, headers: tuple[tuple[str, str], ...],
                    model: str = "") -> Sent:
        self.asked.append(model)
        if model != self.known:
            return 404, JSON, b'{"error": {"code": 404, "message": "no such model"}}'
        return 200, JSON, b'{"totalTokens": 3}'


async def test_a_routed_count_asks_its_upstream_for_the_model_by_the_upstreams_name(
        ledger: Ledger) -> None:
    """A count routed as `<upstream>/<model>` (or to any upstream that knows the model by
    another name) is counted for the model the upstream knows, not the path's name."""
    config = replace(load_config({}), upstreams=parse_upstreams({"upstreams": [
        {"name": "g", "api": "gemini", "base_url": "https://example.test", "api_key_env": "K",
         "models": ["gemini-2.5-flash"]}]}, {"K": "k"}))
    up = CountingUpstream("gemini-2.5-flash")
    gw = Gateway(lambda wire: up, lambda: ledger.store.replies, Shapes(),
                 client_of=lambda definition: up)
    answer = Answered(*await gw.count(
        ledger.service, ledger.who, FORMATS[Api.GEMINI],
        json.dumps({"contents": [{"parts": [{"text": "hi"}]}]}).encode(), (), config,
        path_model="g/gemini-2.5-flash"))
    assert up.asked == ["gemini-2.5-flash"]
    assert (answer.status, answer.body) == (200, b'{"totalTokens": 3}')
    assert await ledger.books() == (0, 0)
