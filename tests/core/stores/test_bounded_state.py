"""Bounded state: nothing a caller can make the ledger keep is kept for ever.

A key holder chooses run ids, idempotency keys, model names and how many calls to make. Under
`noeviction` (which the ledger needs: an evicted counter is a refilled budget), every key those
leave behind without an expiry is memory that only an operator can give back, and a full Redis
fails every call closed for everyone. This drives 10,000 distinct run ids (and the other
caller-made state) through the service into a redis-server of its own, then reads every key
back with SCAN and PTTL: only what an operator made may be without an expiry.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from core.budgets import BudgetDef, BudgetId, Limit, Period
from core.errors import BudgetBusy, BudgetExceeded, ReservationNotFound, StateQuota
from core.ledger import ReservationRef, ReserveRequest, Role, StoredReply
from core.limits import (
    IDEMPOTENCY_WINDOW_MS,
    RECORDS_PER_KEY_PER_WINDOW_MAX,
    RECORDS_QUOTA_WINDOW_MS,
    REPLAY_WINDOW_MS,
    RESEND_WINDOW_MS,
    RESERVATION_TTL_MS_MAX,
    RESERVATION_TTL_MS_MIN,
    RUNS_PER_KEY_MAX,
    STATE_QUOTA_WINDOW_MS,
    UNKNOWN_OUTCOME_RETENTION_MS,
)
from core.prices import PriceTable
from core.replies import reply_ref
from core.service import CallSpec, CeilingService, SettleSpec
from core.stores import keys, wire
from core.stores.memory import MemoryStore
from core.stores.redis import RedisStore
from core.stores.scripts import library, script
from infra.redis_server import RedisServer
from tests.support import ManualClock

RUNS = 10_000
# Calls in flight at once: as fast as one process and a 64-connection pool go.
CONCURRENCY = 64
# One call in this many is left open (to expire), one released, one made under an
# Idempotency-Key; the rest are settled.
OPEN_EVERY, RELEASE_EVERY, IDEMPOTENT_EVERY = 10, 7, 5
MODELS = 50  # distinct model names with an output histogram
# Keys an operator makes, kept without an expiry: the ledger id, a tag's meta and budget
# definitions, the total counters of those budgets, API key records, the tag map, a tag's open-
# lease set while it has members, a tag's refusal counts (a field per error code), the users
# sets of budgets with per_user limits (at most users_max each), and the operators' catalogue
# (its audit stream is trimmed by age as it is written; the registry of function libraries holds
# as many as are kept).
OPERATOR_KEYS = re.compile(
    r"sc:ledger|sc:tags|sc:key:[0-9a-f]+|sc:keyid:key_[0-9a-f]+|sc:key:\{key_[0-9a-f]+\}"
    r"|\{sc:ledger\}:(orgs|budgets|keys|audit|restored|adopted|format|libraries)"
    r"|sc:\{(?P<tag>[^}]+)\}:(meta|open|budgets|refused|windows|runs|def:.+|u:.+|uo:.+"
    r"|p:(?P<budget>[^|]+)\|total)"
)


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
async def raw(own_redis: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
    yield client
    await client.aclose()


# A counter that holds spend: without an expiry (an evicting Redis must find none to drop), it
# goes by the sweep of its tag's index (lua/lib.lua sweep_counters).
COUNTER_KEY = re.compile(r"(?P<prefix>sc:\{[^}]+\}:)(?P<suffix>p:.+)")


async def swept(raw: aioredis.Redis, key: str) -> bool:
    """Whether `key` is a counter its tag's windows or runs index lists for the sweep."""
    counter = COUNTER_KEY.fullmatch(key)
    if counter is None:
        return False
    return any([await raw.zscore(counter["prefix"] + index, counter["suffix"]) is not None
                for index in (keys.WINDOWS, keys.RUNS)])


