"""The definition of a ledger store: every store kind must pass every test here.

Amounts are read back from the ledger's own counters (status), never from the values the
operation returned, so a store cannot pass by reporting what the test expects.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from core import output_stats
from core.budgets import BudgetDef, BudgetId, Limit, Period
from core.errors import (
    BudgetBusy,
    BudgetExceeded,
    BudgetNotFound,
    IdempotencyConflict,
    InvariantBroken,
    ReservationNotFound,
    ReservationResolved,
)
from core.ledger import (
    GATEWAY_OWNER_PREFIX,
    Correction,
    ExpirePolicy,
    KeyRecord,
    LedgerStore,
    LegStatus,
    OpenHold,
    OpenLeases,
    Release,
    Reservation,
    ReservationRef,
    ReservationState,
    ReserveRequest,
    Role,
    RunLimit,
    Settlement,
    tag_digest,
)
from core.lifecycle import ABSENT, TRANSITIONS, Event, effects, step
from core.limits import (
    COUNTER_RETENTION_MS,
    IDEMPOTENCY_WINDOW_MS,
    REPLAY_WINDOW_MS,
    RESEND_WINDOW_MS,
    RESERVATION_TTL_MS_MAX,
    RUN_COUNTER_IDLE_MS,
)
from core.stores import keys
from tests.support import ManualClock

TTL_MS = 60_000
OWNER = "key_owner"


def request(
    tag: str,
    path: str,
    amount_micros: int,
    *,
    rid: str | None = None,
    fingerprint: str = "fp",
    ttl_ms: int = TTL_MS,
    policy: ExpirePolicy = ExpirePolicy.CHARGE,
    run: RunLimit | None = None,
    owner: str = OWNER,
    retention_ms: int = IDEMPOTENCY_WINDOW_MS,
) -> ReserveRequest:
    return ReserveRequest(
        ref=ReservationRef(tag, rid or uuid.uuid4().hex, owner),
        budget_ids=BudgetId(path).lineage,
        amount_micros=amount_micros,
        ttl_ms=ttl_ms,
        fingerprint=fingerprint,
        price_version="test-prices",
        model="test-model",
        expire_policy=policy,
        run=run,
        retention_ms=retention_ms,
    )


async def put(
    store: LedgerStore, path: str, *limits: tuple[Period, int], tz: str = "UTC", allow: int = 0
) -> BudgetId:
    bid = BudgetId.parse(path)
    await store.put_budget(BudgetDef(bid, tuple(Limit(p, c) for p, c in limits), tz, allow))
    return bid


async def leg(store: LedgerStore, path: str, period: Period = Period.TOTAL) -> LegStatus:
    legs = await store.status((BudgetId(path),))
    return next(x for x in legs if x.period is period)


async def test_put_and_get_budget_round_trip(store: LedgerStore, tag: str) -> None:
    bid = await put(store, tag, (Period.DAY, 5), (Period.TOTAL, 50), tz="Europe/Paris", allow=3)
    got = await store.get_budget(bid)
    assert got == BudgetDef(bid, (Limit(Period.DAY, 5), Limit(Period.TOTAL, 50)), "Europe/Paris", 3)
    assert await store.get_budget(BudgetId(f"{tag}/team:none")) is None


async def test_reserve_holds_in_every_budget_and_period_on_the_path(
    store: LedgerStore, tag: str
) -> None:
    await put(store, tag, (Period.DAY, 1_000), (Period.TOTAL, 5_000))
    await put(store, f"{tag}/team:a", (Period.MONTH, 300))
    r = await store.reserve(request(tag, f"{tag}/team:a/key:k", 100))
    assert r.reserved_micros == 100
    assert [(x.budget_id, x.period) for x in r.legs] == [
        (tag, Period.DAY), (tag, Period.TOTAL), (f"{tag}/team:a", Period.MONTH)
    ]
    assert (await leg(store, tag, Period.DAY)).reserved_micros == 100
    assert (await leg(store, tag)).reserved_micros == 100
    team = await leg(store, f"{tag}/team:a", Period.MONTH)
    assert (team.reserved_micros, team.remaining_micros) == (100, 200)


async def test_refusal_is_all_or_nothing(store: LedgerStore, tag: str) -> None:
    await put(store, tag, (Period.TOTAL, 1_000))
    await put(store, f"{tag}/team:a", (Period.TOTAL, 50))
    with pytest.raises(BudgetExceeded) as info:
        await store.reserve(request(tag, f"{tag}/team:a", 60))
    assert info.value.details["budget_id"] == f"{tag}/team:a"
    assert info.value.details["remaining_micros"] == 50
    assert (await leg(store, tag)).reserved_micros == 0
    assert (await leg(store, f"{tag}/team:a")).reserved_micros == 0


async def test_exceeded_and_busy_are_told_apart(store: LedgerStore, tag: str) -> None:
    await put(store, tag, (Period.DAY, 100))
    held = await store.reserve(request(tag, tag, 70))
    with pytest.raises(BudgetBusy) as busy:
        await store.reserve(request(tag, tag, 40))
    assert busy.value.details["retry_after_s"] >= 1
    await store.settle(ReservationRef(tag, held.reservation_id, OWNER), 70)
    with pytest.raises(BudgetExceeded) as exceeded:
        await store.reserve(request(tag, tag, 40))
    # A day budget names when it resets; the clock starts at noon UTC, so in 12 hours.
    assert exceeded.value.details["retry_after_s"] == 12 * 3600
    assert exceeded.value.details["period"] == "day"


async def test_total_budget_has_no_retry_after(store: LedgerStore, tag: str) -> None:
    await put(store, tag, (Period.TOTAL, 10))
    with pytest.raises(BudgetExceeded) as info:
        await store.reserve(request(tag, tag, 11))
    assert "retry_after_s" not in info.value.details


async def test_twenty_nickels_fit_a_dollar_and_the_twenty_first_does_not(
    store: LedgerStore, tag: str
) -> None:
    # Integer micro-dollars: in floats, twenty 0.05s sum to 1.0000000000000002 > 1.00.
    await put(store, tag, (Period.TOTAL, 1_000_000))
    held = [await store.reserve(request(tag, tag, 50_000)) for _ in range(20)]
    with pytest.raises(BudgetBusy):
        await store.reserve(request(tag, tag, 50_000))
    for r in held:
        await store.settle(ReservationRef(tag, r.reservation_id, OWNER), 50_000)
    with pytest.raises(BudgetExceeded):
        await store.reserve(request(tag, tag, 50_000))
    total = await leg(store, tag)
    assert (total.committed_micros, total.reserved_micros, total.remaining_micros) == (
        1_000_000, 0, 0
    )


@pytest.mark.parametrize(
    ("actual", "released", "overshoot"), [(30, 70, 0), (100, 0, 0), (130, 0, 30), (0, 100, 0)]
)
async def test_settle_books_the_actual_and_records_overshoot(
    store: LedgerStore, tag: str, actual: int, released: int, overshoot: int
) -> None:
    await put(store, tag, (Period.TOTAL, 1_000))
    r = await store.reserve(request(tag, tag, 100))
    s = await store.settle(ReservationRef(tag, r.reservation_id, OWNER), actual)
    assert (s.charged_micros, s.released_micros, s.overshoot_micros) == (
        actual, released, overshoot
    )
    total = await leg(store, tag)
    assert (total.committed_micros, total.reserved_micros, total.overshoot_micros) == (
        actual, 0, overshoot
    )


async def test_settle_replays_its_first_answer_and_refuses_another_amount(
    store: LedgerStore, tag: str
) -> None:
    await put(store, tag, (Period.TOTAL, 1_000))
    r = await store.reserve(request(tag, tag, 100))
    ref = ReservationRef(tag, r.reservation_id, OWNER)
    first = await store.settle(ref, 40)
    again = await store.settle(ref, 40)
    assert (again.charged_micros, again.released_micros, again.replayed) == (40, 60, True)
    assert not first.replayed
    with pytest.raises(IdempotencyConflict):
        await store.settle(ref, 41)
    assert (await leg(store, tag)).committed_micros == 40


async def test_reserve_replay_returns_the_first_answer_and_holds_once(
    store: LedgerStore, tag: str
) -> None:
    await put(store, tag, (Period.TOTAL, 1_000))
    rid = uuid.uuid4().hex
    first = await store.reserve(request(tag, tag, 100, rid=rid))
    again = await store.reserve(request(tag, tag, 100, rid=rid))
    assert (again.reservation_id, again.reserved_micros, again.expires_at_ms) == (
        first.reservation_id, 100, first.expires_at_ms
    )
    assert again.replayed
    assert not first.replayed
    assert (await leg(store, tag)).reserved_micros == 100
    with pytest.raises(IdempotencyConflict):
        await store.reserve(request(tag, tag, 100, rid=rid, fingerprint="other"))
    with pytest.raises(IdempotencyConflict):
        await store.reserve(request(tag, tag, 100, rid=rid, owner="key_other"))


async def test_release_returns_the_hold_once(store: LedgerStore, tag: str) -> None:
    await put(store, tag, (Period.TOTAL, 1_000))
    r = await store.reserve(request(tag, tag, 100))
    ref = ReservationRef(tag, r.reservation_id, OWNER)
    first = await store.release(ref)
    again = await store.release(ref)
    assert (first.released_micros, first.replayed) == (100, False)
    assert (again.released_micros, again.replayed) == (100, True)
    total = await leg(store, tag)
    assert (total.committed_micros, total.reserved_micros) == (0, 0)
    with pytest.raises(ReservationResolved):
        await store.settle(ref, 10)


async def test_release_after_settle_is_refused(store: LedgerStore, tag: str) -> None:
    await put(store, tag, (Period.TOTAL, 1_000))
    r = await store.reserve(request(tag, tag, 100))
    ref = ReservationRef(tag, r.reservation_id, OWNER)
    await store.settle(ref, 10)
    with pytest.raises(ReservationResolved):
        await store.release(ref)
    assert (await leg(store, tag)).committed_micros == 10


async def test_another_owner_cannot_see_settle_or_release(store: LedgerStore, tag: str) -> None:
    await put(store, tag, (Period.TOTAL, 1_000))
    r = await store.reserve(request(tag, tag, 100))
    stranger = ReservationRef(tag, r.reservation_id, "key_stranger")
    with pytest.raises(ReservationNotFound):
        await store.settle(stranger, 1)
    with pytest.raises(ReservationNotFound):
        await store.release(stranger)
    assert await store.reservation(stranger) is None
    assert (await leg(store, tag)).reserved_micros == 100


async def test_unknown_reservation_is_not_found(store: LedgerStore, tag: str) -> None:
    await put(store, tag, (Period.TOTAL, 1_000))
    ref = ReservationRef(tag, "nope", OWNER)
    with pytest.raises(ReservationNotFound):
        await store.settle(ref, 1)
    with pytest.raises(ReservationNotFound):
        await store.release(ref)


async def test_no_budget_on_the_path_is_refused(store: LedgerStore, tag: str) -> None:
    await put(store, tag, (Period.TOTAL, 1_000))
    other = f"org:o{uuid.uuid4().hex[:12]}"
    with pytest.raises(BudgetNotFound):
        await store.reserve(request(other, f"{other}/team:x", 1))


async def test_budgets_that_do_not_exist_on_the_path_do_not_apply(
    store: LedgerStore, tag: str
) -> None:
    await put(store, f"{tag}/team:a", (Period.TOTAL, 100))
    r = await store.reserve(request(tag, f"{tag}/team:a/key:k", 60))
    assert [x.budget_id for x in r.legs] == [f"{tag}/team:a"]


async def test_expiry_charges_the_hold_and_marks_the_outcome_unknown(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    await put(store, tag, (Period.TOTAL, 1_000))
    r = await store.reserve(request(tag, tag, 100))
    ref = ReservationRef(tag, r.reservation_id, OWNER)
    clock.advance(TTL_MS - 1)
    assert await store.expire(tag, 100) == 0
    clock.advance(1)
    assert await store.expire(tag, 100) == 1
    assert await store.expire(tag, 100) == 0
    total = await leg(store, tag)
    assert (total.committed_micros, total.reserved_micros) == (100, 0)
    view = await store.reservation(ref)
    assert view is not None
    assert (view.state, view.outcome) == (ReservationState.EXPIRED, "unknown")


@pytest.mark.parametrize(("actual", "committed", "overshoot"), [(30, 30, 0), (130, 130, 30)])
async def test_a_late_settle_corrects_what_expiry_charged(
    store: LedgerStore, tag: str, clock: ManualClock, actual: int, committed: int, overshoot: int
) -> None:
    await put(store, tag, (Period.TOTAL, 1_000))
    r = await store.reserve(request(tag, tag, 100))
    clock.advance(TTL_MS)
    await store.expire(tag, 100)
    s = await store.settle(ReservationRef(tag, r.reservation_id, OWNER), actual)
    assert s.late
    assert s.charged_micros == actual
    view = await store.reservation(ReservationRef(tag, r.reservation_id, OWNER))
    assert view is not None
    assert (view.state, view.outcome) == (ReservationState.SETTLED, "settled")
    total = await leg(store, tag)
    assert (total.committed_micros, total.reserved_micros, total.overshoot_micros) == (
        committed, 0, overshoot
    )


async def test_release_policy_returns_the_hold_and_a_late_settle_is_all_overshoot(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    await put(store, tag, (Period.TOTAL, 1_000))
    r = await store.reserve(request(tag, tag, 100, policy=ExpirePolicy.RELEASE))
    clock.advance(TTL_MS)
    assert await store.expire(tag, 100) == 1
    assert (await leg(store, tag)).committed_micros == 0
    s = await store.settle(ReservationRef(tag, r.reservation_id, OWNER), 40)
    assert (s.charged_micros, s.released_micros, s.overshoot_micros) == (40, 0, 40)
    total = await leg(store, tag)
    assert (total.committed_micros, total.overshoot_micros) == (40, 40)


async def test_a_late_release_refunds_what_expiry_charged(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    await put(store, tag, (Period.TOTAL, 1_000))
    r = await store.reserve(request(tag, tag, 100))
    clock.advance(TTL_MS)
    await store.expire(tag, 100)
    released = await store.release(ReservationRef(tag, r.reservation_id, OWNER))
    assert released.released_micros == 100
    total = await leg(store, tag)
    assert (total.committed_micros, total.reserved_micros) == (0, 0)


async def test_reserve_reclaims_expired_leases_before_it_checks(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    await put(store, tag, (Period.TOTAL, 100))
    await store.reserve(request(tag, tag, 100, policy=ExpirePolicy.RELEASE))
    with pytest.raises(BudgetBusy):
        await store.reserve(request(tag, tag, 100))
    clock.advance(TTL_MS)
    r = await store.reserve(request(tag, tag, 100))
    assert r.legs[0].reserved_micros == 100


async def test_settle_charges_the_period_it_reserved_in_not_today(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    await put(store, tag, (Period.DAY, 1_000))
    clock.now_ms = int(datetime(2026, 3, 14, 23, 59, 59, tzinfo=UTC).timestamp() * 1000)
    r = await store.reserve(request(tag, tag, 100))
    assert r.legs[0].window_key == "day:2026-03-14"
    clock.advance(1_000)
    await store.settle(ReservationRef(tag, r.reservation_id, OWNER), 80)
    today = await leg(store, tag, Period.DAY)
    assert (today.window_key, today.committed_micros, today.reserved_micros) == (
        "day:2026-03-15", 0, 0
    )
    clock.advance(-1_000)
    yesterday = await leg(store, tag, Period.DAY)
    assert (yesterday.window_key, yesterday.committed_micros) == ("day:2026-03-14", 80)


async def test_periods_follow_the_budget_time_zone(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    await put(store, tag, (Period.DAY, 1_000), (Period.MONTH, 5_000), tz="America/New_York")
    # 03:00 UTC on March 1st is still February 28th, 22:00 in New York.
    clock.now_ms = int(datetime(2026, 3, 1, 3, tzinfo=UTC).timestamp() * 1000)
    r = await store.reserve(request(tag, tag, 10))
    assert [x.window_key for x in r.legs] == ["day:2026-02-28", "month:2026-02"]
    assert r.legs[0].resets_at_ms == int(datetime(2026, 3, 1, 5, tzinfo=UTC).timestamp() * 1000)


async def test_a_day_resets_at_midnight(store: LedgerStore, tag: str, clock: ManualClock) -> None:
    await put(store, tag, (Period.DAY, 100))
    r = await store.reserve(request(tag, tag, 100))
    await store.settle(ReservationRef(tag, r.reservation_id, OWNER), 100)
    with pytest.raises(BudgetExceeded):
        await store.reserve(request(tag, tag, 1))
    clock.advance(12 * 3_600_000)
    assert (await store.reserve(request(tag, tag, 100))).legs[0].window_key == "day:2026-03-15"


async def test_replacing_a_budget_keeps_its_spend(store: LedgerStore, tag: str) -> None:
    await put(store, tag, (Period.TOTAL, 100))
    r = await store.reserve(request(tag, tag, 60))
    await store.settle(ReservationRef(tag, r.reservation_id, OWNER), 60)
    await put(store, tag, (Period.TOTAL, 200))
    total = await leg(store, tag)
    assert (total.ceiling_micros, total.committed_micros, total.remaining_micros) == (200, 60, 140)


async def test_a_run_budget_is_checked_with_the_others(store: LedgerStore, tag: str) -> None:
    await put(store, tag, (Period.TOTAL, 1_000))
    run = RunLimit(BudgetId(f"{tag}/run:r1"), 150)
    await store.reserve(request(tag, tag, 100, run=run))
    with pytest.raises(BudgetBusy) as info:
        await store.reserve(request(tag, tag, 100, run=run))
    assert info.value.details["budget_id"] == f"{tag}/run:r1"
    legs = await store.status((BudgetId(tag),), run)
    assert [(x.budget_id, x.reserved_micros) for x in legs] == [(tag, 100), (f"{tag}/run:r1", 100)]


def a_key(tag: str, run_ceiling_micros: int | None = 500) -> KeyRecord:
    return KeyRecord("key_" + uuid.uuid4().hex[:16], "h" + uuid.uuid4().hex, BudgetId(tag),
                     run_ceiling_micros)


async def taken(store: LedgerStore, key_id: str, hashes: list[str]) -> list[str]:
    """The hashes of `hashes` the key's record takes now."""
    return [h for h in hashes if await store.get_key(h, key_id) is not None]


