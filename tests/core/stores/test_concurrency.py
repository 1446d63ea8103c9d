"""Concurrency: exact numbers, not "at most"."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

import pytest

from core.budgets import Period
from core.errors import BudgetRefused
from core.ledger import LedgerStore, ReservationRef
from tests.core.stores.test_conformance import OWNER, TTL_MS, leg, put, request
from tests.support import SHARED_STORE_BUILDERS, ManualClock, process_context

PROCESSES = 4
REQUESTS = 1_000
CEILING_MICROS = 500
# Children wait for each other (connected and ready) before they send, so their requests
# overlap instead of running one process after another; a start-up slower than this is broken.
READY_TIMEOUT_S = 120.0


async def _reserve_many(
    build: Callable[[], LedgerStore], tag: str, n: int, ready: threading.Barrier
) -> int:
    store = build()
    await store.open()
    await asyncio.to_thread(ready.wait, READY_TIMEOUT_S)

    async def one() -> int:
        try:
            await store.reserve(request(tag, tag, 1))
        except BudgetRefused:
            return 0
        return 1

    admitted = sum(await asyncio.gather(*(one() for _ in range(n))))
    await store.close()
    return admitted


def _child(
    build: Callable[[], LedgerStore], tag: str, n: int, ready: threading.Barrier
) -> int:
    return asyncio.run(_reserve_many(build, tag, n, ready))


@pytest.mark.slow
async def test_exactly_the_ceiling_is_admitted_across_processes(
    request: pytest.FixtureRequest, shared_store_kind: str, tag: str
) -> None:
    build = SHARED_STORE_BUILDERS[shared_store_kind](request)
    store = build()
    await put(store, tag, (Period.TOTAL, CEILING_MICROS))
    ctx = process_context()
    with ctx.Manager() as manager, ProcessPoolExecutor(PROCESSES, mp_context=ctx) as pool:
        ready = manager.Barrier(PROCESSES)
        futures = [
            asyncio.wrap_future(pool.submit(_child, build, tag, REQUESTS // PROCESSES, ready))
            for _ in range(PROCESSES)
        ]
        admitted = await asyncio.gather(*futures)
    assert sum(admitted) == CEILING_MICROS
    # The processes raced each other (which ones win the 500 is up to the scheduler).
    assert sum(1 for a in admitted if a > 0) >= 2, admitted
    total = await leg(store, tag)
    assert (total.reserved_micros, total.committed_micros) == (CEILING_MICROS, 0)
    await store.close()


async def test_a_random_mix_of_outcomes_reconciles_to_the_micro(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    rng = random.Random(20261130)
    await put(store, tag, (Period.DAY, 10**9), (Period.TOTAL, 10**9))
    expected_committed = expected_overshoot = 0

    async def one(i: int) -> tuple[int, int]:
        amount = rng.randint(1, 10_000)
        r = await store.reserve(request(tag, tag, amount))
        ref = ReservationRef(tag, r.reservation_id, OWNER)
        action = i % 5
        if action == 0:
            await store.release(ref)
            return 0, 0
        if action == 4:
            return amount, 0  # left to expire: charged in full, outcome unknown
        actual = [amount // 3, amount, amount + rng.randint(1, 500)][action - 1]
        await store.settle(ref, actual)
        return actual, max(0, actual - amount)

    for committed, overshoot in await asyncio.gather(*(one(i) for i in range(200))):
        expected_committed += committed
        expected_overshoot += overshoot
    clock.advance(TTL_MS)
    assert await store.expire(tag, 1_000) == 40
    for period in (Period.DAY, Period.TOTAL):
        books = await leg(store, tag, period)
        assert (books.committed_micros, books.reserved_micros, books.overshoot_micros) == (
            expected_committed, 0, expected_overshoot
        )


async def test_settle_racing_expiry_has_one_winner(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    await put(store, tag, (Period.TOTAL, 10**9))
    late_settles = 0
    rounds = 50
    for i in range(rounds):
        r = await store.reserve(request(tag, tag, 100))
        clock.advance(TTL_MS)
        actual = 10 + i
        settle = store.settle(ReservationRef(tag, r.reservation_id, OWNER), actual)
        expire = store.expire(tag, 10)
        # Alternate which is sent first, so both orders of the race are exercised.
        if i % 2:
            expired, settled = await asyncio.gather(expire, settle)
        else:
            settled, expired = await asyncio.gather(settle, expire)
        assert settled.charged_micros == actual
        assert settled.late == (expired == 1), "exactly one of settle and expiry won the lease"
        late_settles += settled.late
    books = await leg(store, tag)
    assert (books.committed_micros, books.reserved_micros) == (
        sum(10 + i for i in range(rounds)), 0
    )
    assert 0 < late_settles < rounds, "both orders of the race happened"
