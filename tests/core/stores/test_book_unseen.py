"""Booking a provider's unseen spend into a budget (lua/book_unseen.lua), against every store: once
per provider and day however many book it at once, only what is new on a later run, never less
than nothing, into every budget on the path as committed spend a reserve then refuses by, with
one `ledger.unseen_booked` event per amount reached."""

from __future__ import annotations

import asyncio
import secrets
from datetime import date, timedelta

import pytest

from core.alerts import UNSEEN_BOOKED, AlertConfig, VelocityAlarm
from core.budgets import BudgetDef, BudgetId, Limit, ModelLimits, Period
from core.errors import BudgetExceeded, BudgetNotFound, CeilingError
from core.ledger import LedgerStore, LegStatus, Upstream
from core.limits import DAILY_SPEND_RETENTION_MS, DAY_MS, INT_EXACT_MAX
from core.stores import keys
from tests.core.stores.test_conformance import request
from tests.support import ManualClock


def a_day() -> date:
    """A day of its own: what is booked is per provider and day, ledger-wide. Not today (the
    clock's): a day in no current window but total."""
    return date(2030, 1, 1) + timedelta(days=secrets.randbelow(10**6))


@pytest.fixture
def clock(clock: ManualClock) -> ManualClock:
    """Today a day of its own too, at 01:00 UTC."""
    clock.now_ms = (20_000 + secrets.randbelow(10**6)) * DAY_MS + 3_600_000
    return clock


