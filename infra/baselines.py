"""The spend limits people ship, measured against the provider's bill, beside the enforced path.

Run by `python -m bench.baselines` (its entry point), by the demo (infra/demo.py) and by
tests/test_proof.py.

One redis-server and one stub provider (infra.stub_provider, which bills what it serves at real
rates) serve every pattern; the provider's bill is reset before each pattern and read after it,
so an overrun is what a provider would invoice beyond the ceiling, not what the code believed.

Part one: WORKERS concurrent workers, each calling until its pattern says stop, against one
CEILING_MICROS budget (gpt-4o, up to 1,000 output tokens a call, realistic answer lengths):

  check spend, then call    read the spend counter; if it is under the ceiling, call, then add
                            the cost. Every worker passes the same stale check.
  check after the call      call, add the cost, stop once the total is over the ceiling: a
                            report, not a control.
  async telemetry write     check as above, but the cost reaches the counter through a
                            telemetry pipeline that flushes every TELEMETRY_FLUSH_S.
  budget read once          each worker is one request (an agent run of several calls) that
                            reads the remaining budget once and trusts it for all its calls.
  reserve -> settle         the enforced path: core's CeilingService on the shared Redis ledger,
                            pricing the worst case, reserving it atomically, settling the usage.

Part two: RACE_REQUESTS concurrent requests against a ceiling with room for exactly RACE_ROOM
calls of a fixed cost: a naive read-check-write counter (GET, compare, INCRBY; every request
reads before any writes, as in a burst across instances) against the atomic reserve script,
both through the Redis client the service ships (core.stores.redis: a pool of 64 connections).
The atomic script admits exactly RACE_ROOM. All requests are admitted (or
not) before the admitted ones call the provider: neither pattern looks at the call's result to
admit, and a thousand HTTP calls on this process's event loop would only slow the race down.

Bounded: every worker stops after CALLS_PER_WORKER_MAX calls, and no call starts after
PATTERN_DEADLINE_S. Everything listens on 127.0.0.1 and is stopped when the run ends.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import httpx
from redis.asyncio.client import Redis

from core.budgets import BudgetDef, BudgetId, Limit, Period
from core.errors import BudgetBusy, BudgetExceeded
from core.ledger import ReservationRef, ReserveRequest
from core.money import micros_to_usd, usd_to_micros
from core.prices import PriceTable, Usage
from core.service import Caller, CallSpec, CeilingService, SettleSpec
from core.stores.redis import RedisStore, redis_client
from infra.figures import table
from infra.redis_server import RedisServer
from infra.stub_provider import StubProvider

WORKERS = 25
CEILING_MICROS = usd_to_micros("0.05")
MODEL = "gpt-4o"
OUTPUT_TOKENS_MAX = 1_000
PROMPT = "Summarise this support ticket in two sentences."
# A telemetry pipeline that lands costs within a second is fast; real ones take minutes.
TELEMETRY_FLUSH_S = 1.0
CALLS_PER_WORKER_MAX = 20
PATTERN_DEADLINE_S = 30.0
RACE_REQUESTS = 1_000
RACE_ROOM = 500
# Each race call answers exactly this many tokens, so every call costs the same.
RACE_OUTPUT_TOKENS = 20
# Concurrent connections to the provider: the 1,000 requests queue here after their check.
PROVIDER_CONNECTIONS_MAX = 100
PROVIDER_TIMEOUT_S = 30.0
# The race sends 1,000 ledger calls at once through one connection pool: they queue for its
# connections, longer than one production call's bound when the machine is busy (the suite runs
# in parallel). What the race measures is who got past the check, not how fast.
RACE_LEDGER_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Row:
    pattern: str
    enforced: bool
    requests: int
    ceiling_micros: int
    calls: int
    billed_micros: int
    elapsed_s: float

    @property
    def overrun_pct(self) -> float:
        return max(0, self.billed_micros - self.ceiling_micros) * 100 / self.ceiling_micros


class Bench:
    """The shared Redis and provider, and the one call every pattern makes."""

    def __init__(self, redis_url: str, provider_url: str) -> None:
        self.redis: Redis = redis_client(redis_url, call_timeout_s=RACE_LEDGER_TIMEOUT_S)
        self.http = httpx.AsyncClient(
            base_url=provider_url, timeout=PROVIDER_TIMEOUT_S,
            limits=httpx.Limits(max_connections=PROVIDER_CONNECTIONS_MAX),
        )
        self.prices = PriceTable()

    async def close(self) -> None:
        await self.http.aclose()
        await self.redis.aclose()

    async def call_model(self, messages: list[dict[str, str]], output_tokens_max: int,
                         headers: dict[str, str] | None = None) -> Usage:
        response = await self.http.post("/v1/chat/completions", headers=headers, json={
            "model": MODEL, "messages": messages, "max_tokens": output_tokens_max})
        response.raise_for_status()
        u = response.json()["usage"]
        return Usage(u["prompt_tokens"], u["completion_tokens"],
                     u["prompt_tokens_details"]["cached_tokens"])

    def cost_micros(self, usage: Usage) -> int:
        """What a caller computes from the usage it was sent, with the bill's price list."""
        return self.prices.cost_micros(MODEL, usage)

    async def reset_bill(self) -> None:
        (await self.http.post("/billing/reset")).raise_for_status()

    async def bill(self) -> tuple[int, int]:
        """Calls billed and their cost in micro-dollars, since the last reset."""
        doc = (await self.http.get("/billing")).json()
        return int(doc["calls"]), int(doc["cost_micros"])

    async def measured(self, pattern: str, enforced: bool, requests: int, ceiling_micros: int,
                       work: Callable[[], Awaitable[None]]) -> Row:
        await self.reset_bill()
        started = time.monotonic()
        await work()
        elapsed_s = time.monotonic() - started
        calls, billed_micros = await self.bill()
        return Row(pattern, enforced, requests, ceiling_micros, calls, billed_micros, elapsed_s)


