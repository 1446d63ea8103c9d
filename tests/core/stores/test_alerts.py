"""Alerts (issue 16) against every store: each event once, decided in the step that moves the
money; the outbox, the log and the hourly buckets; velocity and pause; every key expires."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

import pytest

from core.alerts import (
    EXCEEDED,
    THRESHOLD_CROSSED,
    VELOCITY,
    AlertConfig,
    AlertEvent,
    VelocityAlarm,
    event_id_of,
)
from core.budgets import BudgetDef, BudgetId, Limit, Period
from core.errors import BudgetExceeded, BudgetPaused
from core.ledger import LedgerStore, ReservationRef
from core.limits import (
    ALERT_RETENTION_MS,
    IDEMPOTENCY_WINDOW_MS,
    RESEND_WINDOW_MS,
    SPEND_BUCKET_MS,
)
from core.stores import keys
from tests.core.stores.test_conformance import OWNER, TTL_MS, leg, request
from tests.core.stores.test_conformance import request as reserve_request
from tests.support import SHARED_STORE_BUILDERS, ManualClock, process_context

DAY_MS = 24 * 3_600_000


async def put(store: LedgerStore, path: str, *limits: tuple[Period, int],
              alerts: AlertConfig | None = None) -> BudgetId:
    bid = BudgetId.parse(path)
    await store.put_budget(BudgetDef(bid, tuple(Limit(p, c) for p, c in limits),
                                     alerts=alerts or AlertConfig()))
    return bid


async def spend(store: LedgerStore, tag: str, path: str, micros: int, *,
                gateway: bool = False) -> None:
    """One call: reserve what it costs, settle it at that."""
    if gateway:  # the settle script's common case: a gateway call, kept only for resends
        req = request(tag, path, micros, fingerprint="", retention_ms=RESEND_WINDOW_MS)
    else:
        req = request(tag, path, micros)
    r = await store.reserve(req)
    await store.settle(ReservationRef(tag, r.reservation_id, OWNER), micros)


async def events(store: LedgerStore, tag: str, kind: str | None = None) -> list[AlertEvent]:
    found = await store.alert_log(tag, 1_000)
    return [e for e in found if kind is None or e.type == kind]


@pytest.mark.parametrize("gateway", [False, True], ids=["sidecar", "gateway"])
async def test_each_threshold_is_crossed_once_per_period(
    store: LedgerStore, tag: str, clock: ManualClock, gateway: bool
) -> None:
    await put(store, tag, (Period.DAY, 1_000), (Period.TOTAL, 10_000))
    for _ in range(10):
        await spend(store, tag, tag, 100, gateway=gateway)
    crossed = await events(store, tag, THRESHOLD_CROSSED)
    day = (await leg(store, tag, Period.DAY)).window_key
    # day: 500 (50%), 800 (80%), 1000 (100%) once each, at the settle that reached them; the
    # total's 10,000 is 12% spent, no threshold.
    assert sorted((e.period_key, e.threshold_pct, e.committed_micros) for e in crossed) == [
        (day, 50, 500), (day, 80, 800), (day, 100, 1_000)]
    assert all(e.ceiling_micros == 1_000 and e.budget_id == tag and e.at_ms == clock.now_ms
               for e in crossed)
    assert {e.event_id for e in crossed} == {
        event_id_of(THRESHOLD_CROSSED, tag, day, str(p)) for p in (50, 80, 100)}
    # The next day is a new period: its thresholds fire again, once.
    clock.advance(DAY_MS)
    for _ in range(6):
        await spend(store, tag, tag, 100, gateway=gateway)
    assert len(await events(store, tag, THRESHOLD_CROSSED)) == 4


async def test_a_settle_that_jumps_past_several_thresholds_emits_each(
    store: LedgerStore, tag: str
) -> None:
    await put(store, tag, (Period.TOTAL, 1_000),
              alerts=AlertConfig(thresholds_pct=(25, 50, 90)))
    r = await store.reserve(request(tag, tag, 100))
    await store.settle(ReservationRef(tag, r.reservation_id, OWNER), 950)  # overshoot
    crossed = await events(store, tag, THRESHOLD_CROSSED)
    assert sorted(e.threshold_pct or 0 for e in crossed) == [25, 50, 90]
    # A repeat of the settle (a resend) books nothing and emits nothing more.
    await store.settle(ReservationRef(tag, r.reservation_id, OWNER), 950)
    assert len(await events(store, tag)) == 3


@pytest.mark.parametrize("gateway", [False, True], ids=["sidecar", "gateway"])
async def test_a_one_percent_threshold_fires_at_its_first_micro_and_not_before(
    store: LedgerStore, tag: str, gateway: bool
) -> None:
    # 1% of 200 is exactly 2 micros: the settle reaching 1 crosses nothing (the scripts skip a
    # step below 1% of the ceiling without reading the thresholds), the one reaching exactly 2
    # does; 2% is 4.
    await put(store, tag, (Period.TOTAL, 200), alerts=AlertConfig(thresholds_pct=(1, 2)))
    await spend(store, tag, tag, 1, gateway=gateway)
    assert await events(store, tag) == []
    await spend(store, tag, tag, 1, gateway=gateway)
    assert [(e.threshold_pct, e.committed_micros) for e in await events(store, tag)] == [(1, 2)]
    await spend(store, tag, tag, 1, gateway=gateway)
    assert len(await events(store, tag)) == 1
    await spend(store, tag, tag, 1, gateway=gateway)
    assert sorted((e.threshold_pct or 0, e.committed_micros)
                  for e in await events(store, tag)) == [(1, 2), (2, 4)]


async def test_no_thresholds_means_no_threshold_events(store: LedgerStore, tag: str) -> None:
    await put(store, tag, (Period.TOTAL, 100), alerts=AlertConfig(thresholds_pct=()))
    await spend(store, tag, tag, 100)
    assert await events(store, tag) == []


async def test_an_expiry_that_charges_crosses_a_threshold(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    await put(store, tag, (Period.TOTAL, 1_000))
    await store.reserve(request(tag, tag, 600))
    clock.advance(TTL_MS)
    assert await store.expire(tag, 10) == 1
    assert [e.threshold_pct for e in await events(store, tag, THRESHOLD_CROSSED)] == [50]


async def test_spend_that_falls_back_and_rises_again_does_not_alert_twice(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    await put(store, tag, (Period.TOTAL, 1_000))
    r = await store.reserve(request(tag, tag, 600))
    clock.advance(TTL_MS)
    await store.expire(tag, 10)  # charged 600: 50% crossed
    [first] = await store.claim_alerts(tag, 10, 1_000)
    await store.finish_alert(first, "delivered", 1, 0, "")
    await store.settle(ReservationRef(tag, r.reservation_id, OWNER), 100)  # late: back to 100
    assert (await leg(store, tag)).committed_micros == 100
    await spend(store, tag, tag, 450)  # 550: 50% again
    # Not emitted again: nothing new in the outbox, and the delivered event is as it was.
    clock.advance(10**6)
    assert await store.claim_alerts(tag, 10, 1_000) == []
    [logged] = await events(store, tag, THRESHOLD_CROSSED)
    assert (logged.state, logged.committed_micros) == ("delivered", 600)


async def test_the_first_refusal_of_a_period_emits_exceeded_once(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    await put(store, tag, (Period.DAY, 100), alerts=AlertConfig(thresholds_pct=()))
    await spend(store, tag, tag, 90)
    for _ in range(3):
        with pytest.raises(BudgetExceeded):
            await store.reserve(request(tag, tag, 50))
    exceeded = await events(store, tag, EXCEEDED)
    assert [(e.committed_micros, e.ceiling_micros, e.threshold_pct) for e in exceeded] == [
        (90, 100, None)]
    assert exceeded[0].period == "day"
    clock.advance(DAY_MS)
    await spend(store, tag, tag, 90)
    with pytest.raises(BudgetExceeded):
        await store.reserve(request(tag, tag, 50))
    assert len(await events(store, tag, EXCEEDED)) == 2


async def test_velocity_alarm_fires_once_per_window_and_pauses(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    alarm = VelocityAlarm(window_s=300, max_micros=1_000, pause=True)
    bid = await put(store, tag, (Period.TOTAL, 10**9),
                    alerts=AlertConfig(thresholds_pct=(), velocity=alarm))
    for _ in range(10):
        await spend(store, tag, tag, 100)  # 1,000: not above
    assert await events(store, tag, VELOCITY) == []
    await spend(store, tag, tag, 1)  # 1,001 within the window
    fired = await events(store, tag, VELOCITY)
    assert [(e.committed_micros, e.ceiling_micros) for e in fired] == [(1_001, 1_000)]
    with pytest.raises(BudgetPaused) as refused:
        await store.reserve(request(tag, tag, 1))
    assert refused.value.details["budget_id"] == tag
    found = await store.get_budget(bid)
    assert found is not None
    assert found.paused_at_ms == clock.now_ms
    # A put of the budget does not lift the pause; only a resume does.
    await put(store, tag, (Period.TOTAL, 10**9),
              alerts=AlertConfig(thresholds_pct=(), velocity=alarm))
    with pytest.raises(BudgetPaused):
        await store.reserve(request(tag, tag, 1))
    assert await store.resume(bid) is True
    assert await store.resume(bid) is False
    await spend(store, tag, tag, 1)  # same window: no second event, no second pause
    assert len(await events(store, tag, VELOCITY)) == 1
    await spend(store, tag, tag, 1)
    # A later window with the same burst fires again.
    clock.advance(600_000)
    for _ in range(11):
        await spend(store, tag, tag, 100)
    assert len(await events(store, tag, VELOCITY)) == 2


@pytest.mark.parametrize("gateway", [False, True], ids=["sidecar", "gateway"])
async def test_a_velocity_alarm_watches_the_calls_held_while_it_is_set(
    store: LedgerStore, tag: str, gateway: bool
) -> None:
    """A settle reads the tag's alarms only for a call its budget's alarm watched when it was
    held: one held before the alarm was set is not counted, one held under it is, and one
    whose alarm was taken off before it settled sets off nothing."""
    alarm = AlertConfig(thresholds_pct=(), velocity=VelocityAlarm(window_s=300, max_micros=1_000))
    kind = {"fingerprint": "", "retention_ms": RESEND_WINDOW_MS} if gateway else {}
    await put(store, tag, (Period.TOTAL, 10**9), alerts=AlertConfig(thresholds_pct=()))
    before = await store.reserve(request(tag, tag, 2_000, **kind))
    await put(store, tag, (Period.TOTAL, 10**9), alerts=alarm)
    await store.settle(ReservationRef(tag, before.reservation_id, OWNER), 2_000)
    assert await events(store, tag, VELOCITY) == []
    under = await store.reserve(request(tag, tag, 1_001, **kind))
    await store.settle(ReservationRef(tag, under.reservation_id, OWNER), 1_001)
    assert len(await events(store, tag, VELOCITY)) == 1
    other = f"{tag}/team:other"
    await put(store, other, (Period.TOTAL, 10**9), alerts=alarm)
    held = await store.reserve(request(tag, other, 5_000, **kind))
    await put(store, other, (Period.TOTAL, 10**9), alerts=AlertConfig(thresholds_pct=()))
    await store.settle(ReservationRef(tag, held.reservation_id, OWNER), 5_000)
    assert [e.budget_id for e in await events(store, tag, VELOCITY)] == [tag]


async def test_velocity_above_a_multiple_of_the_trailing_hourly_rate(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    alarm = VelocityAlarm(window_s=300, max_rate_multiple_milli=20_000)
    await put(store, tag, (Period.TOTAL, 10**12),
              alerts=AlertConfig(thresholds_pct=(), velocity=alarm))
    # A steady $2 an hour for a day: 2,000,000 micros an hour.
    for _ in range(24):
        await spend(store, tag, tag, 2_000_000)
        clock.advance(SPEND_BUCKET_MS)
    assert await events(store, tag, VELOCITY) == []
    # 20x that rate over five minutes is 20 * 2,000,000 / 12 = 3,333,333; $40 is far above.
    await spend(store, tag, tag, 3_000_000)
    assert await events(store, tag, VELOCITY) == []
    await spend(store, tag, tag, 37_000_000)
    assert len(await events(store, tag, VELOCITY)) == 1
    # No pause unless asked for.
    await spend(store, tag, tag, 1)


async def test_hourly_buckets_hold_the_spend_of_each_hour(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    bid = await put(store, tag, (Period.DAY, 10**9), (Period.TOTAL, 10**9))
    hour = clock.now_ms // SPEND_BUCKET_MS
    await spend(store, tag, tag, 300)
    await spend(store, tag, tag, 200, gateway=True)
    clock.advance(2 * SPEND_BUCKET_MS)
    await spend(store, tag, tag, 7)
    # One bucket per budget, not per period window.
    assert await store.spend_series(bid, hour - 1, hour + 3) == [(hour, 500), (hour + 2, 7)]
    total = await leg(store, tag)
    assert sum(m for _, m in await store.spend_series(bid, hour, hour + 2)) == (
        total.committed_micros)


@pytest.mark.parametrize("how", ["sidecar", "gateway", "expiry", "journal"])
async def test_a_call_is_counted_in_the_hour_it_was_reserved(
    store: LedgerStore, tag: str, clock: ManualClock, how: str
) -> None:
    """Its periods are the ones its reservation held; its hour too, whenever it settles (and
    a settle needs no clock for it). A journal's entry counts in the hour it was admitted."""
    bid = await put(store, tag, (Period.TOTAL, 10**9))
    clock.advance(SPEND_BUCKET_MS - clock.now_ms % SPEND_BUCKET_MS - 1_000)
    hour = clock.now_ms // SPEND_BUCKET_MS
    req = request(tag, tag, 300, retention_ms=RESEND_WINDOW_MS if how == "gateway"
                  else IDEMPOTENCY_WINDOW_MS, fingerprint="" if how == "gateway" else "fp")
    if how == "journal":
        admitted_at_ms = clock.now_ms
        clock.advance(2_000)
        assert await store.book(req, 300, admitted_at_ms)
    else:
        r = await store.reserve(req)
        clock.advance(TTL_MS if how == "expiry" else 2_000)
        assert clock.now_ms // SPEND_BUCKET_MS == hour + 1
        if how == "expiry":
            assert await store.expire(tag, 10) == 1
        else:
            await store.settle(ReservationRef(tag, r.reservation_id, OWNER), 300)
    assert await store.spend_series(bid, hour - 1, hour + 2) == [(hour, 300)]


