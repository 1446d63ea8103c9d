"""What the hostile key holder suites share (test_hostile.py, test_hostile_messages.py): an
attack's record, and its judgement by the provider's bill and the ledger's books in Redis.

After an attack the ledger's own expiry runs with a clock past the longest lease (what a sweeper
does once the leases end), so every hold the attack left is resolved as the ledger resolves it;
then, from the stub's bill (GET /billing) and the ledger's records in Redis:
- the provider's bill is within the ceiling;
- the ledger's committed spend is at least the bill, and nothing is left held;
- where a test says so, every forwarded call was billed at most what the gateway held for it
  (the worst case is an upper bound), and, where every outcome was known, committed equals the
  bill to the micro-dollar.

Calls may go through either SDK: `openai` or `anthropic` (whose errors carry the gateway's code
in their body rather than as an attribute).
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anthropic
import httpx
import openai
import redis.asyncio as aioredis

from core.budgets import BudgetId
from core.ledger import LegStatus
from core.limits import RESERVATION_TTL_MS_MAX, SWEEP_BATCH_MAX
from core.stores.redis import RedisStore
from infra.redis_server import RedisServer
from infra.stub_provider import Bill, StubProvider, fetch_bill, stub_control

T = TypeVar("T")
# What an SDK raises for an error answer.
STATUS_ERRORS = (openai.APIStatusError, anthropic.APIStatusError)


def refusal_code(refused: openai.APIStatusError | anthropic.APIStatusError) -> str:
    """The gateway's error code of a refusal (a provider's error has none: its status)."""
    body = refused.body
    error = body.get("error") if isinstance(body, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    if code is None and isinstance(body, dict):
        code = body.get("code")
    return str(code or refused.status_code)


# -- the attack's record and its judgement -------------------------------------------------------


def control(stub: StubProvider, **settings: Any) -> None:
    """Faults and settings of the stub's next calls (a fault set replaces the last one)."""
    stub_control(stub.url, settings)


@dataclass
class Forwarded:
    """A call the gateway held for and sent on."""

    reservation_id: str
    held_micros: int
    outcome: str | None  # None for a stream: its outcome comes in its trailer


@dataclass
class Attack:
    """What a key holder sent and what became of it."""

    vector: str
    calls: int = 0
    forwarded: list[Forwarded] = field(default_factory=list)
    refusals: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, create: Callable[..., Any], **request: Any) -> Any:
        """Send one call (`create`, an SDK's `with_raw_response.create`, or a function of no
        arguments that calls one); the raw response, or None if the gateway answered an error.
        A stream is not read here. Safe from many threads."""
        try:
            raw = create(**request)
        except STATUS_ERRORS as refused:
            self.note(refused.response.headers, refusal_code(refused))
            return None
        self.note(raw.headers)
        return raw

    def note(self, headers: httpx.Headers | Any, refusal: str | None = None) -> None:
        """One call's answer: its refusal, and its hold if it was forwarded (a replayed answer
        repeats its call's reservation id and is not a hold of its own)."""
        with self._lock:
            self.calls += 1
            if refusal is not None:
                self.refusals[refusal] += 1
            if "x-ceiling-reservation-id" in headers and "x-ceiling-replayed" not in headers:
                self.forwarded.append(Forwarded(
                    headers["x-ceiling-reservation-id"],
                    int(headers["x-ceiling-reserved-micros"]),
                    headers.get("x-ceiling-billing-outcome")))

    def outcomes(self) -> Counter[str | None]:
        return Counter(f.outcome for f in self.forwarded)


@dataclass(frozen=True)
class Verdict:
    vector: str
    calls: int
    provider_calls: int
    ceiling_micros: int
    billed_micros: int
    committed_micros: int
    bill: Bill


def blocking(work: Coroutine[Any, Any, T]) -> T:
    """Run ledger reads on a loop of their own: the tests are synchronous SDK clients."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, work).result()


async def expire_held(redis_url: str, tag: str) -> int:
    """The ledger's expiry of every lease of `tag`, with a clock past the longest lease: what
    the sweeper does once they end (a gateway call left held is charged, whatever the policy)."""
    raw = aioredis.Redis.from_url(redis_url)
    seconds, micros = await raw.time()
    await raw.aclose()
    later_ms = int(seconds) * 1_000 + int(micros) // 1_000 + RESERVATION_TTL_MS_MAX + 1
    store = RedisStore(redis_url, clock=lambda: later_ms)
    try:
        return await store.expire(tag, SWEEP_BATCH_MAX)
    finally:
        await store.close()


async def books(redis_url: str, tag: str) -> LegStatus:
    """The budget's `total` counter as the ledger keeps it in Redis."""
    store = RedisStore(redis_url)
    try:
        (leg,) = await store.status((BudgetId(tag),))
    finally:
        await store.close()
    return leg


def judge(attack: Attack, stub: StubProvider, redis_server: RedisServer, tag: str,
          ceiling_micros: int, *, exact: bool = False, per_call: bool = False) -> Verdict:
    """Resolve what the attack left held, then hold the bill and the books to the ceiling.

    `per_call`: the calls were sent one after another, so the stub's log is in the order of
    `attack.forwarded`, and each call was billed at most what was held for it. `exact`: every
    outcome was known, so committed is the bill to the micro-dollar."""
    blocking(expire_held(redis_server.url, tag))
    bill = fetch_bill(stub.url)
    leg = blocking(books(redis_server.url, tag))
    verdict = Verdict(attack.vector, attack.calls, bill.total.calls, ceiling_micros,
                      bill.total.cost_micros, leg.committed_micros, bill)
    print(f"\nhostile | {attack.vector} | calls {attack.calls}, provider billed "
          f"{verdict.provider_calls} | ceiling {ceiling_micros} | billed {verdict.billed_micros}"
          f" | committed {verdict.committed_micros} | refusals {dict(attack.refusals)}")
    if per_call:
        assert len(bill.log) == len(attack.forwarded), "one provider request a forwarded call"
        over = [(f.reservation_id, f.held_micros, c.cost_micros)
                for f, c in zip(attack.forwarded, bill.log, strict=True)
                if c.cost_micros > f.held_micros]
        assert not over, f"billed above the hold (id, held, billed): {over}"
    assert verdict.billed_micros <= ceiling_micros, "the provider's bill passed the ceiling"
    assert leg.committed_micros >= verdict.billed_micros, "the ledger committed less than billed"
    assert leg.reserved_micros == 0
    if exact:
        assert leg.committed_micros == verdict.billed_micros
    return verdict


def streamed(raw: Any) -> bool:
    """Read a stream to its end; False if it ended on an error event (broken off): the SDKs
    raise on a chat or Messages stream's, and yield a Responses stream's for the client to
    read."""
    try:
        return all(getattr(event, "type", None) != "error" for event in raw.parse())
    except (openai.APIError, anthropic.APIError):
        return False