@dataclass
class Budget:
    """One pattern's run: its spend counter in Redis, its workers and its deadline."""

    bench: Bench
    counter_key: str = field(default_factory=lambda: f"bench:spent:{uuid.uuid4().hex}")
    deadline: float = field(default_factory=lambda: time.monotonic() + PATTERN_DEADLINE_S)

    def open(self, calls: int) -> bool:
        return calls < CALLS_PER_WORKER_MAX and time.monotonic() < self.deadline

    async def spent_micros(self) -> int:
        return int(await self.bench.redis.get(self.counter_key) or 0)

    async def add(self, micros: int) -> int:
        return int(await self.bench.redis.incrby(self.counter_key, micros))

    async def call(self, worker: int, calls: int) -> int:
        """One model call; returns its cost as the caller computes it from the usage."""
        usage = await self.bench.call_model(messages(worker, calls), OUTPUT_TOKENS_MAX)
        return self.bench.cost_micros(usage)

    async def together(self, worker: Callable[[int], Awaitable[None]]) -> None:
        await asyncio.gather(*(worker(i) for i in range(WORKERS)))


def messages(worker: int, call: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{PROMPT} (worker {worker}, call {call})"}]


async def check_then_call(budget: Budget) -> None:
    async def worker(index: int) -> None:
        calls = 0
        while budget.open(calls) and await budget.spent_micros() < CEILING_MICROS:
            cost = await budget.call(index, calls)
            calls += 1
            await budget.add(cost)

    await budget.together(worker)


async def call_then_check(budget: Budget) -> None:
    async def worker(index: int) -> None:
        calls = 0
        while budget.open(calls):
            cost = await budget.call(index, calls)
            calls += 1
            if await budget.add(cost) >= CEILING_MICROS:
                return

    await budget.together(worker)


async def async_telemetry(budget: Budget) -> None:
    pending: list[int] = []

    async def flush_forever() -> None:
        while True:
            await asyncio.sleep(TELEMETRY_FLUSH_S)
            batch, pending[:] = sum(pending), []
            if batch:
                await budget.add(batch)

    async def worker(index: int) -> None:
        calls = 0
        while budget.open(calls) and await budget.spent_micros() < CEILING_MICROS:
            pending.append(await budget.call(index, calls))
            calls += 1

    flusher = asyncio.create_task(flush_forever())
    try:
        await budget.together(worker)
    finally:
        flusher.cancel()


async def budget_read_once(budget: Budget) -> None:
    async def worker(index: int) -> None:
        remaining_micros = CEILING_MICROS - await budget.spent_micros()
        spent_here_micros, calls = 0, 0
        while budget.open(calls) and spent_here_micros < remaining_micros:
            cost = await budget.call(index, calls)
            calls += 1
            spent_here_micros += cost
            await budget.add(cost)

    await budget.together(worker)


def reserve_settle(service: CeilingService, caller: Caller) -> Pattern:
    """The enforced path, as the service runs it: price, reserve, call, settle the usage."""

    async def pattern(budget: Budget) -> None:
        async def worker(index: int) -> None:
            calls = 0
            while budget.open(calls):
                msgs = messages(index, calls)
                spec = CallSpec(model=MODEL, messages=msgs, output_tokens_max=OUTPUT_TOKENS_MAX)
                try:
                    reservation = await service.reserve(caller, spec)
                except BudgetBusy as exc:
                    await asyncio.sleep(float(exc.details["retry_after_s"]))
                    continue
                except BudgetExceeded:
                    return
                usage = await budget.bench.call_model(msgs, OUTPUT_TOKENS_MAX)
                calls += 1
                await service.settle(caller, reservation.reservation_id, SettleSpec(usage=usage))

        await budget.together(worker)

    return pattern


Pattern = Callable[[Budget], Awaitable[None]]


async def run_pattern(bench: Bench, pattern: Pattern) -> None:
    """Each pattern gets a spend counter and a deadline of its own."""
    await pattern(Budget(bench))


async def enforced_caller(service: CeilingService, ceiling_micros: int) -> Caller:
    budget_id = BudgetId(f"org:bench-{uuid.uuid4().hex[:8]}")
    await service.put_budget(BudgetDef(budget_id, (Limit(Period.TOTAL, ceiling_micros),)))
    return Caller((await service.create_key(budget_id, None)).record)


# -- part two: the counter race ------------------------------------------------------------------


async def race_unit_micros(bench: Bench) -> int:
    """The cost of one race call, as the provider bills it: one call on a fresh bill."""
    await bench.reset_bill()
    await race_call(bench)
    return (await bench.bill())[1]


async def race_call(bench: Bench) -> None:
    await bench.call_model(messages(0, 0), RACE_OUTPUT_TOKENS,
                           headers={"X-Stub-Output-Tokens": str(RACE_OUTPUT_TOKENS)})


async def naive_counter(bench: Bench, unit_micros: int, ceiling_micros: int) -> None:
    key = f"bench:naive:{uuid.uuid4().hex}"
    redis = bench.redis

    # The requests arrive together, as a burst across instances does: each has read the counter
    # before any of them writes it. Left to the connection pool's timing, how many reads came
    # before the first write moved with the machine's load, down to none.
    all_read = asyncio.Barrier(RACE_REQUESTS)

    async def admit() -> bool:
        spent = int(await redis.get(key) or 0)
        await all_read.wait()
        if spent + unit_micros > ceiling_micros:
            return False
        await redis.incrby(key, unit_micros)
        return True

    admitted = await asyncio.gather(*(admit() for _ in range(RACE_REQUESTS)))
    await asyncio.gather(*(race_call(bench) for ok in admitted if ok))


async def atomic_script(store: RedisStore, bench: Bench, unit_micros: int,
                        ceiling_micros: int) -> None:
    budget_id = BudgetId(f"org:race-{uuid.uuid4().hex[:8]}")
    await store.put_budget(BudgetDef(budget_id, (Limit(Period.TOTAL, ceiling_micros),)))

    async def admit() -> ReservationRef | None:
        ref = ReservationRef(budget_id.tag, uuid.uuid4().hex, "bench")
        try:
            await store.reserve(ReserveRequest(ref, budget_id.lineage, unit_micros, 60_000,
                                               "bench", "bench"))
        except (BudgetExceeded, BudgetBusy):
            return None
        return ref

    async def call_and_settle(ref: ReservationRef) -> None:
        await race_call(bench)
        await store.settle(ref, unit_micros)

    admitted = await asyncio.gather(*(admit() for _ in range(RACE_REQUESTS)))
    await asyncio.gather(*(call_and_settle(ref) for ref in admitted if ref is not None))


# -- the run ---------------------------------------------------------------------------------


async def measure(redis_url: str, provider_url: str) -> list[Row]:
    bench = Bench(redis_url, provider_url)
    store = RedisStore(redis_url, call_timeout_s=RACE_LEDGER_TIMEOUT_S)
    service = CeilingService(store, bench.prices)
    try:
        caller = await enforced_caller(service, CEILING_MICROS)
        patterns: Sequence[tuple[str, bool, Pattern]] = (
            ("check spend, then call", False, check_then_call),
            ("check after the call", False, call_then_check),
            ("async telemetry write", False, async_telemetry),
            ("budget read once per request", False, budget_read_once),
            ("reserve -> settle (enforced)", True, reserve_settle(service, caller)),
        )
        rows = []
        for name, enforced, pattern in patterns:
            rows.append(await bench.measured(
                name, enforced, WORKERS, CEILING_MICROS,
                partial(run_pattern, bench, pattern)))
        unit_micros = await race_unit_micros(bench)
        race_ceiling_micros = RACE_ROOM * unit_micros
        rows.append(await bench.measured(
            "naive read-check-write counter", False, RACE_REQUESTS, race_ceiling_micros,
            lambda: naive_counter(bench, unit_micros, race_ceiling_micros)))
        rows.append(await bench.measured(
            "atomic reserve script (enforced)", True, RACE_REQUESTS, race_ceiling_micros,
            lambda: atomic_script(store, bench, unit_micros, race_ceiling_micros)))
        return rows
    finally:
        await store.close()
        await bench.close()


def run(seed: int = 0) -> list[Row]:
    """Start a Redis and a provider of its own, measure every pattern, and stop them.

    The measuring runs in a child process: the provider is a thread of this one, and two busy
    event loops behind one GIL would add milliseconds of switching to every call.
    """
    with (RedisServer(durable=True) as redis_server, StubProvider(seed=seed) as provider,
          ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool):
        return pool.submit(measure_in_child, redis_server.url, provider.url).result()


def measure_in_child(redis_url: str, provider_url: str) -> list[Row]:
    return asyncio.run(measure(redis_url, provider_url))


def report(rows: Sequence[Row]) -> str:
    return table(
        ("pattern", "concurrent", "ceiling $", "calls billed", "billed $", "overrun", "took s"),
        [(r.pattern, str(r.requests), micros_to_usd(r.ceiling_micros), str(r.calls),
          micros_to_usd(r.billed_micros), f"{r.overrun_pct:.0f}%", f"{r.elapsed_s:.1f}")
         for r in rows],
    )