def today(clock: ManualClock) -> date:
    return date(1970, 1, 1) + timedelta(days=clock.now_ms // DAY_MS)


async def legs(store: LedgerStore, path: str) -> dict[tuple[str, str], LegStatus]:
    found = await store.status(BudgetId(path).lineage)
    return {(leg.budget_id, leg.period.value): leg for leg in found}


async def put_team(store: LedgerStore, tag: str) -> str:
    """An organisation limited in total, and a team under it limited by the day and in total."""
    team = f"{tag}/team:t"
    await store.put_budget(BudgetDef(BudgetId(tag), (Limit(Period.TOTAL, 50_000_000),)))
    await store.put_budget(BudgetDef(BudgetId(team), (Limit(Period.DAY, 3_000_000),
                                                      Limit(Period.TOTAL, 10_000_000))))
    return team


def committed(found: dict[tuple[str, str], LegStatus]) -> dict[tuple[str, str], int]:
    return {k: leg.committed_micros for k, leg in found.items()}


async def test_unseen_spend_is_booked_once_then_only_what_is_new(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    team = await put_team(store, tag)
    day = today(clock)
    done = await store.book_unseen(BudgetId(team), Upstream.OPENAI, day, 1_250_000)
    assert (done.booked_now_micros, done.booked_micros) == (1_250_000, 1_250_000)
    # Every budget on the path, every window it limits, as a settle would charge; all overshoot,
    # as nothing was held for it.
    found = await legs(store, team)
    assert committed(found) == {(tag, "total"): 1_250_000, (team, "day"): 1_250_000,
                                (team, "total"): 1_250_000}
    assert all(leg.overshoot_micros == 1_250_000 for leg in found.values())
    # Again: nothing new. A later, larger report: only the difference.
    again = await store.book_unseen(BudgetId(team), Upstream.OPENAI, day, 1_250_000)
    assert (again.booked_now_micros, again.booked_micros) == (0, 1_250_000)
    more = await store.book_unseen(BudgetId(team), Upstream.OPENAI, day, 2_000_001)
    assert (more.booked_now_micros, more.booked_micros) == (750_001, 2_000_001)
    # A smaller amount (a late settle made the ledger see more) lowers nothing.
    less = await store.book_unseen(BudgetId(team), Upstream.OPENAI, day, 10)
    assert (less.booked_now_micros, less.booked_micros) == (0, 2_000_001)
    assert set(committed(await legs(store, team)).values()) == {2_000_001}
    # The other provider's day is its own.
    other = await store.book_unseen(BudgetId(team), Upstream.ANTHROPIC, day, 5)
    assert other.booked_now_micros == 5
    assert await store.unseen_booked_by_day(Upstream.OPENAI, day, day) == {day: 2_000_001}
    assert await store.unseen_booked_by_day(Upstream.ANTHROPIC, day - timedelta(days=1), day) == {
        day: 5}
    events = [e for e in await store.alert_log(tag, 1_000) if e.type == UNSEEN_BOOKED]
    assert sorted((e.provider, e.day, e.booked_micros, e.budget_id) for e in events) == sorted([
        ("openai", day.isoformat(), 1_250_000, team), ("openai", day.isoformat(), 750_001, team),
        ("anthropic", day.isoformat(), 5, team)])
    assert {e.body()["booked_micros"] for e in events} == {1_250_000, 750_001, 5}


async def test_two_at_once_book_a_day_once(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    team = await put_team(store, tag)
    day = today(clock)
    done = await asyncio.gather(*(
        store.book_unseen(BudgetId(team), Upstream.ANTHROPIC, day, 900_000) for _ in range(8)))
    assert sorted(d.booked_now_micros for d in done) == [0] * 7 + [900_000]
    assert set(committed(await legs(store, team)).values()) == {900_000}


async def test_booked_spend_refuses_the_next_call_that_no_longer_fits(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    team = await put_team(store, tag)
    await store.book_unseen(BudgetId(team), Upstream.OPENAI, today(clock), 2_999_000)
    with pytest.raises(BudgetExceeded):
        await store.reserve(request(tag, team, 1_001))
    await store.reserve(request(tag, team, 1_000))


async def test_a_budget_that_does_not_exist_books_nothing(store: LedgerStore, tag: str) -> None:
    await put_team(store, tag)
    day = a_day()
    for missing in (f"{tag}/team:nobody", "org:nobody-at-all"):
        with pytest.raises(BudgetNotFound):
            await store.book_unseen(BudgetId(missing), Upstream.OPENAI, day, 1_000)
    # The ancestor of the missing team was not charged, and no day was marked booked.
    assert committed(await legs(store, tag)) == {(tag, "total"): 0}
    assert await store.unseen_booked_by_day(Upstream.OPENAI, day, day) == {}


async def test_nothing_unseen_books_nothing(store: LedgerStore, tag: str) -> None:
    team = await put_team(store, tag)
    day = a_day()
    done = await store.book_unseen(BudgetId(team), Upstream.OPENAI, day, 0)
    assert (done.booked_now_micros, done.booked_micros) == (0, 0)
    assert set(committed(await legs(store, team)).values()) <= {0}
    assert [e for e in await store.alert_log(tag, 1_000) if e.type == UNSEEN_BOOKED] == []


async def test_the_mark_is_kept_as_long_as_a_day_of_spend(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    team = await put_team(store, tag)
    day = a_day()
    await store.book_unseen(BudgetId(team), Upstream.OPENAI, day, 7)
    left_ms = await store._t.execute(  # type: ignore[attr-defined]
        "PTTL", keys.unseen_booked(tag, "openai", day.isoformat()))
    assert DAILY_SPEND_RETENTION_MS - 60_000 < int(left_ms) <= DAILY_SPEND_RETENTION_MS


async def test_a_booking_that_would_pass_what_a_counter_holds_exactly_books_nothing(
    store: LedgerStore, tag: str
) -> None:
    team = await put_team(store, tag)
    await store.book_unseen(BudgetId(team), Upstream.OPENAI, a_day(), INT_EXACT_MAX - 10)
    before = await legs(store, team)
    day = a_day()
    with pytest.raises(CeilingError):
        await store.book_unseen(BudgetId(team), Upstream.OPENAI, day, 11)
    assert await legs(store, team) == before
    assert await store.unseen_booked_by_day(Upstream.OPENAI, day, day) == {}


async def test_a_booking_is_no_velocity_and_pauses_nothing(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    """A past day's spend is not this hour's: a budget whose velocity alarm pauses it above
    $1 in five minutes is booked $10 and takes the next call."""
    alarm = VelocityAlarm(window_s=300, max_micros=1_000_000, pause=True)
    await store.put_budget(BudgetDef(BudgetId(tag), (Limit(Period.TOTAL, 50_000_000),),
                                     alerts=AlertConfig(thresholds_pct=(), velocity=alarm)))
    for day in (today(clock), today(clock) - timedelta(days=1)):
        done = await store.book_unseen(BudgetId(tag), Upstream.OPENAI, day, 10_000_000)
        assert done.booked_now_micros == 10_000_000
    await store.reserve(request(tag, tag, 1_000))  # not budget_paused
    assert [e for e in await store.alert_log(tag, 1_000) if e.type == "budget.velocity"] == []


async def test_a_day_is_booked_only_into_the_current_windows_that_hold_it(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    """Today: every window. Yesterday, in this month and week (the clock's today is chosen so):
    not today's window. A day of an earlier month: total alone."""
    # A Wednesday the 15th: yesterday is in the same week and month.
    while (now := today(clock)).weekday() != 2 or now.day != 15:
        clock.advance(DAY_MS)
    team = f"{tag}/team:t"
    await store.put_budget(BudgetDef(BudgetId(tag), (Limit(Period.TOTAL, 50_000_000),)))
    await store.put_budget(BudgetDef(BudgetId(team), tuple(
        Limit(p, 40_000_000) for p in (Period.DAY, Period.WEEK, Period.MONTH, Period.TOTAL))))
    await store.book_unseen(BudgetId(team), Upstream.OPENAI, now, 1)
    await store.book_unseen(BudgetId(team), Upstream.OPENAI, now - timedelta(days=1), 20)
    await store.book_unseen(BudgetId(team), Upstream.OPENAI, now - timedelta(days=40), 300)
    assert committed(await legs(store, team)) == {
        (tag, "total"): 321, (team, "day"): 1, (team, "week"): 21, (team, "month"): 21,
        (team, "total"): 321}


async def test_a_day_the_named_budget_has_no_window_for_is_not_marked_booked(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    """A team limited by the day alone cannot hold another day's spend: nothing is booked
    (its organisation's total neither), and the day is not marked, so the booking is not lost:
    once the team has a total, the same day books in full."""
    team = f"{tag}/team:t"
    await store.put_budget(BudgetDef(BudgetId(tag), (Limit(Period.TOTAL, 50_000_000),)))
    await store.put_budget(BudgetDef(BudgetId(team), (Limit(Period.DAY, 40_000_000),)))
    day = a_day()
    await store.book_unseen(BudgetId(team), Upstream.OPENAI, day, 700)
    assert committed(await legs(store, team)) == {(tag, "total"): 0, (team, "day"): 0}
    await store.put_budget(BudgetDef(BudgetId(team), (Limit(Period.DAY, 40_000_000),
                                                      Limit(Period.TOTAL, 40_000_000))))
    await store.book_unseen(BudgetId(team), Upstream.OPENAI, day, 700)
    assert committed(await legs(store, team)) == {
        (tag, "total"): 700, (team, "day"): 0, (team, "total"): 700}


async def test_a_budget_with_models_is_booked_as_any_other(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    """A bill names no model: the budget is booked, no model's counter is."""
    await store.put_budget(BudgetDef(
        BudgetId(tag), (Limit(Period.TOTAL, 50_000_000),), models_allow=("gpt-4o",),
        per_model=(ModelLimits("gpt-4o", (Limit(Period.TOTAL, 1_000),)),)))
    done = await store.book_unseen(BudgetId(tag), Upstream.OPENAI, today(clock), 5_000)
    assert done.booked_now_micros == 5_000
    assert committed(await legs(store, tag)) == {(tag, "total"): 5_000}
