"""What the ledger keeps to be reconciled with the providers' bills, against every store: each
gateway settle's spend in its upstream's UTC day, a drift event once per provider and day, and the
refusals its scripts decide, counted by code."""

from __future__ import annotations

import asyncio
import secrets
import time
from datetime import date, timedelta

import pytest

from core.alerts import AlertEvent
from core.budgets import BudgetDef, BudgetId, Limit, Period
from core.errors import BudgetBusy, BudgetExceeded, InvalidRequest
from core.ledger import DriftEvent, LedgerStore, ReservationRef, Upstream, day_index
from core.limits import DAILY_SPEND_DAYS_MAX, DAY_MS, RESEND_WINDOW_MS
from core.stores import keys
from tests.core.stores.test_conformance import OWNER, request
from tests.support import ManualClock


async def put(store: LedgerStore, path: str, ceiling: int) -> None:
    await store.put_budget(BudgetDef(BudgetId.parse(path), (Limit(Period.TOTAL, ceiling),)))


def today(clock: ManualClock) -> date:
    return date(1970, 1, 1) + timedelta(days=clock.now_ms // DAY_MS)


@pytest.fixture
def clock(clock: ManualClock) -> ManualClock:
    """The ledger's days are the whole ledger's: each test spends on a day of its own, in the
    years to come (a day's spend expires by Redis' own clock, a retention after the day)."""
    clock.now_ms = (int(time.time() * 1000) // DAY_MS + 1 + secrets.randbelow(30_000)) * DAY_MS
    clock.now_ms += 3_600_000
    return clock


async def gateway_call(store: LedgerStore, tag: str, held: int, actual: int,
                       upstream: Upstream | None, *, general: bool = False) -> None:
    """A gateway call: held, then settled at `actual`. `general`: a record kept past a resend,
    which the settle script's general case resolves."""
    retention = RESEND_WINDOW_MS * 10 if general else RESEND_WINDOW_MS
    r = await store.reserve(request(tag, tag, held, fingerprint="", retention_ms=retention))
    await store.settle(ReservationRef(tag, r.reservation_id, OWNER), actual, upstream)


@pytest.mark.parametrize("general", [False, True], ids=["common", "general"])
async def test_a_gateway_settle_counts_in_its_upstream_day(
    store: LedgerStore, tag: str, clock: ManualClock, general: bool
) -> None:
    await put(store, tag, 10_000_000)
    day = today(clock)
    await gateway_call(store, tag, 500, 300, Upstream.OPENAI, general=general)
    await gateway_call(store, tag, 500, 450, Upstream.OPENAI, general=general)
    await gateway_call(store, tag, 500, 70, Upstream.ANTHROPIC, general=general)
    # A Gemini call's, though no cost report is read for it (settle.lua took only the two).
    await gateway_call(store, tag, 500, 9, Upstream.GOOGLE, general=general)
    await gateway_call(store, tag, 500, 99, None, general=general)  # a sidecar's: no upstream
    assert await store.gateway_spend_by_day(Upstream.OPENAI, day, day) == {day: 750}
    assert await store.gateway_spend_by_day(Upstream.ANTHROPIC, day, day) == {day: 70}
    assert await store.gateway_spend_by_day(Upstream.GOOGLE, day, day) == {day: 9}
    # A call counts on the day it began, though it settles the next.
    r = await store.reserve(request(tag, tag, 500, fingerprint="", retention_ms=RESEND_WINDOW_MS))
    clock.now_ms = (clock.now_ms // DAY_MS + 1) * DAY_MS + 5
    await store.settle(ReservationRef(tag, r.reservation_id, OWNER), 20, Upstream.OPENAI)
    await gateway_call(store, tag, 500, 1, Upstream.OPENAI, general=general)
    following = day + timedelta(days=1)
    assert await store.gateway_spend_by_day(Upstream.OPENAI, day, following) == {
        day: 770, following: 1}
    # Replaying the settle books nothing twice.
    await store.settle(ReservationRef(tag, r.reservation_id, OWNER), 20, Upstream.OPENAI)
    assert (await store.gateway_spend_by_day(Upstream.OPENAI, day, day))[day] == 770


async def test_each_tag_adds_up_and_the_day_expires(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    other = tag + "x"
    await put(store, tag, 10_000)
    await put(store, other, 10_000)
    await gateway_call(store, tag, 100, 40, Upstream.OPENAI)
    await gateway_call(store, other, 100, 2, Upstream.OPENAI)
    day = today(clock)
    assert await store.gateway_spend_by_day(Upstream.OPENAI, day, day) == {day: 42}
    expires_at_ms = await store._t.execute(  # type: ignore[attr-defined]
        "PEXPIRETIME", keys.daily_spend(tag, "openai", day_index(day)))
    assert int(expires_at_ms) == (day_index(day) + 1 + DAILY_SPEND_DAYS_MAX) * DAY_MS


async def test_a_range_longer_than_kept_is_refused(store: LedgerStore, clock: ManualClock) -> None:
    day = today(clock)
    with pytest.raises(InvalidRequest):
        await store.gateway_spend_by_day(
            Upstream.OPENAI, day - timedelta(days=DAILY_SPEND_DAYS_MAX), day)
    assert await store.gateway_spend_by_day(Upstream.OPENAI, day, day - timedelta(days=1)) == {}


async def test_a_drift_event_is_put_once_per_provider_and_day(
    store: LedgerStore, clock: ManualClock
) -> None:
    day = date(2026, 11, 30) + timedelta(days=secrets.randbelow(10**6))  # a day of its own
    event = DriftEvent(Upstream.ANTHROPIC, day, 1_000, 2_000)
    results = await asyncio.gather(*(store.emit_drift_alert(event) for _ in range(8)))
    assert sorted(results) == [False] * 7 + [True]
    assert await store.emit_drift_alert(DriftEvent(Upstream.ANTHROPIC, day, 5, 9)) is False
    assert await store.emit_drift_alert(DriftEvent(Upstream.OPENAI, day, 1_000, 2_000)) is True
    assert keys.LEDGER_EVENTS_TAG in await store.alert_tags()
    log: list[AlertEvent] = await store.alert_log(keys.LEDGER_EVENTS_TAG, 1_000)
    assert sorted((e.type, e.committed_micros) for e in log
                  if e.period_key == f"day:{day.isoformat()}") == [("ledger.drift", 1_000)] * 2


async def test_refusals_are_counted_by_code(store: LedgerStore, tag: str) -> None:
    await put(store, tag, 100)
    await store.reserve(request(tag, tag, 100))
    before = await store.refusal_counts()
    for _ in range(3):
        with pytest.raises(BudgetExceeded):
            await store.reserve(request(tag, tag, 101))
    with pytest.raises(BudgetBusy):
        await store.reserve(request(tag, tag, 1))
    after = await store.refusal_counts()
    # The whole ledger's: other tests refuse too, never fewer.
    assert after.get("budget_exceeded", 0) - before.get("budget_exceeded", 0) >= 3
    assert after.get("budget_busy", 0) - before.get("budget_busy", 0) >= 1
    assert await store._t.execute(  # type: ignore[attr-defined]
        "HGETALL", keys.refused(tag)) in ({"budget_exceeded": "3", "budget_busy": "1"},
                                          ["budget_exceeded", "3", "budget_busy", "1"])