async def test_api_keys_are_found_by_their_id_and_revoked(store: LedgerStore, tag: str) -> None:
    record = a_key(tag)
    await store.put_key(record)
    assert await store.get_key(record.key_hash, record.key_id) == record
    await store.put_key(record)  # a repeat writes nothing
    assert await store.get_key(record.key_hash, record.key_id) == record
    # The id is the authority: another secret, or this one under another id, is no key's.
    assert await store.get_key("h" + uuid.uuid4().hex, record.key_id) is None
    assert await store.get_key(record.key_hash, "key_" + uuid.uuid4().hex[:16]) is None
    # A key made now has no entry under its hash: its secrets carry its id.
    assert await store.get_key(record.key_hash) is None
    with pytest.raises(InvariantBroken):  # another key under an id already made
        await store.put_key(KeyRecord(record.key_id, "h" + uuid.uuid4().hex, BudgetId(tag), 1))
    assert await store.delete_key(record.key_id)
    assert not await store.delete_key(record.key_id)
    assert await store.get_key(record.key_hash, record.key_id) is None
    # A revoked id stays revoked: not made again, not rotated back to life.
    with pytest.raises(InvariantBroken):
        await store.put_key(record)
    assert not await store.rotate_key(record.key_id, "h" + uuid.uuid4().hex, 60_000)
    assert await store.get_key(record.key_hash, record.key_id) is None
    assert not await store.rotate_key("key_" + uuid.uuid4().hex[:16], "h1", 0)


