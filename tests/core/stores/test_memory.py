"""The single-replica ledger runs the lua/ scripts on a Redis in its own process: what only it can
show, that its keys expire by the injected clock as Redis' expire by the wall clock (test_redis.py
reads the same retentions as PTTLs)."""

from __future__ import annotations

from core.budgets import Period
from core.limits import IDEMPOTENCY_WINDOW_MS, REPLAY_WINDOW_MS
from core.stores.memory import MemoryStore
from tests.core.stores.test_conformance import put, request
from tests.support import ManualClock


async def test_a_reservation_that_moved_no_money_is_kept_for_replays_only(
        clock: ManualClock, tag: str) -> None:
    store = MemoryStore(clock=clock)
    await put(store, tag, (Period.TOTAL, 10_000))
    released, settled = request(tag, tag, 100), request(tag, tag, 100)
    for made in (released, settled):
        await store.reserve(made)
    await store.release(released.ref)
    await store.settle(settled.ref, 40)
    clock.advance(REPLAY_WINDOW_MS)  # Redis drops a key once its time is past, not at it
    assert await store.reservation(released.ref) is not None
    clock.advance(1)
    assert await store.reservation(released.ref) is None
    assert await store.reservation(settled.ref) is not None
    clock.advance(IDEMPOTENCY_WINDOW_MS - REPLAY_WINDOW_MS)
    assert await store.reservation(settled.ref) is None
    await store.close()