async def keys_without_expiry(raw: aioredis.Redis, defined: set[str]) -> list[str]:
    """Every key with no expiry that is not an operator's, nor a counter the sweep deletes."""
    found = []
    async for key in raw.scan_iter(count=1_000):
        if await raw.pttl(key) != -1 or await swept(raw, key):
            continue
        allowed = OPERATOR_KEYS.fullmatch(key)
        if allowed and allowed["budget"] is not None and allowed["budget"] not in defined:
            allowed = None  # a total counter, but not of a budget anyone defined: a run's
        if allowed is None:
            found.append(key)
    return found


def mean_bytes(sizes: list[int]) -> int:
    return round(sum(sizes) / len(sizes))


@pytest.mark.slow
async def test_10000_run_ids_leave_nothing_a_caller_made_without_an_expiry(
    own_redis: RedisServer, raw: aioredis.Redis
) -> None:
    store = RedisStore(own_redis.url)
    service = CeilingService(store, PriceTable.from_file(None))
    tag = f"org:b{uuid.uuid4().hex[:8]}"
    team = BudgetId(f"{tag}/team:t")
    await service.put_budget(BudgetDef(BudgetId(tag), (
        Limit(Period.DAY, 10**12), Limit(Period.MONTH, 10**12), Limit(Period.TOTAL, 10**12))))
    await service.put_budget(BudgetDef(team, (Limit(Period.TOTAL, 10**12),)))
    key = await service.create_key(BudgetId(f"{team}/key:k"), 1_000, frozenset(Role))
    record_ids: dict[tuple[str, Role], str] = {}
    # A gateway call's record once settled, measured at once: it is kept RESEND_WINDOW_MS.
    gateway_record_bytes: list[int] = []

    async def one_run(i: int) -> None:
        role = Role.GATEWAY if i % 2 else Role.SIDECAR
        who = await service.authenticate(key.api_key, f"run-{i}", role)
        idempotency_key = f"call-{i}" if i % IDEMPOTENT_EVERY == 0 else None
        try:
            r = await service.reserve(
                who, CallSpec(amount_micros=100, ttl_ms=RESERVATION_TTL_MS_MIN), idempotency_key)
        except BudgetBusy:
            raise AssertionError("each run holds only its own call") from None
        kind = ("open" if i % OPEN_EVERY == 0 else "released" if i % RELEASE_EVERY == 0
                else "settled")
        record_ids.setdefault((kind, role), r.reservation_id)
        if kind == "released":
            await service.release(who, r.reservation_id)
        elif kind == "settled":
            await service.settle(who, r.reservation_id, SettleSpec(actual_micros=40))
            if role is Role.GATEWAY and idempotency_key is None and not gateway_record_bytes:
                gateway_record_bytes.append(await raw.memory_usage(
                    keys.reservation(tag, r.reservation_id), samples=0) or 0)
        if idempotency_key is not None and role is Role.GATEWAY:
            ref = reply_ref(who, idempotency_key)
            claimed = await store.replies.claim(ref, "fp", "token", RESERVATION_TTL_MS_MIN)
            assert claimed.kind == "claimed"
            if i % 3:
                await store.replies.complete(ref, "token", StoredReply(200, (), "{}"),
                                             IDEMPOTENCY_WINDOW_MS)
        if i < MODELS:
            await store.observe_output(f"model-{i}", 100)

    pending = iter(range(RUNS))

    async def worker() -> None:
        for i in pending:
            await one_run(i)

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    await store.probe("instance-1")
    defined = {tag, team.path}
    who = await service.authenticate(key.api_key, "run-long", Role.SIDECAR)
    long = await service.reserve(who, CallSpec(amount_micros=100, ttl_ms=RESERVATION_TTL_MS_MAX))

    # While leases are open: records and counters under them all expire too, and a record
    # outlives its lease by the retention, so a late answer still finds it.
    assert await keys_without_expiry(raw, defined) == []
    # A run's counter goes RUN_COUNTER_IDLE_MS after its last write: the runs index says when.
    run_counter = f"p:{team}/key:k/run:run-long|total"
    seen_ms = await raw.zscore(keys.prefix(tag) + keys.RUNS, run_counter)
    assert seen_ms is not None
    assert abs(seen_ms - await store.ledger_time_ms()) < 60_000
    open_record = f"sc:{{{tag}}}:r:{long.reservation_id}"
    assert UNKNOWN_OUTCOME_RETENTION_MS + RESERVATION_TTL_MS_MAX - 60_000 < await raw.pttl(
        open_record) <= UNKNOWN_OUTCOME_RETENTION_MS + RESERVATION_TTL_MS_MAX
    await service.release(who, long.reservation_id)

    # Measured, for the README's sizing: one run's counter, one resolved reservation record. A
    # sidecar's records are keys of their own, kept for the idempotency window; a gateway call's
    # is one only while it is open or its outcome unknown (test_redis.py measures the rest).
    run_counters = [f"sc:{{{tag}}}:p:{team}/key:k/run:run-{i}|total" for i in range(1, 201)]
    records = [keys.reservation(tag, rid) for (kind, role), rid in record_ids.items()
               if role is Role.SIDECAR or kind == "open"]
    settled_record = keys.reservation(tag, record_ids["settled", Role.SIDECAR])
    # samples=0: every field counted, not an estimate from a sample of them.
    counter_bytes = mean_bytes([await raw.memory_usage(k, samples=0) or 0 for k in run_counters])
    record_bytes = await raw.memory_usage(settled_record, samples=0) or 0
    assert await raw.exists(*records) == len(records) == 3
    assert 0 < await raw.pttl(settled_record) <= IDEMPOTENCY_WINDOW_MS
    assert 0 < counter_bytes < 1_000
    assert 0 < record_bytes < 2_000
    assert 0 < gateway_record_bytes[0] < 1_000

    # Once the leases have run out, expiry resolves them, and the open-lease set goes with them.
    await asyncio.sleep(RESERVATION_TTL_MS_MIN / 1000)
    while await store.expire(tag, 1_000):
        pass
    assert not await raw.exists(f"sc:{{{tag}}}:open")
    assert await keys_without_expiry(raw, defined) == []
    run_keys = [k async for k in raw.scan_iter(match=f"sc:{{{tag}}}:p:*run:*", count=1_000)]
    # A run that spent nothing (its one call released, as run-long's was) is not kept.
    released = sum(1 for i in range(RUNS) if i % OPEN_EVERY and i % RELEASE_EVERY == 0)
    assert len(run_keys) == RUNS - released
    info = await raw.info("memory")
    print(f"\nbounded state: {RUNS} run ids, {await raw.dbsize()} keys, none a caller made "
          f"without an expiry; bytes (MEMORY USAGE) per run counter {counter_bytes}, per "
          f"settled reservation record {record_bytes}, per settled gateway call's record "
          f"(kept RESEND_WINDOW_MS) {gateway_record_bytes[0]}; used_memory "
          f"{info['used_memory']}")
    await store.close()


