"""Every charge that becomes committed counts in its bill's day (what reconcile compares with a
provider's report), whichever step makes it: a sidecar's settle, an expiry's charge, a late
settle's correction of it (up or down), an outage's booking. The bill is the reservation's,
recorded at reserve; a record without one counts on the settle's `upstream`."""

from __future__ import annotations

import secrets
from dataclasses import replace
from datetime import date

from core.budgets import BudgetDef, BudgetId, Limit, Period
from core.ledger import LedgerStore, ReservationRef, Upstream, day_of_index
from core.limits import DAY_MS
from core.stores import keys, wire
from tests.core.stores.test_conformance import TTL_MS, request
from tests.support import ManualClock


def own_day(clock: ManualClock) -> date:
    """A UTC day of the test's own (the day counters are ledger-wide), noon, on the clock."""
    index = 40_000 + secrets.randbelow(10**6)
    clock.now_ms = index * DAY_MS + DAY_MS // 2
    return day_of_index(index)


async def put(store: LedgerStore, tag: str) -> str:
    await store.put_budget(BudgetDef(BudgetId(tag), (Limit(Period.TOTAL, 50_000_000),)))
    return tag


async def seen(store: LedgerStore, bill: Upstream, day: date) -> int:
    return (await store.gateway_spend_by_day(bill, day, day)).get(day, 0)


async def test_a_sidecar_settle_counts_on_the_bill_its_reserve_recorded(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    day = own_day(clock)
    path = await put(store, tag)
    priced = await store.reserve(replace(request(tag, path, 2_000_000), bill=Upstream.OPENAI))
    amount = await store.reserve(replace(request(tag, path, 2_000_000),
                                         bill=Upstream.UNATTRIBUTED))
    # The sidecar's settle names no upstream: the record's bill is what counts.
    await store.settle(ReservationRef(tag, priced.reservation_id, "key_owner"), 1_000_000)
    await store.settle(ReservationRef(tag, amount.reservation_id, "key_owner"), 700_000)
    assert await seen(store, Upstream.OPENAI, day) == 1_000_000
    assert await seen(store, Upstream.UNATTRIBUTED, day) == 700_000
    assert await seen(store, Upstream.ANTHROPIC, day) == 0


async def test_an_expiry_charge_and_a_late_settle_correction_count_what_was_charged(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    day = own_day(clock)
    path = await put(store, tag)
    down = await store.reserve(replace(request(tag, path, 900_000), bill=Upstream.ANTHROPIC))
    up = await store.reserve(replace(request(tag, path, 100_000), bill=Upstream.ANTHROPIC))
    clock.advance(TTL_MS)
    assert await store.expire(tag, 100) == 2
    assert await seen(store, Upstream.ANTHROPIC, day) == 1_000_000  # both holds, charged
    # The late settles correct the charges, down and up: the day holds what the calls cost.
    await store.settle(ReservationRef(tag, down.reservation_id, "key_owner"), 300_000)
    await store.settle(ReservationRef(tag, up.reservation_id, "key_owner"), 250_000)
    assert await seen(store, Upstream.ANTHROPIC, day) == 550_000


async def test_an_outage_booking_counts_on_its_bill(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    day = own_day(clock)
    path = await put(store, tag)
    booked = replace(request(tag, path, 500_000), bill=Upstream.OPENAI)
    assert await store.book(booked, 420_000, clock.now_ms - 1_000)
    assert not await store.book(booked, 420_000, clock.now_ms - 1_000)  # a retried flush
    assert await seen(store, Upstream.OPENAI, day) == 420_000


async def test_a_record_kept_before_bills_counts_on_the_settles_upstream(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    day = own_day(clock)
    path = await put(store, tag)
    r = await store.reserve(request(tag, path, 400_000))  # no bill: as a record kept before
    await store.settle(ReservationRef(tag, r.reservation_id, "key_owner"), 300_000,
                       Upstream.ANTHROPIC)
    assert await seen(store, Upstream.ANTHROPIC, day) == 300_000


def test_a_record_without_its_bill_reads_with_none() -> None:
    fields = ["open", "5", "charge", "60000", "o", "", "1", "0", *[""] * 9, "fp", "v", "m"]
    old = wire.StoredRecord.unpacked(wire.SEPARATOR.join(fields))
    assert (old.model, old.bill) == ("m", "")
    new = wire.StoredRecord.unpacked(wire.SEPARATOR.join([*fields, "openai"]))
    assert (new.model, new.bill) == ("m", "openai")
    assert keys.daily_spend("t", "openai", 1).endswith("openai|1")
