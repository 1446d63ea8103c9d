"""Booking unseen spend through reconciliation (core/reconcile.py `Booking`), against every store:
the attacks first (a report that cannot be read whole, a drift below zero or within the
tolerance, a budget that does not exist or is not an operator's, two runs at once), then what is
booked in each order of booking and settling.

The reports are written by hand in each provider's documented shape (tests/core/test_reconcile.py
says how); the stub's are read end to end in tests/api/test_reconcile_book.py."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import replace
from datetime import date, timedelta
from decimal import Decimal
from typing import Any

import pytest

from core.alerts import UNSEEN_BOOKED
from core.budgets import BudgetDef, BudgetId, Limit, Period
from core.config import ConfigError
from core.errors import BudgetNotFound, CostReportFailed, InvalidRequest
from core.ledger import LedgerStore, ReservationRef, Upstream
from core.limits import DAY_MS
from core.reconcile import (
    BOOK_INTO_SETTING,
    Booking,
    ReportSource,
    book_into_of,
    reconcile,
    scheduled_book_into,
)
from core.stores.operations import ScriptedCatalogue
from tests.core.stores.test_conformance import OWNER, request
from tests.core.test_reconcile import Pages, anthropic_bucket, page
from tests.support import ManualClock

SOURCES = {
    Upstream.OPENAI: ReportSource(Upstream.OPENAI, "https://openai.test", "sk-admin"),
    Upstream.ANTHROPIC: ReportSource(Upstream.ANTHROPIC, "https://anthropic.test",
                                     "sk-ant-admin"),
}
TOLERANCE_PCT = Decimal(1)


@pytest.fixture
def clock(clock: ManualClock) -> ManualClock:
    """A day of its own in the years to come: the ledger's days and what is booked for them are
    the whole ledger's, shared by every test on one Redis."""
    clock.now_ms = (int(time.time() * 1000) // DAY_MS + 1 + secrets.randbelow(30_000)) * DAY_MS
    clock.now_ms += 3_600_000
    return clock


def today(clock: ManualClock) -> date:
    return date(1970, 1, 1) + timedelta(days=clock.now_ms // DAY_MS)


def report(provider: Upstream, day: date, micros: int, **kw: Any) -> bytes:
    """One day's bill in the provider's own unit: OpenAI's dollars, Anthropic's cents."""
    if provider is Upstream.OPENAI:
        start = (day - date(1970, 1, 1)).days * 86_400
        return page([{"object": "bucket", "start_time": start, "end_time": start + 86_400,
                      "results": [{"amount": {"value": micros / 1_000_000,
                                              "currency": kw.get("currency", "usd")}}]}])
    return page([anthropic_bucket(day, str(Decimal(micros) / 10_000),
                                  currency=kw.get("currency", "USD"))])


async def audited(store: LedgerStore, budget_id: BudgetId) -> list[dict[str, Any]]:
    """The audit stream's bookings into `budget_id`, oldest first: (who, detail)."""
    found = await ScriptedCatalogue(store).audit_read(None, 1_000)  # type: ignore[arg-type]
    return [{"who": f["who"], **json.loads(f["detail"])} for _, f in reversed(found)
            if f["what"] == UNSEEN_BOOKED and f["target"] == budget_id.path]


async def team_of(store: LedgerStore, tag: str) -> BudgetId:
    team = BudgetId(f"{tag}/team:t")
    await store.put_budget(BudgetDef(BudgetId(tag), (Limit(Period.TOTAL, 50_000_000),)))
    await store.put_budget(BudgetDef(team, (Limit(Period.DAY, 9_000_000),
                                            Limit(Period.TOTAL, 20_000_000))))
    return team


async def committed(store: LedgerStore, budget_id: BudgetId) -> dict[tuple[str, str], int]:
    return {(leg.budget_id, leg.period.value): leg.committed_micros
            for leg in await store.status(budget_id.lineage)}


async def settle_call(store: LedgerStore, tag: str, path: str, actual: int,
                      upstream: Upstream) -> None:
    r = await store.reserve(request(tag, path, actual, fingerprint=""))
    await store.settle(ReservationRef(tag, r.reservation_id, OWNER), actual, upstream)


async def run(store: LedgerStore, clock: ManualClock, provider: Upstream, body: bytes,
              team: BudgetId | None, status: int = 200,
              tolerance_pct: Decimal = TOLERANCE_PCT) -> Any:
    day = today(clock).isoformat()
    booking = None if team is None else Booking(team, "op:test")
    return await reconcile(store, SOURCES[provider], day, day, tolerance_pct,
                           Pages((status, body)), booking)


# -- attacks --------------------------------------------------------------------------------------


@pytest.mark.parametrize("provider", [Upstream.OPENAI, Upstream.ANTHROPIC])
async def test_a_report_that_cannot_be_read_whole_books_nothing(
    store: LedgerStore, tag: str, clock: ManualClock, provider: Upstream
) -> None:
    team = await team_of(store, tag)
    day = today(clock)
    before = await committed(store, team)
    good = report(provider, day, 5_000_000)
    broken = [
        Pages((500, b'{"error": {"message": "down"}}')),
        Pages((200, report(provider, day, 5_000_000, currency="eur"))),
        Pages((200, good[: len(good) // 2])),  # cut short
        Pages((200, b'{"data": "no", "has_more": false}')),
        # A first page of spend, then the second fails: the first is not booked alone.
        Pages((200, good.replace(b'"has_more": false, "next_page": null',
                                 b'"has_more": true, "next_page": "p2"')), (502, b"bad gateway")),
    ]
    for fetch in broken:
        with pytest.raises(CostReportFailed):
            await reconcile(store, SOURCES[provider], day.isoformat(),
                            day.isoformat(), TOLERANCE_PCT, fetch, Booking(team, "op:test"))
    assert await committed(store, team) == before
    assert await store.unseen_booked_by_day(provider, day, day) == {}


async def test_a_drift_below_zero_or_within_the_tolerance_books_nothing(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    team = await team_of(store, tag)
    day = today(clock)
    await settle_call(store, tag, team.path, 1_000_000, Upstream.OPENAI)
    before = await committed(store, team)
    # The provider billed less than the ledger saw: nothing is given back, nothing booked.
    below = await run(store, clock, Upstream.OPENAI, report(Upstream.OPENAI, day, 400_000), team)
    assert below.days[0].within is False
    assert below.days[0].drift_micros == -600_000
    assert below.booked_now_micros == 0
    # 0.5% more than the ledger saw, at a tolerance of 1%: the two sides agree.
    close = await run(store, clock, Upstream.OPENAI, report(Upstream.OPENAI, day, 1_005_000),
                      team)
    assert close.days[0].within is True
    assert close.booked_now_micros == 0
    assert await committed(store, team) == before
    assert await store.unseen_booked_by_day(Upstream.OPENAI, day, day) == {}


async def test_a_budget_that_does_not_exist_is_refused_before_the_report_is_read(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    await team_of(store, tag)
    fetch = Pages((200, report(Upstream.OPENAI, today(clock), 5_000_000)))
    day = today(clock).isoformat()
    with pytest.raises(BudgetNotFound) as caught:
        await reconcile(store, SOURCES[Upstream.OPENAI], day, day,
                        TOLERANCE_PCT, fetch, Booking(BudgetId(f"{tag}/team:nobody"), "op"))
    assert caught.value.details["field"] == "book_into"
    assert fetch.queries == []
    assert await store.unseen_booked_by_day(Upstream.OPENAI, today(clock), today(clock)) == {}


@pytest.mark.parametrize("text", [
    "org:a/run:batch", "org:a/user:bob", "run:x", "org:a/team:b/user:c", "not a budget", "org:a//b",
])
def test_a_budget_id_an_operator_cannot_name_is_refused(text: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        book_into_of(text)
    assert caught.value.details["field"] == "book_into"
    with pytest.raises(ConfigError) as config:
        scheduled_book_into({BOOK_INTO_SETTING: text})
    assert BOOK_INTO_SETTING in config.value.message


def test_no_budget_named_books_nowhere() -> None:
    assert book_into_of(None) is None
    assert book_into_of("") is None
    assert scheduled_book_into({}) is None
    assert scheduled_book_into({BOOK_INTO_SETTING: " "}) is None
    assert scheduled_book_into({BOOK_INTO_SETTING: "org:a/team:b"}) == BudgetId("org:a/team:b")


async def test_two_runs_at_once_book_a_day_once(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    team = await team_of(store, tag)
    body = report(Upstream.ANTHROPIC, today(clock), 3_000_000)
    done = await asyncio.gather(*(run(store, clock, Upstream.ANTHROPIC, body, team)
                                  for _ in range(6)))
    assert sorted(d.booked_now_micros for d in done) == [0] * 5 + [3_000_000]
    assert set((await committed(store, team)).values()) == {3_000_000}
    assert len(await audited(store, team)) == 1


# -- what is booked -------------------------------------------------------------------------------


@pytest.mark.parametrize("provider", [Upstream.OPENAI, Upstream.ANTHROPIC])
async def test_settled_then_booked_books_the_unseen_once_then_only_the_difference(
    store: LedgerStore, tag: str, clock: ManualClock, provider: Upstream
) -> None:
    team = await team_of(store, tag)
    day = today(clock)
    await settle_call(store, tag, team.path, 1_000_000, provider)
    first = await run(store, clock, provider, report(provider, day, 3_000_000), team)
    d = first.days[0]
    assert (d.ledger_micros, d.provider_micros, d.booked_now_micros, d.booked_micros) == (
        1_000_000, 3_000_000, 2_000_000, 2_000_000)
    assert set((await committed(store, team)).values()) == {3_000_000}
    # Booked spend is not what the ledger saw: the drift still shows, and nothing more is booked.
    again = await run(store, clock, provider, report(provider, day, 3_000_000), team)
    assert (again.days[0].ledger_micros, again.days[0].within) == (1_000_000, False)
    assert (again.days[0].booked_now_micros, again.days[0].booked_micros) == (0, 2_000_000)
    # A later report with more spend on the day: only the difference.
    later = await run(store, clock, provider, report(provider, day, 3_500_000), team)
    assert (later.days[0].booked_now_micros, later.days[0].booked_micros) == (500_000, 2_500_000)
    assert set((await committed(store, team)).values()) == {3_500_000}
    assert [(e["who"], e["booked_micros"], e["day"]) for e in await audited(store, team)] == [
        ("op:test", 2_000_000, day.isoformat()), ("op:test", 500_000, day.isoformat())]
    assert later.json()["book_into"] == team.path
    assert later.json()["days"][0]["booked_micros"] == 2_500_000
    assert any("booked into" in line for line in later.lines())
    events = [e for e in await store.alert_log(tag, 1_000) if e.type == UNSEEN_BOOKED]
    assert sorted(e.booked_micros or 0 for e in events) == [500_000, 2_000_000]


async def test_booked_then_settled_late_books_nothing_more_and_lowers_nothing(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    team = await team_of(store, tag)
    day = today(clock)
    body = report(Upstream.OPENAI, day, 3_000_000)
    first = await run(store, clock, Upstream.OPENAI, body, team)
    assert first.days[0].booked_now_micros == 3_000_000
    # A call of the day whose settle came after the booking: the ledger now saw it too.
    await settle_call(store, tag, team.path, 1_000_000, Upstream.OPENAI)
    assert set((await committed(store, team)).values()) == {4_000_000}
    later = await run(store, clock, Upstream.OPENAI, body, team)
    d = later.days[0]
    assert (d.ledger_micros, d.drift_micros, d.booked_now_micros, d.booked_micros) == (
        1_000_000, 2_000_000, 0, 3_000_000)
    assert set((await committed(store, team)).values()) == {4_000_000}


async def test_without_book_into_nothing_is_booked_and_the_answer_is_as_before(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    team = await team_of(store, tag)
    done = await run(store, clock, Upstream.OPENAI,
                     report(Upstream.OPENAI, today(clock), 3_000_000), None)
    assert done.book_into is None
    assert "book_into" not in done.json()
    assert set(done.json()["days"][0]) == {"day", "ledger_micros", "provider_micros",
                                           "drift_micros", "drift_pct", "within"}
    assert set((await committed(store, team)).values()) == {0}


# -- spend the ledger counted that no gateway call settled ----------------------------------------


@pytest.mark.parametrize("provider", [Upstream.OPENAI, Upstream.ANTHROPIC])
async def test_a_sidecar_settle_priced_on_the_providers_bill_is_not_booked_again(
    store: LedgerStore, tag: str, clock: ManualClock, provider: Upstream
) -> None:
    """The reviewer's probe: $1.00 reserved and settled through the sidecar (its bill recorded
    at reserve, its settle naming no upstream), $1.00 on the report: nothing unseen."""
    team = await team_of(store, tag)
    r = await store.reserve(replace(request(tag, team.path, 1_000_000, fingerprint=""),
                                    bill=provider))
    await store.settle(ReservationRef(tag, r.reservation_id, OWNER), 1_000_000)
    done = await run(store, clock, provider, report(provider, today(clock), 1_000_000), team)
    d = done.days[0]
    assert (d.ledger_micros, d.within, d.booked_now_micros) == (1_000_000, True, 0)
    assert set((await committed(store, team)).values()) == {1_000_000}


@pytest.mark.parametrize("provider", [Upstream.OPENAI, Upstream.ANTHROPIC])
async def test_unattributed_spend_is_taken_off_every_providers_unseen(
    store: LedgerStore, tag: str, clock: ManualClock, provider: Upstream
) -> None:
    """A sidecar reservation of an amount names no provider: its $0.60 may be on this bill, so
    of a $1.00 report only $0.40 is booked; the report shows the figure."""
    team = await team_of(store, tag)
    r = await store.reserve(replace(request(tag, team.path, 600_000, fingerprint=""),
                                    bill=Upstream.UNATTRIBUTED))
    await store.settle(ReservationRef(tag, r.reservation_id, OWNER), 600_000)
    done = await run(store, clock, provider, report(provider, today(clock), 1_000_000), team)
    d = done.days[0]
    assert (d.ledger_micros, d.unattributed_micros, d.booked_now_micros) == (0, 600_000, 400_000)
    assert done.json()["days"][0]["unattributed_micros"] == 600_000
    assert set((await committed(store, team)).values()) == {1_000_000}


# -- across organisations, and the audit ----------------------------------------------------------


async def two_organisations(store: LedgerStore, tag: str) -> tuple[BudgetId, BudgetId]:
    other = BudgetId(tag + "x")
    await store.put_budget(BudgetDef(other, (Limit(Period.TOTAL, 50_000_000),)))
    return await team_of(store, tag), other


async def test_a_day_booked_into_one_organisation_is_not_booked_again_into_another(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    team, other = await two_organisations(store, tag)
    body = report(Upstream.OPENAI, today(clock), 1_000_000)
    first = await run(store, clock, Upstream.OPENAI, body, team)
    then = await run(store, clock, Upstream.OPENAI, body, other)
    assert (first.booked_now_micros, then.booked_now_micros) == (1_000_000, 0)
    assert then.days[0].booked_micros == 1_000_000  # booked, if elsewhere
    more = await run(store, clock, Upstream.OPENAI,
                     report(Upstream.OPENAI, today(clock), 1_250_000), other)
    assert more.booked_now_micros == 250_000
    assert set((await committed(store, other)).values()) == {250_000}


async def test_two_runs_at_once_into_two_organisations_book_a_day_once(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    team, other = await two_organisations(store, tag)
    body = report(Upstream.ANTHROPIC, today(clock), 2_000_000)
    done = await asyncio.gather(*(run(store, clock, Upstream.ANTHROPIC, body, into)
                                  for into in (team, other, team, other)))
    assert sorted(d.booked_now_micros for d in done) == [0, 0, 0, 2_000_000]
    team_total = (await committed(store, team))[(team.path, "total")]
    other_total = (await committed(store, other))[(other.path, "total")]
    assert team_total + other_total == 2_000_000


async def test_a_booking_whose_run_died_before_its_audit_is_audited_by_the_next_run(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    team = await team_of(store, tag)
    day = today(clock)
    # The booking step of a run that died before its audit entry.
    await store.book_unseen(team, Upstream.OPENAI, day, 700_000)
    assert await audited(store, team) == []
    body = report(Upstream.OPENAI, day, 700_000)
    again = await run(store, clock, Upstream.OPENAI, body, team)
    assert again.booked_now_micros == 0
    entries = await audited(store, team)
    assert [(e["booked_micros"], e["booked_total_micros"]) for e in entries] == [
        (700_000, 700_000)]
    assert entries[0]["event_id"].startswith("evt_")
    # The event the booking wrote has the same id as its audit entry.
    events = [e for e in await store.alert_log(tag, 1_000) if e.type == UNSEEN_BOOKED]
    assert [e.event_id for e in events] == [entries[0]["event_id"]]
    # And once: more runs write no second entry.
    await asyncio.gather(*(run(store, clock, Upstream.OPENAI, body, team) for _ in range(3)))
    assert len(await audited(store, team)) == 1


async def test_a_run_that_finds_the_booking_lease_held_books_nothing_and_says_so(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    team = await team_of(store, tag)
    body = report(Upstream.OPENAI, today(clock), 1_000_000)
    assert await store.take_booking_lease(Upstream.OPENAI, "another-run", 60_000)
    try:
        held = await run(store, clock, Upstream.OPENAI, body, team)
    finally:
        await store.end_booking_lease(Upstream.OPENAI, "another-run")
    assert (held.booking_held, held.booked_now_micros, held.within) == (True, 0, False)
    assert held.json()["booking_held"] is True
    assert any("another run is booking" in line for line in held.lines())
    assert set((await committed(store, team)).values()) <= {0}
    # Given back, the next run books it.
    assert (await run(store, clock, Upstream.OPENAI, body, team)).booked_now_micros == 1_000_000