# -- what calls that spend nothing leave, and each key's quota ------------------------------------

# The measurement from outside: zero-spend requests, and what of them may outlive a replay.
ZERO_SPEND_CALLS = 3_000
KEPT_PAST_MS = 15 * 60_000
# At most this share of them may leave a key living past KEPT_PAST_MS (the key's quota hashes).
KEPT_PAST_SHARE_MAX = 0.01


@pytest.mark.slow
async def test_calls_that_spend_nothing_leave_nothing_past_a_replay(
    own_redis: RedisServer, raw: aioredis.Redis
) -> None:
    """Half gateway calls, each under a fresh run id, that the provider refused (released), half
    sidecar reservations of 1 micro-dollar released: nothing was spent, so nothing is kept past
    the replay window but the key's quota."""
    store = RedisStore(own_redis.url)
    service = CeilingService(store, PriceTable.from_file(None))
    tag = f"org:z{uuid.uuid4().hex[:8]}"
    await service.put_budget(BudgetDef(BudgetId(tag), (
        Limit(Period.DAY, 10**9), Limit(Period.MONTH, 10**9), Limit(Period.TOTAL, 10**9))))
    key = await service.create_key(BudgetId(f"{tag}/key:k"), 1_000, frozenset(Role))
    before = {k async for k in raw.scan_iter(count=1_000)}

    async def one(i: int) -> None:
        gateway = i % 2 == 0
        who = await service.authenticate(key.api_key, f"run-{i}" if gateway else None,
                                         Role.GATEWAY if gateway else Role.SIDECAR)
        r = await service.reserve(who, CallSpec(amount_micros=100 if gateway else 1))
        await service.release(who, r.reservation_id)

    pending = iter(range(ZERO_SPEND_CALLS))

    async def worker() -> None:
        for i in pending:
            await one(i)

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    made = [k async for k in raw.scan_iter(count=1_000) if k not in before]
    long_lived = [k for k in made if (ttl := await raw.pttl(k)) == -1 or ttl > KEPT_PAST_MS]
    print(f"\nzero spend: {ZERO_SPEND_CALLS} calls, {len(made)} keys made, "
          f"{len(long_lived)} living past {KEPT_PAST_MS // 60_000} min: {sorted(long_lived)}")
    assert len(long_lived) <= ZERO_SPEND_CALLS * KEPT_PAST_SHARE_MAX
    # The budget's own period counters (one per window, whatever the calls), the index the sweep
    # deletes its windows by, and the key's quota.
    assert all(k.startswith((keys.prefix(tag) + keys.QUOTA, keys.counter(tag, tag, "")))
               or k == keys.prefix(tag) + keys.WINDOWS for k in long_lived), long_lived
    await store.close()


