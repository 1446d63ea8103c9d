"""The demo: 25 instances, each with its own memory, spend against one $0.05 ceiling.

Each instance is an OS process (as each serverless instance is), and each gets one call at the
same moment: price the worst case, reserve it, "call the model", settle the actual cost. With
per-instance memory ledgers every instance sees an untouched budget; with the shared Redis
ledger the instances see one budget. The bill is what the calls actually cost, summed outside
the ledger.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import time
import uuid
from concurrent.futures import ProcessPoolExecutor

from core.budgets import BudgetDef, BudgetId, Limit, Period
from core.errors import BudgetRefused
from core.ledger import LedgerStore, ReservationRef, ReserveRequest
from core.money import micros_to_usd, usd_to_micros
from core.stores.memory import MemoryStore
from core.stores.redis import RedisStore
from infra.redis_server import RedisServer

INSTANCES = 25
CEILING_MICROS = usd_to_micros("0.05")
WORST_CASE_MICROS = usd_to_micros("0.01")
ACTUAL_MICROS = usd_to_micros("0.008")
BUDGET = BudgetId("org:demo")
# The instances start their call together, this long after the parent hands out the work.
START_DELAY_S = 1.5


async def _one_call(redis_url: str | None, start_at: float) -> int:
    """One instance serving one call; returns what the provider billed (0 if refused)."""
    store: LedgerStore = RedisStore(redis_url) if redis_url else MemoryStore()
    if redis_url is None:  # per-instance memory: the budget exists only in this instance
        await store.put_budget(BudgetDef(BUDGET, (Limit(Period.TOTAL, CEILING_MICROS),)))
    await store.open()
    await asyncio.sleep(max(0.0, start_at - time.time()))
    ref = ReservationRef(BUDGET.tag, uuid.uuid4().hex, "demo")
    try:
        await store.reserve(ReserveRequest(
            ref, BUDGET.lineage(), WORST_CASE_MICROS, 60_000, "demo", "demo-prices"))
    except BudgetRefused:
        await store.close()
        return 0
    await asyncio.sleep(0.05)  # the model call
    await store.settle(ref, ACTUAL_MICROS)
    await store.close()
    return ACTUAL_MICROS


async def _define_budget(redis_url: str) -> None:
    store = RedisStore(redis_url)
    await store.put_budget(BudgetDef(BUDGET, (Limit(Period.TOTAL, CEILING_MICROS),)))
    await store.close()


def _instance(redis_url: str | None, start_at: float) -> int:
    return asyncio.run(_one_call(redis_url, start_at))


def _fleet(redis_url: str | None) -> list[int]:
    start_at = time.time() + START_DELAY_S
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(INSTANCES, mp_context=ctx) as pool:
        return list(pool.map(_instance, [redis_url] * INSTANCES, [start_at] * INSTANCES))


def _row(name: str, bills: list[int]) -> str:
    billed = sum(bills)
    overrun = max(0, billed - CEILING_MICROS) * 100 / CEILING_MICROS
    admitted = sum(1 for b in bills if b)
    return (f"{name:<28} {admitted:>3}/{INSTANCES}  ${micros_to_usd(billed):>10}  "
            f"{overrun:>7.0f}%")


def main() -> None:
    argparse.ArgumentParser(description=__doc__).parse_args()
    print(f"ceiling ${micros_to_usd(CEILING_MICROS)}; {INSTANCES} instances, one call each; "
          f"worst case ${micros_to_usd(WORST_CASE_MICROS)}, actual ${micros_to_usd(ACTUAL_MICROS)}")
    with RedisServer(durable=True) as redis_server:
        asyncio.run(_define_budget(redis_server.url))
        memory = _fleet(None)
        shared = _fleet(redis_server.url)
    print(f"{'ledger':<28} admitted  {'billed':>11}  {'overrun':>8}")
    print(_row("per-instance memory", memory))
    print(_row("shared Redis", shared))
    if sum(shared) > CEILING_MICROS:
        raise SystemExit("the shared ledger let spend exceed the ceiling")


if __name__ == "__main__":
    main()
