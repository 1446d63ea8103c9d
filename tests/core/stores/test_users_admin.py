"""A budget's end users for an operator, against every store: listed a page at a time with their
spend, gone with their budget, and carried through an export and a restore. Judged by what the
ledger holds afterwards (its keys, and its own status reads), never by what an operation said."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from core.budgets import BudgetDef, BudgetId, Limit, Period, PerUser, Rate, window_at
from core.errors import BudgetExceeded, BudgetInUse, BudgetRefused, InvalidRequest, UsersExhausted
from core.ledger import LedgerStore, ReservationRef, ReservationState, UsersPage, UserSpend
from core.operations import Operations, checksum
from core.prices import PriceTable
from core.service import CeilingService
from core.stores import keys
from core.stores.operations import ScriptedCatalogue
from core.stores.redis import RedisStore
from core.stores.scripted import ScriptedStore
from infra.redis_server import RedisServer
from tests.core.stores.test_conformance import OWNER, TTL_MS
from tests.core.stores.test_users_rates import held, put
from tests.support import ManualClock

BY = "admin:test"
PER_USER = PerUser((Limit(Period.DAY, 1_000), Limit(Period.WEEK, 2_000),
                    Limit(Period.MONTH, 3_000), Limit(Period.TOTAL, 5_000)),
                   users_max=50, rate=Rate(requests_per_minute=50, concurrent_max=3))
# In byte order, as the ledger lists them: upper case before lower, ':' before letters.
USERS = ("Zed", "a:b", "alice", "alice@example.com", "bob")


def scripted(store: LedgerStore) -> ScriptedStore:
    assert isinstance(store, ScriptedStore)  # every store kind is one
    return store


async def exists(store: LedgerStore, *names: str) -> list[bool]:
    t = scripted(store).transport
    return [bool(int(await t.execute("EXISTS", name))) for name in names]


async def spend(store: LedgerStore, tag: str, path: str, micros: int, user: str | None) -> None:
    r = await store.reserve(held(tag, path, micros, user))
    await store.settle(ReservationRef(tag, r.reservation_id, OWNER), micros)


def user_key_names(tag: str, user_budget: str, now_ms: int) -> list[str]:
    """The keys a user's calls made now: its counters in each window and its total, its rate
    log and concurrency count."""
    windows = [w.key for p in (Period.DAY, Period.WEEK, Period.MONTH)
               if (w := window_at("UTC", p, now_ms)) is not None]
    return [*(keys.counter(tag, user_budget, k) for k in (*windows, "total")),
            keys.prefix(tag) + keys.RATE + user_budget]


async def all_users(store: LedgerStore, bid: BudgetId, count: int) -> list[UserSpend]:
    """Every user, a page of `count` at a time, checking the pages' cursors and counts."""
    seen: list[UserSpend] = []
    after = None
    while True:
        page = await store.users_of(bid, after, count)
        assert len(page.users) <= count
        seen += page.users
        if not page.more:
            return seen
        assert len(page.users) == count
        after = page.users[-1].user


async def test_users_are_listed_in_byte_order_with_the_legs_a_status_read_shows(
    store: LedgerStore, tag: str
) -> None:
    bid = await put(store, tag, (Period.TOTAL, 10**6), per_user=PER_USER)
    for i, user in enumerate(USERS):
        await spend(store, tag, tag, 10 * (i + 1), user)
    await store.reserve(held(tag, tag, 7, "bob"))  # open: reserved, not committed
    first = await store.users_of(bid, None, 2)
    assert ([u.user for u in first.users], first.users_count, first.more) == (
        list(USERS[:2]), len(USERS), True)
    listed = await all_users(store, bid, 2)
    assert [u.user for u in listed] == list(USERS)
    for i, u in enumerate(listed):
        assert u.budget_id == bid.user(u.user).path
        # What GET /v1/budgets/me shows a key of this budget calling for that user.
        mine = await store.status(bid.lineage, None, u.user)
        assert u.legs == tuple(leg for leg in mine if leg.budget_id == u.budget_id)
        assert [leg.period for leg in u.legs] == [
            Period.DAY, Period.WEEK, Period.MONTH, Period.TOTAL]
        assert {leg.committed_micros for leg in u.legs} == {10 * (i + 1)}
    assert {leg.reserved_micros for leg in listed[-1].legs} == {7}
    after_last = await store.users_of(bid, USERS[-1], 10)
    assert (after_last.users, after_last.more) == ((), False)
    # A cursor that is no member starts after where it would sort.
    assert [u.user for u in (await store.users_of(bid, "alicf", 10)).users] == ["bob"]