async def test_a_rotated_key_takes_its_previous_secret_until_the_grace_ends(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    record = a_key(tag)
    await store.put_key(record)
    first, second, third = record.key_hash, "h" + uuid.uuid4().hex, "h" + uuid.uuid4().hex
    assert await store.rotate_key(record.key_id, second, 1_000)
    found = await store.get_key(first, record.key_id)
    assert found is not None
    assert (found.key_id, found.key_hash, found.budget_id, found.run_ceiling_micros) == (
        record.key_id, first, record.budget_id, 500)
    clock.advance(999)
    assert await taken(store, record.key_id, [first, second]) == [first, second]
    clock.advance(1)  # the grace is over, by the ledger's clock
    assert await taken(store, record.key_id, [first, second]) == [second]
    # A repeat of the rotation writes nothing: the grace it gave is not given again.
    assert await store.rotate_key(record.key_id, second, 1_000)
    assert await taken(store, record.key_id, [first, second]) == [second]
    # One previous secret at a time: the next rotation ends the one before at once.
    assert await store.rotate_key(record.key_id, third, 60_000)
    assert await taken(store, record.key_id, [first, second, third]) == [second, third]
    # A repeat of a rotation a later one overtook does not bring its secret back as current.
    assert await store.rotate_key(record.key_id, second, 0)
    clock.advance(60_000)
    assert await taken(store, record.key_id, [first, second, third]) == [third]
    # Revoking ends every secret at once, the previous one within its grace too.
    assert await store.rotate_key(record.key_id, first + "x", 60_000)
    assert await store.delete_key(record.key_id)
    assert await taken(store, record.key_id, [first, second, third, first + "x"]) == []


async def test_racing_key_rotations_without_grace_leave_exactly_one_secret(
    store: LedgerStore, tag: str
) -> None:
    record = a_key(tag)
    await store.put_key(record)
    hashes = ["h" + uuid.uuid4().hex for _ in range(10)]
    rotated = await asyncio.gather(*(store.rotate_key(record.key_id, h, 0) for h in hashes))
    assert rotated == [True] * 10
    left = await taken(store, record.key_id, [record.key_hash, *hashes])
    assert len(left) == 1
    assert left[0] in hashes
    # With a revoke among them: nothing, whichever ran first.
    again = ["h" + uuid.uuid4().hex for _ in range(10)]
    await asyncio.gather(store.delete_key(record.key_id),
                         *(store.rotate_key(record.key_id, h, 0) for h in again))
    assert await taken(store, record.key_id, [record.key_hash, *hashes, *again]) == []


async def test_reservation_view_reports_the_price_version_and_model(
    store: LedgerStore, tag: str
) -> None:
    await put(store, tag, (Period.TOTAL, 1_000))
    r = await store.reserve(request(tag, tag, 100))
    view = await store.reservation(ReservationRef(tag, r.reservation_id, OWNER))
    assert view is not None
    assert (view.state, view.model, view.price_version, view.reserved_micros) == (
        ReservationState.OPEN, "test-model", "test-prices", 100
    )


async def test_probe_reports_what_the_store_is(store: LedgerStore) -> None:
    probe = await store.probe("instance-a")
    assert probe.reachable
    assert probe.shared is store.shared
    assert probe.backend == store.backend
    assert ("ledger_not_shared" in probe.reasons) is not store.shared


async def test_book_writes_journaled_spend_once_in_the_period_it_was_admitted(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    await put(store, tag, (Period.DAY, 100), (Period.TOTAL, 1_000))
    admitted_at_ms = clock.now_ms - 86_400_000  # yesterday, while the ledger was unreachable
    entry = request(tag, tag, 80)
    assert await store.book(entry, 150, admitted_at_ms)
    assert not await store.book(entry, 150, admitted_at_ms)
    total = await leg(store, tag)
    assert (total.committed_micros, total.overshoot_micros) == (150, 150)
    today = await leg(store, tag, Period.DAY)
    assert today.committed_micros == 0
    clock.advance(-86_400_000)
    assert (await leg(store, tag, Period.DAY)).committed_micros == 150
    view = await store.reservation(entry.ref)
    assert view is not None
    assert (view.state, view.charged_micros, view.outcome) == (
        ReservationState.SETTLED, 150, "journal"
    )


async def test_output_lengths_are_counted_per_model(store: LedgerStore) -> None:
    model = f"model-{uuid.uuid4().hex[:8]}"
    for tokens in [10] * 90 + [3_000] * 10:
        await store.observe_output(model, tokens)
    histogram = await store.output_histogram(model)
    assert histogram == {16: 90, output_stats.bucket(3_000): 10}
    assert output_stats.p95(histogram) == output_stats.bucket(3_000)
    assert await store.output_histogram(model + "-other") == {}


async def test_a_call_that_outlives_its_lease_never_gets_its_budget_granted_twice(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    # A slow call: its lease runs out while the provider is still answering.
    await put(store, tag, (Period.TOTAL, 100))
    slow = await store.reserve(request(tag, tag, 100))
    clock.advance(TTL_MS + 1)
    # Expiry charges the hold (the worker may be billed), so the budget is not handed out again.
    with pytest.raises(BudgetExceeded):
        await store.reserve(request(tag, tag, 1))
    # The provider answers; the late settle books the actual and gives back the rest.
    settled = await store.settle(ReservationRef(tag, slow.reservation_id, OWNER), 70)
    assert (settled.late, settled.charged_micros, settled.released_micros) == (True, 70, 30)
    assert (await store.reserve(request(tag, tag, 30))).reserved_micros == 30
    with pytest.raises(BudgetBusy):
        await store.reserve(request(tag, tag, 1))


# -- replays of resolved reservations --------------------------------------------------------------


@pytest.mark.parametrize(("resolve", "state", "outcome", "charged"), [
    ("settle", "settled", "settled", 40),
    ("release", "released", "released", 0),
    ("expire", "expired", "unknown", 100),
    ("expire_released", "expired", "released", 0),
    ("lease_ended", "expired", "unknown", 100),
])
async def test_a_replayed_reserve_of_a_resolved_reservation_says_what_became_of_it(
    store: LedgerStore, tag: str, clock: ManualClock, resolve: str, state: str, outcome: str,
    charged: int,
) -> None:
    await put(store, tag, (Period.TOTAL, 1_000))
    policy = ExpirePolicy.RELEASE if resolve == "expire_released" else ExpirePolicy.CHARGE
    first = request(tag, tag, 100, policy=policy)
    await store.reserve(first)
    if resolve == "settle":
        await store.settle(first.ref, 40)
    elif resolve == "release":
        await store.release(first.ref)
    elif resolve == "lease_ended":
        # Past its lease and reached by no reclaim yet: the replay itself expires it.
        clock.advance(TTL_MS)
    else:
        clock.advance(TTL_MS)
        await store.expire(tag, 100)
    books = await leg(store, tag)
    if resolve == "lease_ended":
        assert books.reserved_micros == 100  # still held until something expires it
        books = books._replace(committed_micros=100, reserved_micros=0)
    with pytest.raises(ReservationResolved) as replay:
        await store.reserve(first)
    assert {k: replay.value.details[k] for k in (
        "reservation_id", "state", "outcome", "reserved_micros", "charged_micros")} == {
        "reservation_id": first.ref.reservation_id, "state": state, "outcome": outcome,
        "reserved_micros": 100, "charged_micros": charged}
    assert await leg(store, tag) == books  # nothing held again
    # Another call under the same id is still told apart from a replay.
    with pytest.raises(IdempotencyConflict):
        await store.reserve(request(tag, tag, 100, rid=first.ref.reservation_id, fingerprint="x"))


# -- operators' corrections ------------------------------------------------------------------------

GATEWAY_OWNER = GATEWAY_OWNER_PREFIX + OWNER
BY = Correction("admin:0123456789abcdef", "provider bill, invoice 42")


async def test_an_operator_corrects_an_open_reservation_whoever_owns_it(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    await put(store, tag, (Period.TOTAL, 1_000))
    held = request(tag, tag, 100, owner=GATEWAY_OWNER)
    await store.reserve(held)
    # Its key, acting as a sidecar, cannot reach it: the gateway's owner is not the key's.
    as_key = ReservationRef(tag, held.ref.reservation_id, OWNER)
    with pytest.raises(ReservationNotFound):
        await store.settle(as_key, 0)
    with pytest.raises(ReservationNotFound):
        await store.release(as_key)
    assert await store.reservation(as_key) is None
    clock.advance(1_234)
    corrected = await store.correct(tag, held.ref.reservation_id, 30, BY)
    assert (corrected.charged_micros, corrected.released_micros, corrected.late,
            corrected.replayed) == (30, 70, False, False)
    total = await leg(store, tag)
    assert (total.committed_micros, total.reserved_micros) == (30, 0)
    view = await store.inspect(tag, held.ref.reservation_id)
    assert view is not None
    assert (view.state, view.outcome, view.charged_micros, view.owner) == (
        ReservationState.SETTLED, "corrected", 30, GATEWAY_OWNER)
    assert (view.corrected_by, view.corrected_at_ms, view.corrected_from_micros,
            view.correction_reason) == (BY.corrected_by, clock.now_ms, 100, BY.reason)
    assert view.resolved_ms == clock.now_ms
    assert view.created_ms == clock.now_ms - 1_234
    # Safe to repeat; another amount is a conflict; the gateway's own settle no longer applies.
    again = await store.correct(tag, held.ref.reservation_id, 30, BY)
    assert (again.charged_micros, again.replayed) == (30, True)
    with pytest.raises(IdempotencyConflict):
        await store.correct(tag, held.ref.reservation_id, 31, BY)
    with pytest.raises(IdempotencyConflict):
        await store.settle(held.ref, 31)
    assert await leg(store, tag) == total


async def test_an_operator_corrects_an_unknown_outcome_after_expiry(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    await put(store, tag, (Period.TOTAL, 1_000))
    held = request(tag, tag, 100, owner=GATEWAY_OWNER)
    await store.reserve(held)
    clock.advance(TTL_MS)
    assert await store.expire(tag, 100) == 1
    assert (await leg(store, tag)).committed_micros == 100  # charged at expiry: unknown
    corrected = await store.correct(tag, held.ref.reservation_id, 130, BY)
    assert (corrected.charged_micros, corrected.overshoot_micros, corrected.late) == (
        130, 30, True)
    total = await leg(store, tag)
    assert (total.committed_micros, total.reserved_micros, total.overshoot_micros) == (
        130, 0, 30)
    view = await store.inspect(tag, held.ref.reservation_id)
    assert view is not None
    assert (view.outcome, view.corrected_from_micros) == ("corrected", 100)


@pytest.mark.parametrize("resolve", ["settle", "release", "expire_released"])
async def test_an_operator_cannot_correct_what_was_resolved(
    store: LedgerStore, tag: str, clock: ManualClock, resolve: str
) -> None:
    await put(store, tag, (Period.TOTAL, 1_000))
    policy = ExpirePolicy.RELEASE if resolve == "expire_released" else ExpirePolicy.CHARGE
    held = request(tag, tag, 100, policy=policy)
    await store.reserve(held)
    if resolve == "settle":
        await store.settle(held.ref, 40)
    elif resolve == "release":
        await store.release(held.ref)
    elif resolve == "lease_ended":
        # Past its lease and reached by no reclaim yet: the replay itself expires it.
        clock.advance(TTL_MS)
    else:
        clock.advance(TTL_MS)
        await store.expire(tag, 100)
    books = await leg(store, tag)
    if resolve == "lease_ended":
        assert books.reserved_micros == 100  # still held until something expires it
        books = books._replace(committed_micros=100, reserved_micros=0)
    with pytest.raises(ReservationResolved) as refused:
        await store.correct(tag, held.ref.reservation_id, 0, BY)
    assert refused.value.details["state"] == ("expired" if resolve == "expire_released"
                                              else f"{resolve}d")
    assert await leg(store, tag) == books
    view = await store.inspect(tag, held.ref.reservation_id)
    assert view is not None
    assert view.corrected_by is None
    with pytest.raises(ReservationNotFound):
        await store.correct(tag, uuid.uuid4().hex, 0, BY)
    assert await store.inspect(tag, uuid.uuid4().hex) is None


async def test_put_budget_maps_the_tag_its_reservation_ids_name(
    store: LedgerStore, tag: str
) -> None:
    assert await store.tag_of(tag_digest(tag)) is None
    await put(store, f"{tag}/team:a", (Period.TOTAL, 1_000))
    await put(store, f"{tag}/team:a", (Period.TOTAL, 2_000))  # safe to repeat
    assert await store.tag_of(tag_digest(tag)) == tag


async def test_a_key_keeps_its_roles(store: LedgerStore, tag: str) -> None:
    for roles in ({Role.SIDECAR}, {Role.GATEWAY, Role.SIDECAR}):
        record = KeyRecord("key_r" + uuid.uuid4().hex[:8], "h" + uuid.uuid4().hex,
                           BudgetId(tag), None, frozenset(roles))
        await store.put_key(record)
        assert await store.get_key(record.key_hash, record.key_id) == record


# -- bounded state: run counters end after an idle time ----------------------------------------


async def run_leg(store: LedgerStore, tag: str, run: RunLimit) -> LegStatus:
    legs = await store.status((BudgetId(tag),), run)
    return next(x for x in legs if x.budget_id == run.budget_id.path)


def a_run(tag: str, ceiling_micros: int = 500) -> RunLimit:
    return RunLimit(BudgetId(f"{tag}/run:r{uuid.uuid4().hex[:8]}"), ceiling_micros)


async def test_a_sidecar_record_under_a_minted_id_is_kept_the_replay_window(
    store: LedgerStore, tag: str
) -> None:
    """A busy key keeps its rate times minutes of records: a sidecar reservation under an id the
    ledger minted (no fingerprint) is kept REPLAY_WINDOW_MS once settled, money moved or not, and
    answers a resent settle as the first meanwhile (before: a day, and a daily count that
    refused honest work)."""
    await put(store, tag, (Period.TOTAL, 10_000))
    made = request(tag, tag, 100, fingerprint="", retention_ms=REPLAY_WINDOW_MS)
    await store.reserve(made)
    first = await store.settle(made.ref, 60)
    again = await store.settle(made.ref, 60)
    assert (again.replayed, again.charged_micros) == (True, first.charged_micros)
    execute = store._t.execute  # type: ignore[attr-defined]
    kept_ms = int(await execute("PTTL", keys.reservation(tag, made.ref.reservation_id)))
    assert 0 < kept_ms <= REPLAY_WINDOW_MS
    assert (await leg(store, tag)).committed_micros == 60


async def test_a_run_counter_is_dropped_after_a_day_without_a_call(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    await put(store, tag, (Period.TOTAL, 10_000))
    run = a_run(tag)
    first = request(tag, tag, 100, run=run)
    await store.reserve(first)
    await store.settle(first.ref, 80)
    clock.advance(RUN_COUNTER_IDLE_MS - 1)
    assert (await run_leg(store, tag, run)).committed_micros == 80
    clock.advance(1)
    assert (await run_leg(store, tag, run)).committed_micros == 0
    # The same run id after a silent day is a new run; the budget above it kept everything.
    again = await store.reserve(request(tag, tag, 500, run=run))
    assert [(x.committed_micros, x.reserved_micros) for x in again.legs] == [(80, 500), (0, 500)]


async def test_a_run_counter_outlives_every_open_reservation_of_its_run(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    await put(store, tag, (Period.TOTAL, 10_000))
    run = a_run(tag)
    await store.reserve(request(tag, tag, 100, run=run, ttl_ms=RESERVATION_TTL_MS_MAX))
    clock.advance(RESERVATION_TTL_MS_MAX)
    assert await store.expire(tag, 100) == 1  # the expiry's write starts the idle time again
    clock.advance(RUN_COUNTER_IDLE_MS - 1)
    assert (await run_leg(store, tag, run)).committed_micros == 100
    clock.advance(1)
    assert (await run_leg(store, tag, run)).committed_micros == 0


async def test_counters_that_hold_spend_carry_no_expiry_and_go_by_the_sweep(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    """A Redis that evicts keys with an expiry (volatile-*) must find no counter of spend to drop:
    day, month, user and run counters carry none. They go by the sweep instead, a window's
    COUNTER_RETENTION_MS after it ends and a run's RUN_COUNTER_IDLE_MS after its last call: here
    the first hold of a later window runs it, and the sweeper's expire does for a quiet tag."""
    await put(store, tag, (Period.DAY, 10**9), (Period.MONTH, 10**9), (Period.TOTAL, 10**9))
    run = a_run(tag)
    first = request(tag, tag, 100, run=run)
    r = await store.reserve(first)
    await store.settle(first.ref, 80)
    day, month = (leg.window_key for leg in r.legs[:2])
    made = [keys.counter(tag, tag, day), keys.counter(tag, tag, month),
            keys.counter(tag, tag, "total"), keys.counter(tag, run.budget_id.path, "total")]
    execute = store._t.execute  # type: ignore[attr-defined]
    assert [await execute("PTTL", k) for k in made] == [-1, -1, -1, -1]
    clock.advance(RUN_COUNTER_IDLE_MS)
    assert await store.expire(tag, 10) == 0  # the sweeper: the idle run's counter goes
    assert [await execute("EXISTS", k) for k in made] == [1, 1, 1, 0]
    clock.advance(COUNTER_RETENTION_MS + 32 * RUN_COUNTER_IDLE_MS)
    later = await store.reserve(request(tag, tag, 1))  # a new window's first hold sweeps
    assert [await execute("EXISTS", k) for k in made] == [0, 0, 1, 0]
    assert [(x.window_key, x.committed_micros) for x in later.legs][2] == ("total", 80)


@pytest.mark.parametrize("late", ["settle", "release"])
async def test_a_late_answer_for_an_idle_run_books_the_budgets_and_leaves_the_run_gone(
    store: LedgerStore, tag: str, clock: ManualClock, late: str
) -> None:
    await put(store, tag, (Period.TOTAL, 10_000))
    run = a_run(tag)
    held = request(tag, tag, 100, run=run)
    await store.reserve(held)
    clock.advance(TTL_MS)
    await store.expire(tag, 100)
    clock.advance(RUN_COUNTER_IDLE_MS)
    if late == "settle":
        await store.settle(held.ref, 30)
    else:
        await store.release(held.ref)
    assert (await leg(store, tag)).committed_micros == (30 if late == "settle" else 0)
    gone = await run_leg(store, tag, run)
    # Not recreated holding only the late delta (a refund would read as negative spend).
    assert (gone.committed_micros, gone.reserved_micros, gone.overshoot_micros) == (0, 0, 0)
    fresh = await store.reserve(request(tag, tag, run.ceiling_micros, run=run))
    assert fresh.legs[-1].reserved_micros == run.ceiling_micros


# -- the lifecycle: every row of core/lifecycle.py's table, on every store ------------------------

HELD = 100
ACTUALS = (30, HELD, 130)  # below, at and above what was held
# A gateway call's record (kept for resends only once resolved) and a sidecar's (kept whole):
# the scripts take a path of their own for the first.
RETENTIONS = (RESEND_WINDOW_MS, IDEMPOTENCY_WINDOW_MS)


async def counters_of(store: LedgerStore, tag: str) -> tuple[int, int, int]:
    total = await leg(store, tag)
    return total.reserved_micros, total.committed_micros, total.overshoot_micros


async def into_state(store: LedgerStore, clock: ManualClock, tag: str, state: str,
                     policy: ExpirePolicy, retention_ms: int = IDEMPOTENCY_WINDOW_MS
                     ) -> ReserveRequest:
    """A reservation of HELD micros left in `state` (ABSENT: none was made under its id)."""
    made = request(tag, tag, HELD, policy=policy, owner=GATEWAY_OWNER,
                   retention_ms=retention_ms,
                   fingerprint="" if retention_ms <= RESEND_WINDOW_MS else "fp")
    if state != ABSENT:
        await store.reserve(made)
    if state == ReservationState.EXPIRED:
        clock.advance(TTL_MS)
        assert await store.expire(tag, 100) == 1
    return made


async def step_on(store: LedgerStore, clock: ManualClock, made: ReserveRequest, event: Event,
                  actual: int) -> Settlement | Release | Reservation | int | bool:
    tag, rid = made.ref.tag, made.ref.reservation_id
    if event is Event.RESERVE:
        return await store.reserve(made)
    if event is Event.SETTLE:
        return await store.settle(made.ref, actual)
    if event is Event.RELEASE:
        return await store.release(made.ref)
    if event is Event.CORRECT:
        return await store.correct(tag, rid, actual, BY)
    if event is Event.EXPIRE:
        clock.advance(TTL_MS)
        return await store.expire(tag, 100)
    return await store.book(made, actual, clock.now_ms)


# Every row; an actual of each kind where the event charges one; both kinds of record where it
# leaves an open one.
ROWS = [
    (event, state, policy, actual, retention_ms)
    for event, state, policy in TRANSITIONS
    for actual in (ACTUALS if event in (Event.SETTLE, Event.CORRECT, Event.BOOK) else (0,))
    for retention_ms in (RETENTIONS if state == ReservationState.OPEN else RETENTIONS[1:])
]


@pytest.mark.parametrize(
    ("event", "state", "policy", "actual", "retention_ms"), ROWS,
    ids=[f"{e}-{s}-{p}-{a}-{r}" for e, s, p, a, r in ROWS],
)
async def test_every_transition_books_what_the_lifecycle_table_says(
    store: LedgerStore, tag: str, clock: ManualClock, event: Event, state: str,
    policy: ExpirePolicy, actual: int, retention_ms: int,
) -> None:
    await put(store, tag, (Period.TOTAL, 1_000_000))
    made = await into_state(store, clock, tag, state, policy, retention_ms)
    before = await counters_of(store, tag)
    fx = effects(event, state, policy, HELD, actual)
    answer = await step_on(store, clock, made, event, actual)
    after = await counters_of(store, tag)
    # What each counter moved by, read back from the ledger.
    assert tuple(a - b for a, b in zip(after, before, strict=True)) == (
        fx.reserved_delta, fx.committed_delta, fx.overshoot_micros)
    if isinstance(answer, Settlement):
        assert (answer.charged_micros, answer.released_micros, answer.overshoot_micros,
                answer.late, answer.replayed) == (
            fx.charged_micros, fx.released_micros, fx.overshoot_micros, fx.late, False)
    elif isinstance(answer, Release):
        assert (answer.released_micros, answer.replayed) == (fx.released_micros, False)
    elif isinstance(answer, Reservation):
        assert (answer.reserved_micros, answer.replayed) == (HELD, False)
    view = await store.inspect(tag, made.ref.reservation_id)
    assert view is not None
    assert (view.state, view.outcome) == (fx.to, fx.outcome)
    assert view.reserved_micros == HELD
    if fx.to is ReservationState.SETTLED:
        assert view.charged_micros == fx.charged_micros
    # Safe to run twice: a repeat books nothing more.
    if event in (Event.SETTLE, Event.RELEASE, Event.CORRECT, Event.BOOK, Event.RESERVE):
        with contextlib.suppress(ReservationResolved):
            await step_on(store, clock, made, event, actual)
        assert await counters_of(store, tag) == after


NO_ROWS = [
    (event, state, policy)
    for event in (Event.SETTLE, Event.RELEASE, Event.CORRECT)
    for state in (ReservationState.SETTLED, ReservationState.RELEASED, ReservationState.EXPIRED)
    for policy in ExpirePolicy
    if step(event, state, policy) is None
]


@pytest.mark.parametrize("retention_ms", RETENTIONS)
@pytest.mark.parametrize(
    ("event", "state", "policy"), NO_ROWS, ids=[f"{e}-{s}-{p}" for e, s, p in NO_ROWS]
)
async def test_an_event_the_table_has_no_row_for_books_nothing(
    store: LedgerStore, tag: str, clock: ManualClock, event: Event, state: str,
    policy: ExpirePolicy, retention_ms: int,
) -> None:
    await put(store, tag, (Period.TOTAL, 1_000_000))
    made = await into_state(store, clock, tag, ReservationState.OPEN, policy, retention_ms)
    if state == ReservationState.SETTLED:
        await store.settle(made.ref, 40)
    elif state == ReservationState.RELEASED:
        await store.release(made.ref)
    else:
        clock.advance(TTL_MS)
        await store.expire(tag, 100)
    first = await store.inspect(tag, made.ref.reservation_id)
    before = await counters_of(store, tag)
    # A repeat of the step that resolved it answers as before; any other is refused.
    with contextlib.suppress(ReservationResolved, IdempotencyConflict):
        await step_on(store, clock, made, event, 41)
    assert await counters_of(store, tag) == before
    assert await store.inspect(tag, made.ref.reservation_id) == first


async def test_an_operator_lists_open_reservations_and_the_live_runs_they_hold_in(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    """The spend page's read (open_listing): counts, the open reservations past their lease and
    within it by lease end, the runs their calls hold in, and no write: the overdue lease stays
    open and held until expiry books it."""
    team = f"{tag}/team:a"
    run, other = (RunLimit(BudgetId(f"{team}/run:r1"), 5_000),
                  RunLimit(BudgetId(f"{team}/run:r2"), 7_000))

    async def hold(amount_micros: int, **kwargs: Any) -> str:
        # An id a reserve does not sample for reclaiming (RECLAIM_SAMPLE_DIGITS).
        rid = uuid.uuid4().hex[:-1] + "f"
        await store.reserve(request(tag, team, amount_micros, rid=rid, **kwargs))
        return rid

    await put(store, tag, (Period.TOTAL, 100_000))
    await put(store, team, (Period.DAY, 50_000))
    await store.settle(ReservationRef(tag, await hold(300, run=run), OWNER), 300)
    held = await hold(200)
    in_run = await hold(100, run=run)
    newest = await hold(10, run=other, ttl_ms=2 * TTL_MS)
    # The last reserve before the listing: the memory store reclaims on every reserve.
    soon = await hold(50, ttl_ms=1_000, owner="gw:key_a", fingerprint="",
                      retention_ms=RESEND_WINDOW_MS)
    started_ms = clock.now_ms
    clock.advance(2_000)

    listing = await store.open_listing(tag, 10, 100)
    assert (listing.tag, listing.now_ms) == (tag, clock.now_ms)
    assert (listing.open_count, listing.overdue_count) == (4, 1)
    assert listing.overdue == (
        OpenHold(soon, "gw:key_a", (tag, team), None, 50, started_ms, started_ms + 1_000),)
    assert [h.reservation_id for h in listing.within_lease] == [*sorted([held, in_run]), newest]
    by_id = {h.reservation_id: h for h in listing.within_lease}
    assert by_id[in_run].run_budget_id == f"{team}/run:r1"
    assert (by_id[held].reserved_micros, by_id[held].expires_at_ms) == (
        200, started_ms + TTL_MS)
    runs = {(r.budget_id, r.ceiling_micros, r.committed_micros, r.reserved_micros, r.seen_ms)
            for r in listing.runs}
    assert runs == {(f"{team}/run:r1", 5_000, 300, 100, started_ms),
                    (f"{team}/run:r2", 7_000, 0, 10, started_ms)}
    # Bounded: listed_max of each kind; the runs of the examined_max newest leases only.
    small = await store.open_listing(tag, 1, 1)
    assert [h.reservation_id for h in small.within_lease] == [sorted([held, in_run])[0]]
    assert [r.budget_id for r in small.runs] == [f"{team}/run:r2"]
    # A read: the same answer again, and the overdue lease is still open and held.
    assert await store.open_listing(tag, 10, 100) == listing
    assert (await leg(store, team, Period.DAY)).reserved_micros == 360
    # A run idle for RUN_COUNTER_IDLE_MS is over, whether or not its open calls list it.
    clock.advance(RUN_COUNTER_IDLE_MS)
    late = await store.open_listing(tag, 10, 100)
    assert (late.open_count, late.overdue_count, late.runs) == (4, 4, ())
    assert await store.open_listing(f"{tag}x", 10, 100) == OpenLeases(
        f"{tag}x", clock.now_ms, 0, 0, (), (), ())
