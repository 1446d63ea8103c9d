"""End users, week periods, request rates and concurrency against every store: each decided in
the reserve script, all or nothing with the rest of the call's path."""

from __future__ import annotations

import asyncio
from datetime import datetime
from zoneinfo import ZoneInfo

import pytest

from core.budgets import BudgetDef, BudgetId, Limit, Period, PerUser, Rate, window_at
from core.errors import (
    BudgetExceeded,
    BudgetRefused,
    ConcurrencyLimited,
    RateLimited,
    UserRequired,
    UsersExhausted,
)
from core.ledger import ExpirePolicy, LedgerStore, ReservationRef, ReserveRequest
from core.limits import RATE_WINDOW_MS, RESEND_WINDOW_MS
from core.stores import keys
from tests.core.stores.test_conformance import OWNER, TTL_MS, request
from tests.support import ManualClock


def held(tag: str, path: str, micros: int, user: str | None = None, **kw: object
         ) -> ReserveRequest:
    r = request(tag, path, micros, **kw)  # type: ignore[arg-type]
    return ReserveRequest(r.ref, r.budget_ids, r.amount_micros, r.ttl_ms, r.fingerprint,
                          r.price_version, r.model, r.expire_policy, r.run, r.retention_ms, user)


async def put(store: LedgerStore, path: str, *limits: tuple[Period, int],
              rate: Rate | None = None, per_user: PerUser | None = None,
              timezone: str = "UTC") -> BudgetId:
    bid = BudgetId.parse(path)
    await store.put_budget(BudgetDef(bid, tuple(Limit(p, c) for p, c in limits), timezone,
                                     rate=rate, per_user=per_user))
    return bid


def legs_of(reserved: object, budget_id: str) -> dict[str, int]:
    return {leg.period.value: leg.committed_micros + leg.reserved_micros
            for leg in reserved.legs if leg.budget_id == budget_id}  # type: ignore[attr-defined]


async def test_a_definition_keeps_its_users_rate_and_week(store: LedgerStore, tag: str) -> None:
    per_user = PerUser((Limit(Period.WEEK, 500), Limit(Period.TOTAL, 2_000)), users_max=3,
                       required=True, rate=Rate(requests_per_minute=5))
    bid = await put(store, tag, (Period.WEEK, 9_000), (Period.DAY, 1_000),
                    rate=Rate(60, 4), per_user=per_user)
    found = await store.get_budget(bid)
    assert found is not None
    assert found.rate == Rate(60, 4)
    assert found.per_user == per_user
    assert sorted((lim.period, lim.ceiling_micros) for lim in found.limits) == sorted(
        [(Period.WEEK, 9_000), (Period.DAY, 1_000)])


async def test_each_user_is_held_to_its_own_ceiling_and_the_budget_too(
    store: LedgerStore, tag: str
) -> None:
    await put(store, tag, (Period.TOTAL, 1_000),
              per_user=PerUser((Limit(Period.TOTAL, 300),), users_max=10))
    user_a, user_b = f"{tag}/user:alice@example.com", f"{tag}/user:bob"
    r = await store.reserve(held(tag, tag, 200, "alice@example.com"))
    assert legs_of(r, user_a) == {"total": 200}
    with pytest.raises(BudgetRefused) as refused:
        await store.reserve(held(tag, tag, 101, "alice@example.com"))
    assert refused.value.details["budget_id"] == user_a
    await store.reserve(held(tag, tag, 300, "bob"))
    # Bob is at his ceiling, the budget has 500 left: another user still gets room.
    await store.reserve(held(tag, tag, 300, "carol"))
    with pytest.raises(BudgetRefused) as refused:
        await store.reserve(held(tag, tag, 300, "dave"))
    assert refused.value.details["budget_id"] == tag
    # A call with no user is held in the budget alone.
    await store.reserve(held(tag, tag, 200))
    assert user_b  # named for the reader: bob's leg is '<budget>/user:bob'


async def test_users_max_refuses_a_new_user_and_keeps_serving_the_known(
    store: LedgerStore, tag: str
) -> None:
    await put(store, tag, (Period.TOTAL, 10_000),
              per_user=PerUser((Limit(Period.TOTAL, 1_000),), users_max=2))
    await store.reserve(held(tag, tag, 10, "u1"))
    await store.reserve(held(tag, tag, 10, "u2"))
    before = await store.status(BudgetId(tag).lineage)
    with pytest.raises(UsersExhausted) as refused:
        await store.reserve(held(tag, tag, 10, "u3"))
    assert refused.value.details["budget_id"] == tag
    assert await store.status(BudgetId(tag).lineage) == before  # nothing held
    await store.reserve(held(tag, tag, 10, "u1"))


