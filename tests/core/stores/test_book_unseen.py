"""Booking a provider's unseen spend into a budget (lua/book_unseen.lua), against every store: once
per provider and day however many book it at once, only what is new on a later run, never less
than nothing, into every budget on the path as committed spend a reserve then refuses by, with
one `ledger.unseen_booked` event per amount reached."""

from __future__ import annotations

import asyncio
import secrets
from datetime import date, timedelta

import pytest

from core.alerts import UNSEEN_BOOKED
from core.budgets import BudgetDef, BudgetId, Limit, Period
from core.errors import BudgetExceeded, BudgetNotFound, CeilingError
from core.ledger import LedgerStore, LegStatus, Upstream
from core.limits import DAILY_SPEND_RETENTION_MS, INT_EXACT_MAX
from core.stores import keys
from tests.core.stores.test_conformance import request
from tests.support import ManualClock


def a_day() -> date:
    """A day of its own: what is booked is per provider and day, ledger-wide."""
    return date(2030, 1, 1) + timedelta(days=secrets.randbelow(10**6))


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
    store: LedgerStore, tag: str
) -> None:
    team = await put_team(store, tag)
    day = a_day()
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


async def test_two_at_once_book_a_day_once(store: LedgerStore, tag: str) -> None:
    team = await put_team(store, tag)
    day = a_day()
    done = await asyncio.gather(*(
        store.book_unseen(BudgetId(team), Upstream.ANTHROPIC, day, 900_000) for _ in range(8)))
    assert sorted(d.booked_now_micros for d in done) == [0] * 7 + [900_000]
    assert set(committed(await legs(store, team)).values()) == {900_000}


async def test_booked_spend_refuses_the_next_call_that_no_longer_fits(
    store: LedgerStore, tag: str
) -> None:
    team = await put_team(store, tag)
    await store.book_unseen(BudgetId(team), Upstream.OPENAI, a_day(), 2_999_000)
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


async def test_a_day_booked_into_another_organisation_is_not_booked_again(
    store: LedgerStore, tag: str
) -> None:
    team = await put_team(store, tag)
    other = tag + "x"
    await store.put_budget(BudgetDef(BudgetId(other), (Limit(Period.TOTAL, 10_000_000),)))
    day = a_day()
    await store.book_unseen(BudgetId(team), Upstream.OPENAI, day, 400)
    moved = await store.book_unseen(BudgetId(other), Upstream.OPENAI, day, 1_000)
    assert (moved.booked_now_micros, moved.booked_micros) == (600, 1_000)
    assert committed(await legs(store, other)) == {(other, "total"): 600}


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