async def test_the_outbox_leases_retries_and_records_delivery(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    await put(store, tag, (Period.TOTAL, 100), alerts=AlertConfig(thresholds_pct=(50,)))
    await spend(store, tag, tag, 60)
    assert tag in await store.alert_tags()
    [event] = await store.claim_alerts(tag, 10, 1_000)
    assert event.type == THRESHOLD_CROSSED
    assert event.state == "pending"
    assert await store.claim_alerts(tag, 10, 1_000) == []  # held by the first taker
    clock.advance(1_000)
    [again] = await store.claim_alerts(tag, 10, 1_000)  # the taker died: taken again
    assert again.event_id == event.event_id
    await store.finish_alert(again, "retry", 1, clock.now_ms + 5_000, "HTTP 500")
    clock.advance(4_999)
    assert await store.claim_alerts(tag, 10, 1_000) == []
    clock.advance(1)
    [third] = await store.claim_alerts(tag, 10, 1_000)
    assert (third.attempts, third.last_error) == (1, "HTTP 500")
    await store.finish_alert(third, "delivered", 2, 0, "")
    await store.finish_alert(third, "delivered", 2, 0, "")  # a resend records it once
    clock.advance(10**6)
    assert await store.claim_alerts(tag, 10, 1_000) == []
    [logged] = await store.alert_log(tag, 10)
    assert (logged.state, logged.attempts, logged.done_ms) == (
        "delivered", 2, clock.now_ms - 10**6)
    # Gone a retention after delivery, from the log as well.
    clock.advance(ALERT_RETENTION_MS)
    assert await store.alert_log(tag, 10) == []


async def test_every_key_alerts_make_expires(
    store: LedgerStore, tag: str, clock: ManualClock, store_kind: str,
    request: pytest.FixtureRequest,
) -> None:
    if store_kind not in ("redis",):
        pytest.skip("reads the keys of one Redis server")
    from redis.asyncio import Redis

    alarm = VelocityAlarm(window_s=60, max_micros=10)
    await put(store, tag, (Period.DAY, 100),
              alerts=AlertConfig(thresholds_pct=(50,), velocity=alarm))
    await spend(store, tag, tag, 60)
    with pytest.raises(BudgetExceeded):
        await store.reserve(reserve_request(tag, tag, 50))
    [event] = await store.claim_alerts(tag, 1, 1_000) or [None]
    assert event is not None
    raw = Redis.from_url(request.getfixturevalue("redis_server").url, decode_responses=True)
    made = [k async for k in raw.scan_iter(match=keys.prefix(tag) + "*")]
    kinds = (keys.ALERT, keys.OUTBOX, keys.ALERT_LOG, keys.SPEND, keys.VELOCITY,
             keys.VELOCITY_MARK, keys.COUNTER)
    alert_keys = [k for k in made if k.removeprefix(keys.prefix(tag)).startswith(kinds)]
    assert {k.removeprefix(keys.prefix(tag)).split(":")[0] for k in alert_keys} >= {
        "ev", "outbox", "alerts", "h", "v", "vm", "p"}
    windows = keys.prefix(tag) + keys.WINDOWS
    for k in alert_keys:
        # A counter holds spend, and carries no expiry an evicting Redis could act on: it goes
        # by the sweep, listed in its tag's windows index.
        assert await raw.pttl(k) > 0 or (k.removeprefix(keys.prefix(tag)).startswith(
            keys.COUNTER) and await raw.zscore(windows, k.removeprefix(keys.prefix(tag)))), k
    await raw.aclose()


# -- exactly once across processes, against a real server --------------------------------------

PROCESSES = 4
SETTLES_PER_PROCESS = 125
CEILING_MICROS = 100_000


async def _settle_many(build: Callable[[], LedgerStore], tag: str, n: int,
                       ready: threading.Barrier) -> int:
    store = build()
    await store.open()
    await asyncio.to_thread(ready.wait, 120.0)

    async def one(i: int) -> int:
        gateway = i % 2 == 0
        req = (request(tag, tag, 200, fingerprint="", retention_ms=RESEND_WINDOW_MS) if gateway
               else request(tag, tag, 200, retention_ms=IDEMPOTENCY_WINDOW_MS))
        r = await store.reserve(req)
        await store.settle(ReservationRef(tag, r.reservation_id, OWNER), 200)
        return 200

    booked = sum(await asyncio.gather(*(one(i) for i in range(n))))
    await store.close()
    return booked


def _child(build: Callable[[], LedgerStore], tag: str, n: int, ready: threading.Barrier) -> int:
    return asyncio.run(_settle_many(build, tag, n, ready))


@pytest.mark.slow
async def test_each_threshold_fires_once_under_concurrent_settles_from_processes(
    request: pytest.FixtureRequest, shared_store_kind: str, tag: str
) -> None:
    build = SHARED_STORE_BUILDERS[shared_store_kind](request)
    store = build()
    thresholds = tuple(range(10, 101, 10))
    await put(store, tag, (Period.DAY, CEILING_MICROS), (Period.TOTAL, CEILING_MICROS * 10),
              alerts=AlertConfig(thresholds_pct=thresholds))
    ctx = process_context()
    with ctx.Manager() as manager, ProcessPoolExecutor(PROCESSES, mp_context=ctx) as pool:
        ready = manager.Barrier(PROCESSES)
        futures = [asyncio.wrap_future(pool.submit(_child, build, tag, SETTLES_PER_PROCESS,
                                                   ready)) for _ in range(PROCESSES)]
        booked = sum(await asyncio.gather(*futures))
    # Exactly the day's ceiling (every reserve fits): the day's 100% and the total's 10%.
    assert booked == PROCESSES * SETTLES_PER_PROCESS * 200 == CEILING_MICROS
    assert (await leg(store, tag)).committed_micros == booked
    crossed = await events(store, tag, THRESHOLD_CROSSED)
    day = (await leg(store, tag, Period.DAY)).window_key
    got = sorted((e.period_key, e.threshold_pct or 0) for e in crossed)
    assert got == sorted([(day, p) for p in thresholds] + [("total", 10)])
    # Each at the settle that reached it: exactly the threshold, as every settle is 200.
    assert all(e.committed_micros == CEILING_MICROS * (e.threshold_pct or 0) // 100
               for e in crossed if e.period_key == day)
    await store.close()
