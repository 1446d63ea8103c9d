"""What only a sharded cluster can show: where tags land, that a call stays in its slot, failover.

The conformance suite, the state machine and the cross-process count run on the cluster too
(tests/plugins/cluster.py registers it); this file covers what a single Redis cannot get wrong.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis import exceptions as rex
from redis.crc import key_slot

from core.budgets import BudgetId, Period
from core.errors import InvariantBroken, LedgerUnavailable, ReservationResolved
from core.ledger import LedgerStore, Reservation, ReservationRef, ReservationState, RunLimit
from core.stores import keys
from core.stores.redis import ConnectionTornDown
from core.stores.redis_cluster import (
    RedisClusterStore,
    RedisClusterTransport,
    hash_tag,
    redis_cluster_client,
    translate_cluster,
)
from core.stores.scripts import Script, script
from infra.redis_cluster import LocalCluster
from infra.redis_server import RedisServer
from tests.core.stores.test_conformance import OWNER, TTL_MS, leg, put, request
from tests.support import ManualClock

SPREAD_TAGS = 60
# Calls keep running through the failover; the pause between one worker's calls only keeps their
# number small enough to audit every reservation afterwards.
FAILOVER_WORKERS = 4
FAILOVER_CALL_PAUSE_S = 0.02
TRAFFIC_BEFORE_KILL_S = 0.3
TRAFFIC_AFTER_FAILOVER_S = 0.5


@pytest.fixture
async def cluster_store(
    redis_cluster: LocalCluster, clock: ManualClock
) -> AsyncIterator[RedisClusterStore]:
    store = RedisClusterStore(redis_cluster.url, clock=clock)
    await store.open()
    yield store
    await store.close()


@pytest.fixture
async def transport(redis_cluster: LocalCluster) -> AsyncIterator[RedisClusterTransport]:
    t = RedisClusterTransport(redis_cluster_client(redis_cluster.url))
    yield t
    await t.close()


def tag_on(cluster: LocalCluster, master: RedisServer, prefix: str, *, not_with: str = "") -> str:
    """A tag, named from `prefix`, whose slot `master` owns (and not the slot of `not_with`)."""
    taken = key_slot(keys.meta(not_with).encode()) if not_with else None
    return next(
        t
        for t in (f"{prefix}-{i}" for i in range(10_000))
        if key_slot(keys.meta(t).encode()) != taken
        and cluster.holder_of_key(keys.meta(t)).port == master.port
    )


def strict(name: str) -> Script:
    """A ledger script with flags declared: Redis 7 then refuses any key outside the slot of the
    call's keys, even one on the same node (a script without flags may touch those)."""
    source = f"#!lua\n{script(name).source}"
    return Script(name, source, hashlib.sha1(source.encode()).hexdigest())  # noqa: S324


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("sc:{org:acme}:meta", "org:acme"),
        ("sc:{org:acme}:p:{x}", "org:acme"),
        ("sc:ledger", None),
        ("sc:{}:meta", None),
        ("sc:{org:acme", None),
    ],
)
def test_the_hash_tag_is_what_redis_cluster_hashes(key: str, expected: str | None) -> None:
    assert hash_tag(key) == expected


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (rex.ClusterDownError("CLUSTERDOWN The cluster is down"), "ledger_unreachable"),
        (rex.MasterDownError("Link with MASTER is down"), "ledger_unreachable"),
        (rex.MovedError("3999 127.0.0.1:6381"), "ledger_unreachable"),
        (rex.AskError("3999 127.0.0.1:6381"), "ledger_unreachable"),
        (rex.TryAgainError("TRYAGAIN"), "ledger_unreachable"),
        (rex.ClusterError("TTL exhausted."), "ledger_unreachable"),
        (rex.SlotNotCoveredError("slot 42 is not covered"), "ledger_unreachable"),
        (rex.RedisClusterException("Redis Cluster cannot be connected"), "ledger_unreachable"),
        (rex.MaxConnectionsError(), "ledger_unreachable"),
        (TimeoutError(), "ledger_unreachable"),
        (rex.TimeoutError("Timeout reading from 127.0.0.1:6381"), "ledger_unreachable"),
        (rex.ConnectionError("Error 111 connecting to 127.0.0.1:6381"), "ledger_unreachable"),
        (ConnectionTornDown("TypeError: 'NoneType' object is not callable"), "ledger_unreachable"),
        (rex.AuthenticationError("invalid username-password pair"), "ledger_auth"),
        (rex.ResponseError("WRONGTYPE Operation against a key"), "ledger_error"),
        (rex.ReadOnlyError("You can't write against a read only replica."), "ledger_error"),
        (rex.ClusterCrossSlotError("Keys in request don't hash to the same slot"), "invariant"),
        (rex.ResponseError("Script attempted to access a non local key"), "invariant"),
        (rex.ResponseError("Script attempted to access keys that do not hash to the same slot"),
         "invariant"),
        (rex.ResponseError("BADARG amount_micros"), "invariant"),
        (rex.DataError("Invalid input of type: 'NoneType'"), "invariant"),
    ],
)
def test_client_errors_become_core_errors(exc: Exception, expected: str) -> None:
    error = translate_cluster(exc)
    if expected == "invariant":
        assert type(error) is InvariantBroken
    else:
        assert isinstance(error, LedgerUnavailable)
        assert error.reason == expected