async def test_concurrent_new_users_never_pass_users_max(store: LedgerStore, tag: str) -> None:
    await put(store, tag, (Period.TOTAL, 10**9),
              per_user=PerUser((Limit(Period.TOTAL, 1_000),), users_max=5))
    results = await asyncio.gather(
        *(store.reserve(held(tag, tag, 1, f"user-{i}")) for i in range(40)),
        return_exceptions=True)
    admitted = [r for r in results if not isinstance(r, BaseException)]
    assert len(admitted) == 5
    assert all(isinstance(r, UsersExhausted) for r in results if isinstance(r, BaseException))


async def test_required_refuses_a_call_without_a_user(store: LedgerStore, tag: str) -> None:
    await put(store, tag, (Period.TOTAL, 1_000),
              per_user=PerUser((Limit(Period.TOTAL, 100),), required=True))
    with pytest.raises(UserRequired):
        await store.reserve(held(tag, tag, 10))
    await store.reserve(held(tag, tag, 10, "u1"))
    # A status read without a user still shows the budget.
    assert [leg.budget_id for leg in await store.status(BudgetId(tag).lineage)] == [tag]


async def test_a_user_total_never_refills(store: LedgerStore, tag: str) -> None:
    await put(store, tag, (Period.TOTAL, 10_000),
              per_user=PerUser((Limit(Period.TOTAL, 100),), users_max=10))
    r = await store.reserve(held(tag, tag, 100, "u1"))
    await store.settle(ReservationRef(tag, r.reservation_id, OWNER), 100)
    ttl = await store._t.execute(  # type: ignore[attr-defined]
        "PTTL", keys.counter(tag, f"{tag}/user:u1", "total"))
    assert int(ttl) == -1  # kept as long as the budget
    with pytest.raises(BudgetExceeded):
        await store.reserve(held(tag, tag, 1, "u1"))