@pytest.mark.slow
async def test_a_key_opens_at_most_its_quota_of_runs_a_window(
    own_redis: RedisServer, raw: aioredis.Redis
) -> None:
    """RUNS_PER_KEY_MAX runs that each spent a micro-dollar, then one more: refused 429
    state_quota, counted in the same script that opens a run, whatever the concurrency. A call in
    a run already open, and a replay, still pass."""
    store = RedisStore(own_redis.url)
    service = CeilingService(store, PriceTable.from_file(None))
    tag = f"org:q{uuid.uuid4().hex[:8]}"
    await service.put_budget(BudgetDef(BudgetId(tag), (Limit(Period.TOTAL, 10**12),)))
    key = await service.create_key(BudgetId(f"{tag}/key:k"), 1_000, frozenset(Role))
    pending = iter(range(RUNS_PER_KEY_MAX + CONCURRENCY))
    refused: list[StateQuota] = []

    async def worker() -> None:
        for i in pending:
            who = await service.authenticate(key.api_key, f"run-{i}", Role.SIDECAR)
            try:
                r = await service.reserve(who, CallSpec(amount_micros=1))
            except StateQuota as exc:
                refused.append(exc)
                continue
            await service.settle(who, r.reservation_id, SettleSpec(actual_micros=1))

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    run_keys = [k async for k in raw.scan_iter(match=f"sc:{{{tag}}}:p:*run:*", count=1_000)]
    assert len(run_keys) == RUNS_PER_KEY_MAX
    assert len(refused) == CONCURRENCY
    assert refused[0].details["quota"] == "runs"
    assert 0 < refused[0].details["retry_after_s"] <= STATE_QUOTA_WINDOW_MS // 1_000
    who = await service.authenticate(key.api_key, "run-0", Role.SIDECAR)
    await service.reserve(who, CallSpec(amount_micros=1))  # a run already open
    await store.close()


# -- a busy key is not a hostile key -------------------------------------------------------------

# Issue 35: one sidecar key doing reserve -> settle honestly, 150,000 times, was refused 50,000 of
# them (429 state_quota). A key at 10 calls a second (CALL_INTERVAL_MS) keeps its calls' records
# for the replay window only: what it keeps is its rate times minutes, and it is never refused.
BUSY_PAIRS = 150_000
CALL_INTERVAL_MS = 100
# Scripts sent in one pipeline: as fast as one connection goes, in memory a client holds easily.
PIPELINE_CALLS = 2_000