async def test_the_tags_of_many_orgs_spread_over_every_master(
    redis_cluster: LocalCluster, cluster_store: RedisClusterStore, tag: str
) -> None:
    tags = [f"{tag}-{i}" for i in range(SPREAD_TAGS)]
    for t in tags:
        await put(cluster_store, t, (Period.TOTAL, 1_000))
    masters = redis_cluster.masters()
    assert len(masters) == 3
    found: dict[str, int] = {}
    for master in masters:
        # Straight to each master, not through the cluster client: what it really stores.
        direct = aioredis.Redis(host="127.0.0.1", port=master.port, decode_responses=True)
        async for key in direct.scan_iter(match=f"sc:{{{tag}-*", count=1_000):
            found[str(hash_tag(key))] = master.port
        await direct.aclose()
    assert sorted(found) == sorted(tags)
    assert set(found.values()) == {m.port for m in masters}, "every master holds some tags"
    for t, port in found.items():
        assert redis_cluster.holder_of_key(keys.meta(t)).port == port


async def test_every_script_of_a_call_stays_in_the_slot_of_its_tag(
    redis_cluster: LocalCluster,
    cluster_store: RedisClusterStore,
    clock: ManualClock,
    tag: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each protocol's part of the store looks its scripts up in its own module.
    for part in ("core", "ledger", "catalogue", "keys", "reports", "replies"):
        monkeypatch.setattr(f"core.stores.scripted_{part}.script", strict)
    tags = [
        tag_on(redis_cluster, master, f"{tag}-{master.port}-{n}")
        for master in redis_cluster.masters()
        for n in range(2)
    ]
    for t in tags:
        # Budgets at two depths, one a month, and a run budget: keys the scripts build in Lua.
        await put(cluster_store, t, (Period.DAY, 10_000), (Period.TOTAL, 10_000))
        await put(cluster_store, f"{t}/team:a", (Period.MONTH, 10_000))
        path = f"{t}/team:a/key:k"
        run = RunLimit(BudgetId(path).run("r1"), 10_000)
        settled = await cluster_store.reserve(request(t, path, 100, run=run))
        released = await cluster_store.reserve(request(t, path, 200))
        expiring = await cluster_store.reserve(request(t, path, 300))
        await cluster_store.settle(ReservationRef(t, settled.reservation_id, OWNER), 90)
        await cluster_store.release(ReservationRef(t, released.reservation_id, OWNER))
        clock.advance(TTL_MS + 1)
        assert await cluster_store.expire(t, 10) == 1
        legs = await cluster_store.status(BudgetId(path).lineage, run)
        # Expiry charges what it held: 90 settled + 300 expired; the run saw only the first.
        assert [(x.budget_id, x.committed_micros, x.reserved_micros) for x in legs] == [
            (t, 390, 0), (t, 390, 0), (f"{t}/team:a", 390, 0), (run.budget_id.path, 90, 0)
        ]
        view = await cluster_store.reservation(ReservationRef(t, expiring.reservation_id, OWNER))
        assert view is not None
        assert view.state is ReservationState.EXPIRED


async def test_a_key_outside_the_slot_is_refused_as_a_programmer_error(
    redis_cluster: LocalCluster, transport: RedisClusterTransport, tag: str
) -> None:
    # The controls that show the test above could fail: each call reaches outside its slot.
    master = redis_cluster.masters()[0]
    home = tag_on(redis_cluster, master, f"{tag}-home")
    same_node = tag_on(redis_cluster, master, f"{tag}-near", not_with=home)
    other = next(m for m in redis_cluster.masters() if m.port != master.port)
    other_node = tag_on(redis_cluster, other, f"{tag}-far")
    touch = "return redis.call('GET', '{key}')"
    cases = [
        # Declared flags: another slot of the same node is refused too.
        f"#!lua\n{touch.format(key=keys.meta(same_node))}",
        # No flags: another node's key is refused.
        touch.format(key=keys.meta(other_node)),
    ]
    for source in cases:
        rogue = Script("rogue", source, hashlib.sha1(source.encode()).hexdigest())  # noqa: S324
        with pytest.raises(InvariantBroken, match="two slots"):
            await transport.run(rogue, [keys.meta(home)], [])
    # Keys of two tags never leave the transport.
    with pytest.raises(InvariantBroken, match="one hash tag"):
        await transport.run(script("expire"), [keys.meta(home), keys.open_leases(other_node)], [])


async def test_durable_only_when_every_master_persists(
    redis_cluster: LocalCluster, transport: RedisClusterTransport
) -> None:
    assert (await transport.durability()).durable is True
    lax = aioredis.Redis(
        host="127.0.0.1", port=redis_cluster.masters()[-1].port, decode_responses=True
    )
    await lax.config_set("appendonly", "no")
    try:
        assert (await transport.durability()).durable is False
    finally:
        await lax.config_set("appendonly", "yes")
        await lax.aclose()
    assert (await transport.durability()).durable is True


async def test_a_master_failover_fails_closed_then_resumes_without_double_counting(
    redis_cluster: LocalCluster, clock: ManualClock, tag: str
) -> None:
    victim = redis_cluster.masters()[0]
    assert redis_cluster.replicas_of(victim), "a replica is there to take over"
    t = tag_on(redis_cluster, victim, tag)
    store = RedisClusterStore(redis_cluster.url, clock=clock)
    await put(store, t, (Period.TOTAL, 10**9))
    attempted: list[ReservationRef] = []
    reserved: list[ReservationRef] = []  # acknowledged
    settled: list[ReservationRef] = []  # acknowledged
    refusals: list[tuple[float, str]] = []  # when each call that failed closed started, why
    stop = asyncio.Event()

    async def worker(w: int) -> None:
        for i in itertools.count():
            if stop.is_set():
                return
            ref = ReservationRef(t, f"w{w}-{i}", OWNER)
            attempted.append(ref)
            started = time.monotonic()
            try:
                await store.reserve(request(t, t, 1, rid=ref.reservation_id))
                reserved.append(ref)
                await store.settle(ref, 1)
                settled.append(ref)
            except LedgerUnavailable as exc:
                refusals.append((started, exc.reason))
            await asyncio.sleep(FAILOVER_CALL_PAUSE_S)

    workers = [asyncio.create_task(worker(w)) for w in range(FAILOVER_WORKERS)]
    try:
        await asyncio.sleep(TRAFFIC_BEFORE_KILL_S)
        reserved_before_kill = len(reserved)
        redis_cluster.kill(victim)
        await asyncio.to_thread(redis_cluster.wait_settled)
        promoted_at = time.monotonic()
        reserved_at_promotion = len(reserved)
        await asyncio.sleep(TRAFFIC_AFTER_FAILOVER_S)
    finally:
        stop.set()
        await asyncio.gather(*workers)
        await asyncio.to_thread(redis_cluster.revive, victim)

    assert reserved_before_kill > 0
    assert refusals, "calls to the dead master's slot failed closed during the failover"
    assert {reason for _, reason in refusals} == {"ledger_unreachable"}
    assert all(s < promoted_at for s, _ in refusals), "none failed once a replica took over"
    assert len(reserved) > reserved_at_promotion, "calls resumed after the failover"

    views = await asyncio.gather(*(store.reservation(r) for r in attempted))
    state_of = {r: v.state if v else None for r, v in zip(attempted, views, strict=True)}
    states = list(state_of.values())
    total = await leg(store, t)
    # Each reservation the ledger holds is counted once, whatever was retried or replayed.
    assert total.committed_micros == states.count(ReservationState.SETTLED)
    assert total.reserved_micros == states.count(ReservationState.OPEN)
    # Replication is asynchronous: only a write acknowledged in the instant before the kill, at
    # most one per worker, may be missing from the promoted replica.
    lost = [r for r in reserved if state_of[r] is None]
    lost += [r for r in settled if state_of[r] not in (None, ReservationState.SETTLED)]
    assert len(lost) <= FAILOVER_WORKERS
    # A retry of an acknowledged reservation is answered from its record, not counted again:
    # the hold if it is still open, what became of it if it is not.
    replays = await asyncio.gather(
        *(store.reserve(request(t, t, 1, rid=r.reservation_id)) for r in reserved if state_of[r]),
        return_exceptions=True,
    )
    kept = [r for r in reserved if state_of[r]]
    for ref, replay in zip(kept, replays, strict=True):
        if state_of[ref] is ReservationState.OPEN:
            assert isinstance(replay, Reservation)
            assert replay.replayed
        else:
            assert isinstance(replay, ReservationResolved)
            assert replay.details["state"] == state_of[ref]
    assert await leg(store, t) == total
    await store.close()


async def test_a_wiped_shard_reads_as_reset_for_its_organisations_and_restore_brings_them_back(
    redis_cluster: LocalCluster, cluster_store: RedisClusterStore, tag: str
) -> None:
    """Issue 17: one master loses its data (FLUSHALL, as a replaced node without persistence)
    while the ledger id lives on another. Its organisations read `ledger_reset`, not "no
    budget", and putting their budgets again is refused (it would refill them); the others
    serve on. A forced restore of the last export brings them back under a new ledger id."""
    from core.operations import Operations
    from core.prices import PriceTable
    from core.service import CeilingService
    from core.stores.operations import ScriptedCatalogue

    home = redis_cluster.holder_of_key(keys.LEDGER_ID_KEY)
    wiped = next(m for m in redis_cluster.masters() if m.port != home.port)
    lost = tag_on(redis_cluster, wiped, f"{tag}-lost")
    kept = tag_on(redis_cluster, home, f"{tag}-kept")
    assert key_slot(keys.ORGS_KEY.encode()) == key_slot(keys.LEDGER_ID_KEY.encode())
    ops = Operations(CeilingService(cluster_store, PriceTable.from_file(None)),
                     ScriptedCatalogue(cluster_store))
    for t in (lost, kept):
        await put(cluster_store, t, (Period.TOTAL, 1_000))
        await cluster_store.reserve(request(t, t, 100))
    document = await ops.export("admin:test")

    direct = aioredis.Redis(host="127.0.0.1", port=wiped.port)
    await direct.flushall()
    await direct.aclose()

    with pytest.raises(LedgerUnavailable) as refused:
        await cluster_store.reserve(request(lost, lost, 100))
    assert (refused.value.reason, refused.value.details["organisation"]) == ("ledger_reset", lost)
    with pytest.raises(LedgerUnavailable):
        await put(cluster_store, lost, (Period.TOTAL, 1_000))  # would refill it
    with pytest.raises(LedgerUnavailable):
        await cluster_store.get_budget(BudgetId(lost))
    assert (await cluster_store.reserve(request(kept, kept, 100))).legs[0].reserved_micros == 200

    await ops.restore(document, None, True, "admin:test")
    for t, committed, reserved in ((lost, 100, 0), (kept, 0, 200)):
        # lost: its open hold back, charged as unknown; kept: as the ledger has it (the export's
        # open reservation is still open there, and held once).
        got = await leg(cluster_store, t)
        assert (got.committed_micros, got.reserved_micros) == (committed, reserved), t
    assert (await cluster_store.reserve(request(lost, lost, 100))).legs[0].committed_micros == 100


async def test_export_restore_export_on_a_cluster_is_the_document_it_restored(
        redis_cluster: LocalCluster) -> None:
    """Organisations on every master, the catalogue on one: what a wiped cluster takes back."""
    from core.operations import Operations
    from core.prices import PriceTable
    from core.service import CeilingService
    from core.stores.operations import ScriptedCatalogue
    from tests.core.stores.test_restore_atomic import assert_export_restore_export

    stores: list[RedisClusterStore] = []

    async def opened() -> tuple[LedgerStore, Operations]:
        store = RedisClusterStore(redis_cluster.url, clock=ManualClock())
        await store.open()
        stores.append(store)
        return store, Operations(CeilingService(store, PriceTable.from_file(None)),
                                 ScriptedCatalogue(store))

    async def wipe() -> None:
        for master in redis_cluster.masters():
            direct = aioredis.Redis(host="127.0.0.1", port=master.port)
            await direct.flushall()
            await direct.aclose()

    try:
        await assert_export_restore_export(opened, wipe)
    finally:
        for s in stores:
            await s.close()