async def test_a_budget_without_per_user_lists_the_users_it_keeps_with_no_legs(
    store: LedgerStore, tag: str
) -> None:
    never = await put(store, f"{tag}/team:plain", (Period.TOTAL, 1_000))
    assert await store.users_of(never, None, 10) == UsersPage((), 0, False)
    bid = await put(store, tag, (Period.TOTAL, 10**6), per_user=PER_USER)
    await spend(store, tag, tag, 400, "u1")
    await put(store, tag, (Period.TOTAL, 10**6))  # per_user taken off
    page = await store.users_of(bid, None, 10)
    assert [(u.user, u.legs) for u in page.users] == [("u1", ())]
    await put(store, tag, (Period.TOTAL, 10**6), per_user=PER_USER)  # and put back
    [u1] = (await store.users_of(bid, None, 10)).users
    assert next(leg for leg in u1.legs if leg.period is Period.TOTAL).committed_micros == 400


def catalogue(store: LedgerStore) -> ScriptedCatalogue:
    return ScriptedCatalogue(scripted(store))


async def test_delete_uncounts_its_users_and_keeps_every_counter(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    team = f"{tag}/team:a"
    bid = await put(store, team, (Period.DAY, 10**6), (Period.TOTAL, 10**7),
                    rate=Rate(100, 5), per_user=PER_USER)
    # A sibling whose id begins with the deleted one's, and a budget under it: their users stay.
    sibling = await put(store, f"{tag}/team:ab", (Period.TOTAL, 10**7), per_user=PER_USER)
    child = await put(store, f"{team}/project:p", (Period.TOTAL, 10**7), per_user=PER_USER)
    for user in ("u1", "u2"):
        await spend(store, tag, team, 100, user)
    await spend(store, tag, sibling.path, 100, "u1")
    await spend(store, tag, child.path, 100, "u1")
    gone = [keys.prefix(tag) + keys.USERS + team, keys.prefix(tag) + keys.RATE + team]
    stay = [keys.counter(tag, team, "total"),
            *user_key_names(tag, bid.user("u1").path, clock.now_ms)[:-1],
            *user_key_names(tag, bid.user("u2").path, clock.now_ms)[:-1],
            *(keys.prefix(tag) + keys.USERS + b.path for b in (sibling, child)),
            *(keys.counter(tag, b.user("u1").path, "total") for b in (sibling, child))]
    assert await exists(store, *gone, *stay) == [True] * (len(gone) + len(stay))

    assert await catalogue(store).delete_budget(tag, team, False) == (0, 0, 2)
    assert await exists(store, *gone) == [False] * len(gone)
    assert await exists(store, *stay) == [True] * len(stay)
    assert await store.get_budget(bid) is None
    assert await catalogue(store).delete_budget(tag, team, False) is None  # safe to repeat
    # Re-created: nothing refills, the budget's spend nor a user's; its users are counted afresh.
    await put(store, team, (Period.DAY, 10**6), (Period.TOTAL, 10**7), per_user=PER_USER)
    assert (await store.users_of(bid, None, 10)).users_count == 0
    total = next(leg for leg in await store.status((bid,)) if leg.period is Period.TOTAL)
    # u1's and u2's 100, and the child's 100 for u1 (a call of the child is held in every
    # budget of its path, and in their users).
    assert total.committed_micros == 300
    user_day = next(leg for leg in await store.status((bid,), None, "u1")
                    if leg.budget_id == bid.user("u1").path and leg.period is Period.DAY)
    assert user_day.committed_micros == 200
    await spend(store, tag, team, 800, "u1")  # what is left of u1's day
    with pytest.raises(BudgetRefused):
        await store.reserve(held(tag, team, 1, "u1"))


async def test_delete_is_refused_under_a_users_open_hold_and_force_charges_it(
    store: LedgerStore, tag: str
) -> None:
    bid = await put(store, tag, (Period.TOTAL, 10**6), per_user=PER_USER)
    r = await store.reserve(held(tag, tag, 300, "u1"))
    with pytest.raises(BudgetInUse):
        await catalogue(store).delete_budget(tag, tag, False)
    # u1 has a call open, none charged: a pending place, not yet one among the budget's users.
    assert await exists(store, keys.prefix(tag) + keys.PENDING_USERS + tag,
                        keys.prefix(tag) + keys.USERS + tag) == [True, False]
    # Forced, the hold is charged (so u1 takes its place) and then the sets go.
    assert await catalogue(store).delete_budget(tag, tag, True) == (1, 300, 1)
    view = await store.inspect(tag, r.reservation_id)
    assert view is not None
    assert (view.state, view.outcome) == (ReservationState.EXPIRED, "unknown")
    await put(store, tag, (Period.TOTAL, 10**6))
    [total] = await store.status((bid,))
    assert (total.committed_micros, total.reserved_micros) == (300, 0)
    # The users set went, the user's total stayed; its concurrency slot was given back.
    assert await exists(store, keys.prefix(tag) + keys.USERS + tag,
                        keys.prefix(tag) + keys.PENDING_USERS + tag,
                        keys.counter(tag, bid.user("u1").path, "total"),
                        keys.prefix(tag) + keys.CONCURRENCY + bid.user("u1").path) == [
        False, False, True, False]


async def test_a_late_settle_after_delete_gives_a_user_no_room_beyond_its_ceiling(
    store: LedgerStore, tag: str, clock: ManualClock
) -> None:
    per_user = PerUser((Limit(Period.TOTAL, 100),))
    await put(store, tag, (Period.TOTAL, 10**6), per_user=per_user)
    r = await store.reserve(held(tag, tag, 100, "u1"))
    clock.advance(TTL_MS + 1)
    assert await store.expire(tag, 10) == 1  # charged in full, outcome unknown
    await catalogue(store).delete_budget(tag, tag, False)
    await put(store, tag, (Period.TOTAL, 10**6), per_user=per_user)
    with pytest.raises(BudgetExceeded):  # the user's total did not refill
        await store.reserve(held(tag, tag, 1, "u1"))
    await store.settle(ReservationRef(tag, r.reservation_id, OWNER), 10)  # 90 back, in its counter
    await spend(store, tag, tag, 90, "u1")
    with pytest.raises(BudgetExceeded):
        await store.reserve(held(tag, tag, 1, "u1"))


# -- export and restore: a ledger of its own, wiped in between ---------------------------------


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer(durable=False) as s:
        yield s


async def _operations(url: str, clock: ManualClock) -> Operations:
    store = RedisStore(url, clock=clock)
    await store.open()
    return Operations(CeilingService(store, PriceTable.from_file(None)), ScriptedCatalogue(store))


def users_of_export(document: dict[str, Any]) -> dict[str, list[str]]:
    return {u["budget_id"]: u["users"] for org in document["body"]["organisations"]
            for u in org["users"]}


async def test_an_export_carries_the_users_and_a_restore_refills_none(
    server: RedisServer, clock: ManualClock
) -> None:
    tag, other = (f"org:{c}{uuid.uuid4().hex[:8]}" for c in "xy")
    # Eight scopes: a user's budget id is a ninth, which BudgetId.parse refuses.
    deep = BudgetId.parse("/".join([other, *(f"s{i}:n{i}" for i in range(6)), "key:k"]))
    long_user = "u" * 128  # longer than a scope's name may be
    users = {tag: ["a:b:c", "alice@example.com", long_user], deep.path: ["deep@x"]}
    per_user = PerUser((Limit(Period.DAY, 400), Limit(Period.TOTAL, 500)), users_max=3,
                       rate=Rate(requests_per_minute=100, concurrent_max=5))
    ops = await _operations(server.url, clock)
    store = ops.service.store
    try:
        for path in (tag, deep.path):
            await store.put_budget(BudgetDef(BudgetId.parse(path), (Limit(Period.TOTAL, 10**6),),
                                             per_user=per_user))
        await spend(store, tag, tag, 400, "alice@example.com")
        await spend(store, tag, tag, 50, "a:b:c")
        await spend(store, other, deep.path, 70, "deep@x")
        open_hold = await store.reserve(held(tag, tag, 30, long_user))
        before = {b: await all_users(store, BudgetId(b), 1_000) for b in users}
        # long_user's call is open and none of theirs charged: not listed among the budget's
        # users until one is, as the restore below does (it charges the call as unknown).
        assert [u.user for u in before[tag]] == users[tag][:2]
        long_path = f"{tag}/user:{long_user}"
        before[tag].append(UserSpend(long_user, long_path, tuple(
            leg for leg in await store.status((BudgetId(tag),), None, long_user)
            if leg.budget_id == long_path)))
        document = await ops.export(BY)
        assert users_of_export(document) == users
        counted = {c["budget_id"] for org in document["body"]["organisations"]
                   for c in org["counters"]}
        assert {BudgetId(b).user(u).path for b, us in users.items() for u in us} <= counted
        # An export whose users are not an end user's ids, or another organisation's, is
        # refused whole, its checksum right or not.
        for bad in ({"budget_id": tag, "users": ["has/slash"]},
                    {"budget_id": "org:other", "users": ["u1"]}):
            tampered = json.loads(json.dumps(document))
            tampered["body"]["organisations"][0]["users"].append(bad)
            tampered["checksum"] = checksum(tampered)
            with pytest.raises(InvalidRequest):
                await ops.restore(tampered, None, False, BY)
    finally:
        await store.close()

    raw = aioredis.Redis.from_url(server.url, decode_responses=True)
    await raw.flushall()
    ops = await _operations(server.url, clock)
    store = ops.service.store
    try:
        result = await ops.restore(document, None, False, BY)
        assert (result["users"], result["open_reservations_charged_as_unknown"]) == (4, 1)
        # Counters of spend come back without an expiry an evicting Redis could act on; the
        # windowed ones go by the sweep of their tag's windows index.
        restored = [k async for k in raw.scan_iter(match=f"{keys.prefix(tag)}{keys.COUNTER}*")]
        assert restored
        assert [await raw.pttl(k) for k in restored] == [-1] * len(restored)
        windowed = [k.removeprefix(keys.prefix(tag)) for k in restored if not k.endswith("|total")]
        assert windowed
        assert None not in [await raw.zscore(keys.prefix(tag) + keys.WINDOWS, k) for k in windowed]
        after = {b: await all_users(store, BudgetId(b), 1_000) for b in users}
        assert {b: [u.user for u in us] for b, us in after.items()} == users
        assert {leg.reserved_micros for leg in before[tag][-1].legs} == {30}  # long_user's
        for b in users:
            for was, now in zip(before[b], after[b], strict=True):
                # The open hold comes back charged as unknown: committed, no longer reserved.
                assert [(leg.window_key, leg.committed_micros, leg.reserved_micros)
                        for leg in now.legs] == [
                    (leg.window_key, leg.committed_micros + leg.reserved_micros, 0)
                    for leg in was.legs]
        # Nothing refilled: 400 of alice's 400 a day is spent, and users_max still counts three.
        with pytest.raises(BudgetExceeded):
            await store.reserve(held(tag, tag, 1, "alice@example.com"))
        with pytest.raises(UsersExhausted):
            await store.reserve(held(tag, tag, 1, "a-fourth"))
        # Rate logs and concurrency counts are not restored: the restored ledger has no open
        # reservation, and every rate starts afresh.
        transient = [k async for k in raw.scan_iter(f"{keys.prefix(tag)}{keys.RATE}*")] + [
            k async for k in raw.scan_iter(f"{keys.prefix(tag)}{keys.CONCURRENCY}*")]
        assert transient == []
        view = await store.inspect(tag, open_hold.reservation_id)
        assert view is not None
        assert view.outcome == "unknown"
    finally:
        await store.close()
        await raw.aclose()