@pytest.mark.slow
async def test_a_busy_key_is_never_refused_and_keeps_its_rate_times_the_replay_window(
    own_redis: RedisServer, raw: aioredis.Redis
) -> None:
    """150,000 reserve -> settle pairs of one sidecar key (ids the ledger minted), the scripts
    sent as the store sends them, pipelined, the ledger's time moved 100 ms a pair by now_ms: 0
    refused; each settled record is kept REPLAY_WINDOW_MS (by Redis' own clock, which the
    injected one does not move: its PTTL and bytes are measured), and the key's quota counts
    only the records window, far below its bound."""
    # From the wall clock's now: the quota hash expires at an instant of the ledger's time.
    clock = ManualClock(int(time.time() * 1000))
    store = RedisStore(own_redis.url, clock=clock)
    ledger_id = await store.open()
    tag = f"org:busy{uuid.uuid4().hex[:8]}"
    await store.put_budget(BudgetDef(BudgetId(tag), (Limit(Period.TOTAL, 10**15),)))
    await raw.function_load(library().source, replace=True)
    reserve, settle = script("reserve").function, script("settle").function
    assert reserve is not None
    assert settle is not None
    owner, tail = "key_busy", wire.record_tail("", "v", "m")
    answers: dict[str, int] = {}
    started = time.monotonic()
    for first in range(0, BUSY_PAIRS, PIPELINE_CALLS // 2):
        pipe = raw.pipeline(transaction=False)
        for i in range(first, min(first + PIPELINE_CALLS // 2, BUSY_PAIRS)):
            rid = f"{i:032x}"
            record_keys = (keys.meta(tag), keys.reservation(tag, rid), keys.open_leases(tag))
            now = str(clock.now_ms)
            pipe.fcall(reserve, 3, *record_keys, *wire.arguments(
                wire.RESERVE_ARGS, ledger_id=ledger_id, reserved_micros="100", ttl_ms="60000",
                budget_ids=tag, run="", zones="", expire_policy="charge",
                retention_ms=str(REPLAY_WINDOW_MS), owner=owner, record_tail=tail, user="",
                model="", now_ms=now))
            pipe.fcall(settle, 3, *record_keys, *wire.arguments(
                wire.SETTLE_ARGS, owner=owner, actual_micros="40", upstream="", now_ms=now))
            clock.advance(CALL_INTERVAL_MS)
        for reply in await pipe.execute(raise_on_error=False):
            kind = str(reply[0]) if isinstance(reply, list) else repr(reply)
            answers[kind] = answers.get(kind, 0) + 1
    took_s = time.monotonic() - started
    assert answers == {"ok": 2 * BUSY_PAIRS}, answers
    total = (await store.status((BudgetId(tag),)))[0]
    assert (total.committed_micros, total.reserved_micros) == (40 * BUSY_PAIRS, 0)

    last = keys.reservation(tag, f"{BUSY_PAIRS - 1:032x}")
    record_bytes = await raw.memory_usage(last, samples=0) or 0
    assert 0 < await raw.pttl(last) <= REPLAY_WINDOW_MS
    quota = await raw.hgetall(keys.quota(tag, owner))
    # The current records window's calls (at most 10 minutes' at 10 a second), nothing of the
    # day counted.
    assert 0 < int(quota["recent"]) <= RECORDS_QUOTA_WINDOW_MS // CALL_INTERVAL_MS
    assert int(quota.get("records", "0")) == 0
    kept_calls = REPLAY_WINDOW_MS // CALL_INTERVAL_MS
    print(f"\nbusy key: {BUSY_PAIRS} reserve -> settle pairs in {took_s:.1f} s, 0 refused; a "
          f"settled record {record_bytes} B (MEMORY USAGE), kept {REPLAY_WINDOW_MS // 60_000} "
          f"min: at 10 calls/s a key keeps {kept_calls} of them, ~{kept_calls * record_bytes} B; "
          f"at its bound ({RECORDS_PER_KEY_PER_WINDOW_MAX} a window, 4 windows live) "
          f"~{4 * RECORDS_PER_KEY_PER_WINDOW_MAX * record_bytes // 1_000_000} MB")
    assert record_bytes < 400
    await store.close()


async def test_a_busy_key_keeps_only_its_last_replay_window_of_records(
    clock: ManualClock,
) -> None:
    """The same busy key on the memory store, whose keys expire by the injected clock: after
    two hours of calls at 10 a second, the records kept are the last replay window's."""
    store = MemoryStore(clock=clock)
    await store.open()
    tag = f"org:busy{uuid.uuid4().hex[:8]}"
    await store.put_budget(BudgetDef(BudgetId(tag), (Limit(Period.TOTAL, 10**15),)))
    calls = 2 * 3_600_000 // CALL_INTERVAL_MS // 10  # two hours at 1 a second: fakeredis is slow
    interval_ms = 10 * CALL_INTERVAL_MS
    for _ in range(calls):
        r = await store.reserve(ReserveRequest(
            ReservationRef(tag, uuid.uuid4().hex, "key_busy"), (BudgetId(tag),), 100, 60_000,
            "", "v", "m", retention_ms=REPLAY_WINDOW_MS))
        await store.settle(ReservationRef(tag, r.reservation_id, "key_busy"), 40)
        clock.advance(interval_ms)
    kept = await store._t.execute("KEYS", keys.reservation(tag, "*"))
    assert len(kept) == REPLAY_WINDOW_MS // interval_ms
    # A settle resent past the window finds no record and moves no money; the id was minted for
    # one call, so nothing else can be held under it.
    first = await store.reserve(ReserveRequest(
        ReservationRef(tag, "gone", "key_busy"), (BudgetId(tag),), 100, 60_000, "", "v", "m",
        retention_ms=REPLAY_WINDOW_MS))
    await store.settle(ReservationRef(tag, first.reservation_id, "key_busy"), 40)
    clock.advance(REPLAY_WINDOW_MS + 1)
    before = await store.status((BudgetId(tag),))
    with pytest.raises(ReservationNotFound):
        await store.settle(ReservationRef(tag, first.reservation_id, "key_busy"), 40)
    assert await store.status((BudgetId(tag),)) == before
    await store.close()


# -- an evicting Redis ---------------------------------------------------------------------------

# Issue 35: under volatile-lru another team's keys filled memory and the day counter that held the
# spend (it carried an expiry) was evicted: 82 more calls were admitted. The counters now carry
# none. A Redis this small, then filled with other keys that expire, twice over.
EVICTING_MAXMEMORY = "8mb"
FILLER_BYTES = 1_000
FILLER_KEYS = 16_000


@pytest.mark.parametrize("policy", ["volatile-lru", "volatile-ttl", "volatile-random"])
async def test_an_evicting_redis_finds_no_counter_of_spend_to_drop(policy: str) -> None:
    with RedisServer(extra_args=("--maxmemory", EVICTING_MAXMEMORY,
                                 "--maxmemory-policy", policy)) as server:
        raw = aioredis.Redis.from_url(server.url, decode_responses=True)
        store = RedisStore(server.url)
        service = CeilingService(store, PriceTable.from_file(None))
        tag = f"org:e{uuid.uuid4().hex[:8]}"
        await service.put_budget(BudgetDef(BudgetId(tag), (
            Limit(Period.DAY, 10_000), Limit(Period.MONTH, 10**9), Limit(Period.TOTAL, 10**9))))
        key = await service.create_key(BudgetId(f"{tag}/key:k"), 10**6, frozenset(Role))
        who = await service.authenticate(key.api_key, "run-1", Role.SIDECAR)
        for _ in range(5):
            r = await service.reserve(who, CallSpec(amount_micros=2_000))
            await service.settle(who, r.reservation_id, SettleSpec(actual_micros=1_000))
        counters = [k async for k in raw.scan_iter(match=f"sc:{{{tag}}}:p:*")]
        assert len(counters) == 4  # the org's day, month and total, the run's
        before = await store.status(BudgetId(f"{tag}/key:k").lineage)
        for first in range(0, FILLER_KEYS, 1_000):
            pipe = raw.pipeline(transaction=False)
            for i in range(first, first + 1_000):
                pipe.set(f"other-team:{i}", "x" * FILLER_BYTES, ex=3_600)
            await pipe.execute()
        evicted = int((await raw.info("stats"))["evicted_keys"])
        assert evicted > FILLER_KEYS // 2
        assert [await raw.exists(k) for k in counters] == [1] * len(counters)
        assert await store.status(BudgetId(f"{tag}/key:k").lineage) == before
        # The day's 5,000 of 10,000 spent stays spent: 6,000 more is refused.
        with pytest.raises(BudgetExceeded):
            await service.reserve(who, CallSpec(amount_micros=6_000))
        print(f"\nevicting redis ({policy}, maxmemory {EVICTING_MAXMEMORY}): {evicted} other "
              f"keys evicted, {len(counters)} counters of spend all kept")
        await store.close()
        await raw.aclose()


@pytest.mark.slow
async def test_a_key_faster_than_its_records_rate_is_refused_until_the_window_ends(
    own_redis: RedisServer, raw: aioredis.Redis
) -> None:
    """RECORDS_PER_KEY_PER_WINDOW_MAX sidecar reserves under minted ids in one records window
    (pipelined, the ledger's time held still), then one more: 429 state_quota 'records', retry
    after the window ends; the next window admits again. Calls under an Idempotency-Key count by
    the day instead, and gateway calls not at all."""
    clock = ManualClock(int(time.time() * 1000) // RECORDS_QUOTA_WINDOW_MS
                        * RECORDS_QUOTA_WINDOW_MS)  # a window's first instant
    store = RedisStore(own_redis.url, clock=clock)
    ledger_id = await store.open()
    tag = f"org:fast{uuid.uuid4().hex[:8]}"
    await store.put_budget(BudgetDef(BudgetId(tag), (Limit(Period.TOTAL, 10**15),)))
    await raw.function_load(library().source, replace=True)
    reserve = script("reserve").function
    assert reserve is not None
    owner = "key_fast"
    answers: dict[str, int] = {}
    for first in range(0, RECORDS_PER_KEY_PER_WINDOW_MAX, PIPELINE_CALLS):
        pipe = raw.pipeline(transaction=False)
        for i in range(first, min(first + PIPELINE_CALLS, RECORDS_PER_KEY_PER_WINDOW_MAX)):
            pipe.fcall(reserve, 3, keys.meta(tag), keys.reservation(tag, f"{i:032x}"),
                       keys.open_leases(tag), *wire.arguments(
                           wire.RESERVE_ARGS, ledger_id=ledger_id, reserved_micros="1",
                           ttl_ms="60000", budget_ids=tag, run="", zones="",
                           expire_policy="charge", retention_ms=str(REPLAY_WINDOW_MS),
                           owner=owner, record_tail=wire.record_tail("", "v", "m"), user="",
                           model="", now_ms=str(clock.now_ms)))
        for reply in await pipe.execute():
            answers[str(reply[0])] = answers.get(str(reply[0]), 0) + 1
    assert answers == {"ok": RECORDS_PER_KEY_PER_WINDOW_MAX}
    one_more = ReserveRequest(ReservationRef(tag, "one-more", owner), (BudgetId(tag),), 1,
                              60_000, "", "v", "m", retention_ms=REPLAY_WINDOW_MS)
    with pytest.raises(StateQuota) as refused:
        await store.reserve(one_more)
    assert refused.value.details["quota"] == "records"
    assert refused.value.details["retry_after_s"] == RECORDS_QUOTA_WINDOW_MS // 1_000
    # A gateway call keeps no record past a resend: it counts in no quota.
    await store.reserve(ReserveRequest(ReservationRef(tag, "gw", owner), (BudgetId(tag),), 1,
                                       60_000, "", "v", "m", retention_ms=RESEND_WINDOW_MS))
    clock.advance(RECORDS_QUOTA_WINDOW_MS)
    await store.reserve(one_more)
    await store.close()