async def test_a_week_resets_at_the_next_monday(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    await put(store, tag, (Period.WEEK, 100), timezone="Europe/Paris")
    r = await store.reserve(held(tag, tag, 100))
    week = next(leg for leg in r.legs if leg.budget_id == tag)
    assert week.period is Period.WEEK
    local = datetime.fromtimestamp(week.resets_at_ms / 1000, tz=ZoneInfo("Europe/Paris"))
    assert (local.weekday(), local.hour, local.minute) == (0, 0, 0)
    assert 0 < week.resets_at_ms - clock.now_ms <= 7 * 24 * 3_600_000
    w = window_at("Europe/Paris", Period.WEEK, clock.now_ms)
    assert w is not None
    assert week.window_key == w.key
    assert w.key.startswith("week:")
    with pytest.raises(BudgetRefused):
        await store.reserve(held(tag, tag, 1))
    clock.now_ms = week.resets_at_ms
    await store.reserve(held(tag, tag, 100))


async def test_the_rate_refuses_the_n_plus_first_request_in_a_minute(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    await put(store, tag, (Period.TOTAL, 10**9), rate=Rate(requests_per_minute=5))
    for _ in range(5):
        await store.reserve(held(tag, tag, 1))
        clock.advance(1_000)
    with pytest.raises(RateLimited) as refused:
        await store.reserve(held(tag, tag, 1))
    # The first of the five leaves the window 60 s after it: 55 s from now.
    assert refused.value.details["retry_after_s"] == 55
    assert refused.value.details["budget_id"] == tag
    clock.advance(RATE_WINDOW_MS - 5_000)
    await store.reserve(held(tag, tag, 1))
    with pytest.raises(RateLimited):
        await store.reserve(held(tag, tag, 1))


async def test_concurrency_counts_open_reservations_until_they_end(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    await put(store, tag, (Period.TOTAL, 10**9), rate=Rate(concurrent_max=2))
    gateway = {"fingerprint": "", "retention_ms": RESEND_WINDOW_MS}
    a = await store.reserve(held(tag, tag, 1, **gateway))
    b = await store.reserve(held(tag, tag, 1))
    with pytest.raises(ConcurrencyLimited) as refused:
        await store.reserve(held(tag, tag, 1))
    assert refused.value.details["retry_after_s"] >= 1
    await store.settle(ReservationRef(tag, a.reservation_id, OWNER), 1)  # the common case
    c = await store.reserve(held(tag, tag, 1))
    await store.release(ReservationRef(tag, b.reservation_id, OWNER))
    await store.reserve(held(tag, tag, 1))
    with pytest.raises(ConcurrencyLimited):
        await store.reserve(held(tag, tag, 1))
    # An expired lease frees its slot: the reserve reclaims it before refusing.
    clock.advance(TTL_MS + 1)
    await store.reserve(held(tag, tag, 1))
    await store.reserve(held(tag, tag, 1))
    assert c.reservation_id
    # Settling twice gives back one slot, not two.
    clock.advance(TTL_MS + 1)
    e = await store.reserve(held(tag, tag, 1))
    await store.settle(ReservationRef(tag, e.reservation_id, OWNER), 1)
    await store.settle(ReservationRef(tag, e.reservation_id, OWNER), 1)
    await store.reserve(held(tag, tag, 1))
    await store.reserve(held(tag, tag, 1))
    with pytest.raises(ConcurrencyLimited):
        await store.reserve(held(tag, tag, 1))


async def test_concurrent_calls_never_pass_concurrent_max(store: LedgerStore, tag: str) -> None:
    await put(store, tag, (Period.TOTAL, 10**9), rate=Rate(concurrent_max=3))
    results = await asyncio.gather(*(store.reserve(held(tag, tag, 1)) for _ in range(30)),
                                   return_exceptions=True)
    assert sum(not isinstance(r, BaseException) for r in results) == 3


async def test_a_users_rate_is_its_own(store: LedgerStore, tag: str) -> None:
    await put(store, tag, (Period.TOTAL, 10**9), rate=Rate(requests_per_minute=100),
              per_user=PerUser((Limit(Period.TOTAL, 10**6),), rate=Rate(2, None)))
    for _ in range(2):
        await store.reserve(held(tag, tag, 1, "u1"))
    with pytest.raises(RateLimited) as refused:
        await store.reserve(held(tag, tag, 1, "u1"))
    assert refused.value.details["budget_id"] == f"{tag}/user:u1"
    await store.reserve(held(tag, tag, 1, "u2"))


async def test_a_replayed_reserve_counts_once(store: LedgerStore, tag: str) -> None:
    await put(store, tag, (Period.TOTAL, 10**9), rate=Rate(requests_per_minute=2,
                                                            concurrent_max=2),
              per_user=PerUser((Limit(Period.TOTAL, 10**6),), users_max=1))
    req = held(tag, tag, 1, "u1", rid="same-id")
    for _ in range(5):
        await store.reserve(req)
    await store.reserve(held(tag, tag, 1, "u1"))  # the second of two in a minute, and at once
    assert TTL_MS


async def test_a_definition_an_earlier_version_cannot_read_is_stamped_so_it_refuses_it(
    store: LedgerStore, tag: str
) -> None:
    """Every definition carries the plain ledger id (lua/put_budget.lua), weeks, rates and end
    users too, and this version serves them."""
    plain = await put(store, tag, (Period.TOTAL, 100))
    week = await put(store, f"{tag}/team:w", (Period.WEEK, 100))
    rated = await put(store, f"{tag}/team:r", (Period.TOTAL, 100), rate=Rate(10, None))
    users = await put(store, f"{tag}/team:u", (Period.TOTAL, 100),
                      per_user=PerUser((Limit(Period.TOTAL, 10),)))
    ledger_id = await store.open()
    found = {b: await store._t.execute(  # type: ignore[attr-defined]
        "HGET", keys.definition(tag, b.path), "ledger") for b in (plain, week, rated, users)}
    assert found == dict.fromkeys((plain, week, rated, users), ledger_id)
    for b in (week, rated, users):  # and this version serves them
        await store.reserve(held(tag, b.path, 1, "u1"))


async def test_a_slot_nobody_gave_back_frees_itself_at_its_lease_end(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    """A reservation resolved by a step that does not know slots (a script of an earlier
    version) leaves its id in the budget's slots: it counts until its lease ends, then no
    more."""
    await put(store, tag, (Period.TOTAL, 10**9), rate=Rate(concurrent_max=1))
    slots = keys.prefix(tag) + keys.CONCURRENCY + tag
    await store._t.execute(  # type: ignore[attr-defined]
        "ZADD", slots, str(clock.now_ms + 1_000), "resolved-elsewhere")
    with pytest.raises(ConcurrencyLimited):
        await store.reserve(held(tag, tag, 1))
    clock.advance(1_000)
    await store.reserve(held(tag, tag, 1))


async def test_a_booked_call_counts_its_user_in_each_budget_with_room(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    """An outage's booking: a user is booked in every budget of the path that counts it or has
    room for it, and left out only of one that has none."""
    org = await put(store, tag, (Period.TOTAL, 10**6),
                    per_user=PerUser((Limit(Period.TOTAL, 1_000),), users_max=100))
    team = await put(store, f"{tag}/team:t", (Period.TOTAL, 10**6),
                     per_user=PerUser((Limit(Period.TOTAL, 1_000),), users_max=1))
    await store.reserve(held(tag, team.path, 5, "u1"))  # the team's one user
    request = held(tag, team.path, 500, "u2")
    assert await store.book(request, 400, clock.now_ms)
    legs = {leg.budget_id: leg.committed_micros
            for leg in await store.status(team.lineage, None, "u2")}
    assert legs[org.user("u2").path] == 400  # the org had room for u2
    assert team.user("u2").path not in legs or legs[team.user("u2").path] == 0
    assert legs[team.path] == 400


async def test_concurrency_retry_after_is_the_earliest_lease_end_of_the_held_slots(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    """A call of unknown outcome keeps its slot until its lease ends: a refusal says when that
    is, so a client that obeys asks once, not once a second (before: ~69 requests)."""
    await put(store, tag, (Period.TOTAL, 10**9), rate=Rate(concurrent_max=2))
    await store.reserve(held(tag, tag, 1, ttl_ms=TTL_MS))
    clock.advance(10_500)
    await store.reserve(held(tag, tag, 1, ttl_ms=TTL_MS))
    with pytest.raises(ConcurrencyLimited) as refused:
        await store.reserve(held(tag, tag, 1))
    # The first slot's lease ends TTL_MS after it was taken, 10.5 s ago: 49.5 s, rounded up.
    assert refused.value.details["retry_after_s"] == (TTL_MS - 10_500 + 999) // 1_000
    clock.advance(TTL_MS - 10_500 - 200)
    with pytest.raises(ConcurrencyLimited) as refused:
        await store.reserve(held(tag, tag, 1))
    assert refused.value.details["retry_after_s"] == 1  # never less than a second
    clock.advance(refused.value.details["retry_after_s"] * 1_000)
    await store.reserve(held(tag, tag, 1))  # when it said: the slot is free


async def test_a_user_takes_a_place_only_when_a_call_of_theirs_is_charged(
    store: LedgerStore, tag: str
) -> None:
    """Issue 35: three users whose calls the provider refused (released) filled users_max 3 for
    good. A released call, or one settled at zero, gives its user's place back and leaves no
    counter; a charged one keeps the place for good."""
    bid = await put(store, tag, (Period.TOTAL, 10**6),
                    per_user=PerUser((Limit(Period.DAY, 1_000), Limit(Period.TOTAL, 1_000)),
                                     users_max=3))
    for user in ("r1", "r2", "r3"):
        r = await store.reserve(held(tag, tag, 10, user))
        await store.release(ReservationRef(tag, r.reservation_id, OWNER))
    zero = await store.reserve(held(tag, tag, 10, "z1", fingerprint="",
                                    retention_ms=RESEND_WINDOW_MS))  # the gateway's path
    await store.settle(ReservationRef(tag, zero.reservation_id, OWNER), 0)
    gone = [keys.counter(tag, bid.user(u).path, "total") for u in ("r1", "r2", "r3", "z1")]
    assert await store._t.execute("EXISTS", *gone) == 0  # type: ignore[attr-defined]
    # Three users charged take the three places; a fourth is refused, the charged still served.
    for user in ("c1", "c2", "c3"):
        r = await store.reserve(held(tag, tag, 10, user))
        await store.settle(ReservationRef(tag, r.reservation_id, OWNER), 1)
    with pytest.raises(UsersExhausted):
        await store.reserve(held(tag, tag, 10, "r1"))
    await store.reserve(held(tag, tag, 10, "c1"))
    page = await store.users_of(bid, None, 10)
    assert [u.user for u in page.users] == ["c1", "c2", "c3"]


async def test_a_user_with_a_call_open_holds_a_place_until_it_ends(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    """Users with a call open take places (so concurrent new users cannot pass users_max), and
    give them back when their calls end uncharged (here: expiry under 'release', which a refused
    reserve runs first); one whose lease expired charged keeps it."""
    await put(store, tag, (Period.TOTAL, 10**6),
              per_user=PerUser((Limit(Period.TOTAL, 1_000),), users_max=2))
    await store.reserve(held(tag, tag, 10, "p1", policy=ExpirePolicy.RELEASE))
    await store.reserve(held(tag, tag, 10, "p1", policy=ExpirePolicy.RELEASE))  # same user
    await store.reserve(held(tag, tag, 10, "p2", ttl_ms=2 * TTL_MS))  # expires charged
    with pytest.raises(UsersExhausted):
        await store.reserve(held(tag, tag, 10, "p3"))
    clock.advance(TTL_MS + 1)  # p1's leases end, given back at expiry: p1's place is free
    await store.reserve(held(tag, tag, 10, "p3", ttl_ms=3 * TTL_MS))
    clock.advance(TTL_MS)  # p2's lease ends: expiry charges it, and p2 keeps its place
    await store.expire(tag, 10)  # p2's, and p1's unless p3's reserve reclaimed them first
    with pytest.raises(UsersExhausted):
        await store.reserve(held(tag, tag, 10, "p4"))
    page = await store.users_of(BudgetId(tag), None, 10)
    assert [u.user for u in page.users] == ["p2"]
