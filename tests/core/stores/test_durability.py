"""The ledger against the Redis teams run: replicas that lag, snapshots, eviction.

Real redis-server processes on loopback ports, stopped by pid. A primary's failover happens
behind one endpoint (infra/redis_server.py Forwarder), as a managed Redis' does, while the same
store keeps serving. Money is judged by reading Redis itself.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from core.budgets import Period
from core.config import WAIT_TIMEOUT_MS_DEFAULT, ConfigError, load
from core.errors import LedgerUnavailable
from core.ledger import LegStatus
from core.outage import OutageAllowance
from core.stores import keys, scripted_core
from core.stores.durability import Durability, durability_of
from core.stores.memory import MemoryStore
from core.stores.operations import ScriptedCatalogue
from core.stores.redis import RedisStore
from infra.redis_server import Forwarder, RedisServer
from tests.core.stores.test_conformance import leg, put, request
from tests.support import ManualClock

# How long a replica gets to catch up with its primary before a test stalls it.
SYNC_TIMEOUT_S = 10.0
# How long a reserve waits for its replica: on a loaded machine a replica behind a Python
# forwarder may take tens of milliseconds to acknowledge.
WAIT_TIMEOUT_MS = 500


def synced(primary: RedisServer, replica: RedisServer) -> None:
    """Wait until the replica has every write the primary has."""
    p, r = redis.Redis(port=primary.port), redis.Redis(port=replica.port)
    deadline = time.monotonic() + SYNC_TIMEOUT_S
    while time.monotonic() < deadline:
        info = r.info("replication")
        if (info.get("master_link_status") == "up"
                and info["master_repl_offset"] == p.info("replication")["master_repl_offset"]):
            return
        time.sleep(0.02)
    raise AssertionError("the replica did not catch up")


@dataclass
class Pair:
    """A durable primary; its replica, which replicates through `link`; and `endpoint`, where
    clients connect (the primary, until a failover)."""

    primary: RedisServer
    replica: RedisServer
    link: Forwarder
    endpoint: Forwarder

    def stall(self) -> None:
        """The replication link stalls: what the primary sends from now on never arrives."""
        synced(self.primary, self.replica)
        self.link.stall()

    def fail_over(self) -> None:
        """The primary is lost; the replica is promoted behind the same endpoint."""
        self.primary.stop(kill=True)
        self.link.close()
        redis.Redis(port=self.replica.port).replicaof("NO", "ONE")
        self.endpoint.switch(self.replica.port)


@contextmanager
def started_pair() -> Iterator[Pair]:
    """A Pair whose replica has caught up; its servers stopped and forwarders closed after."""
    with RedisServer(durable=True) as primary:
        link = Forwarder(primary.port)
        with RedisServer(durable=True, replica_of=link.port) as replica:
            endpoint = Forwarder(primary.port)
            synced(primary, replica)
            try:
                yield Pair(primary, replica, link, endpoint)
            finally:
                endpoint.close()
                link.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    with started_pair() as started:
        yield started


@asynccontextmanager
async def waiting_store(pair: Pair, tag: str) -> AsyncIterator[RedisStore]:
    """A store at the pair's endpoint that waits for the replica on every hold, `tag` given a
    budget of 1,000 micro-dollars; closed after."""
    store = RedisStore(pair.endpoint.url, wait_replicas=1, wait_timeout_ms=WAIT_TIMEOUT_MS)
    try:
        await put(store, tag, (Period.TOTAL, 1_000))
        yield store
    finally:
        await store.close()


def test_info_tells_what_keeps_money() -> None:
    text = ("# Persistence\r\naof_enabled:0\r\n# Memory\r\nmaxmemory_policy:volatile-lru\r\n"
            "# Stats\r\nevicted_keys:0\r\n# Server\r\nrun_id:abc\r\n# Replication\r\n"
            "master_replid:r1\r\n")
    found = durability_of(text)
    assert found == Durability(False, "volatile-lru", 0, "abc/r1")
    assert found.reasons() == ("ledger_not_durable", "ledger_evicts")
    kept = Durability(True, "noeviction", 0)
    assert kept.reasons() == ()
    assert Durability(True, "noeviction", 3).reasons() == ("ledger_evicts",)
    assert Durability().reasons() == ()  # a service that tells nothing is not accused


@pytest.mark.parametrize(("server", "reasons"), [
    (dict(durable=True), ()),
    (dict(snapshots=True), ("ledger_not_durable",)),
    (dict(durable=True, maxmemory_policy="volatile-lru"), ("ledger_evicts",)),
    (dict(durable=True, maxmemory_policy="allkeys-lru"), ("ledger_evicts",)),
], ids=["aof", "snapshots", "volatile-lru", "allkeys-lru"])
async def test_the_probe_reads_persistence_and_eviction_from_info(
        server: dict[str, object], reasons: tuple[str, ...], tag: str) -> None:
    with RedisServer(**server) as s:  # type: ignore[arg-type]
        store = RedisStore(s.url)
        try:
            probe = await store.probe("i1")
            assert probe.reasons == reasons
            assert probe.durable is ("ledger_not_durable" not in reasons)
        finally:
            await store.close()


async def test_wait_refuses_a_hold_no_replica_acknowledged_and_releases_it(
        pair: Pair, tag: str) -> None:
    async with waiting_store(pair, tag) as store:
        assert (await store.probe("i1")).reasons == ()
        assert (await store.reserve(request(tag, tag, 10))).reserved_micros == 10
        pair.stall()
        with pytest.raises(LedgerUnavailable) as refused:
            await store.reserve(request(tag, tag, 10))
        assert refused.value.reason == "ledger_not_replicated"
        # The refused call is never forwarded: its hold is released, not left to its lease.
        assert (await leg(store, tag)).reserved_micros == 10


async def test_a_failover_to_a_lagging_replica_loses_nothing_that_wait_acknowledged(
        pair: Pair, tag: str) -> None:
    async with waiting_store(pair, tag) as store:
        admitted = [await store.reserve(request(tag, tag, 10)) for _ in range(5)]
        pair.stall()
        refused = 0
        for _ in range(5):
            with pytest.raises(LedgerUnavailable):
                await store.reserve(request(tag, tag, 10))
            refused += 1
        pair.fail_over()
        # What the promoted ledger holds is exactly what was admitted; nothing went back.
        assert (await leg(store, tag)).reserved_micros == 10 * len(admitted)
        assert refused == 5
        # The promoted primary has no replica of its own yet: refused until it has one, and
        # health says so (nothing went back: no rollback).
        assert (await store.probe("i1")).reasons == ("ledger_not_replicated",)
        with pytest.raises(LedgerUnavailable) as alone:
            await store.reserve(request(tag, tag, 10))
        assert alone.value.reason == "ledger_not_replicated"


async def test_a_failover_to_a_lagging_replica_is_noticed_and_refused_until_adopted(
        pair: Pair, tag: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Instances look for another's finding or an adoption at most once a second; here, at
    # every call.
    monkeypatch.setattr(scripted_core, "ROLLBACK_CHECK_INTERVAL_MS", 0)
    store, other = RedisStore(pair.endpoint.url), RedisStore(pair.endpoint.url)
    try:
        await put(store, tag, (Period.TOTAL, 100_000))
        await store.reserve(request(tag, tag, 10))
        pair.stall()
        for _ in range(20):  # acknowledged by the primary alone
            await store.reserve(request(tag, tag, 10))
        pair.fail_over()
        with pytest.raises(LedgerUnavailable) as refused:
            await store.reserve(request(tag, tag, 10))
        assert refused.value.reason == "ledger_rolled_back"
        # The other instance saw none of the lost calls; it learns from the ledger's mark.
        with pytest.raises(LedgerUnavailable) as told:
            await other.reserve(request(tag, tag, 10))
        assert told.value.reason == "ledger_rolled_back"
        assert (await other.probe("i2")).reasons == ("ledger_rolled_back",)
        assert (await store.probe("i1")).reasons == ("ledger_rolled_back",)
        # An operator adopts the ledger as it is: both enforce again.
        current, adopted = await ScriptedCatalogue(store).adopt()
        assert current == adopted is not None
        assert (await store.reserve(request(tag, tag, 10))).reserved_micros == 10
        assert (await other.reserve(request(tag, tag, 10))).reserved_micros == 10
        assert (await store.probe("i1")).reasons == ()
    finally:
        await store.close()
        await other.close()


async def test_a_snapshot_restart_is_not_durable_from_the_start_and_rolled_back_after(
        tag: str) -> None:
    with RedisServer(snapshots=True) as server:
        store = RedisStore(server.url)
        try:
            await put(store, tag, (Period.TOTAL, 1_000))
            await store.reserve(request(tag, tag, 10))
            assert (await store.probe("i1")).reasons == ("ledger_not_durable",)
            redis.Redis(port=server.port).save()  # the schedule's snapshot
            for _ in range(5):
                await store.reserve(request(tag, tag, 10))
            server.stop(kill=True)
            server.start()
            probe = await store.probe("i1")
            assert probe.reasons == ("ledger_rolled_back",)
            with pytest.raises(LedgerUnavailable) as refused:
                await store.reserve(request(tag, tag, 10))
            assert refused.value.reason == "ledger_rolled_back"
            raw = redis.Redis(port=server.port, decode_responses=True)
            assert raw.get(keys.ROLLED_BACK_KEY) is not None
        finally:
            await store.close()


async def test_an_outage_journal_kept_on_disk_is_booked_by_the_next_instance(
        tmp_path: Path, tag: str) -> None:
    clock = ManualClock()
    store = MemoryStore(clock=clock)
    bid = await put(store, tag, (Period.TOTAL, 10_000), allow=500)
    down = LedgerUnavailable("down", reason="ledger_unreachable")
    crashed = OutageAllowance(clock=clock)
    assert crashed.keep_in(tmp_path, "a") == 0
    crashed.learn(bid.lineage, (LegStatus(tag, "total", 10_000, 0, 0, 0, None, 500),))
    first, second = request(tag, tag, 100), request(tag, tag, 200)
    crashed.admit(first, down)
    crashed.admit(second, down)
    assert crashed.settle(first.ref, 60) is not None
    assert crashed._file is not None
    crashed._file.close()  # the instance dies, its journal unbooked

    heir = OutageAllowance(clock=clock)
    assert heir.keep_in(tmp_path, "b") == 2
    assert not (tmp_path / "outage-a.jsonl").exists()
    clock.advance(second.ttl_ms)  # the unsettled call's lease runs out: charged whole
    assert await heir.flush(store) == 2
    assert (await leg(store, tag)).committed_micros == 60 + 200
    assert (tmp_path / "outage-b.jsonl").read_text() == ""


@pytest.mark.parametrize(("env", "refused"), [
    ({"REDIS_URL": "redis://x", "CEILING_REDIS_WAIT_REPLICAS": "1"}, None),
    ({"REDIS_URL": "redis://x", "REDIS_CLUSTER": "1", "CEILING_REDIS_WAIT_REPLICAS": "1"},
     "one Redis"),
    ({"UPSTASH_REDIS_REST_URL": "https://x", "UPSTASH_REDIS_REST_TOKEN": "t",
      "CEILING_REDIS_WAIT_REPLICAS": "1"}, "one Redis"),
    ({"REDIS_URL": "redis://x", "CEILING_REDIS_WAIT_REPLICAS": "17"}, "from 0 to 16"),
    ({"REDIS_URL": "redis://x", "CEILING_REDIS_WAIT_TIMEOUT_MS": "0"}, "from 1 to 1000"),
], ids=["redis", "cluster", "upstash", "too-many", "no-time"])
def test_wait_is_configured_only_where_it_is_carried_out(
        env: dict[str, str], refused: str | None) -> None:
    if refused is None:
        config = load(env)
        assert (config.wait_replicas, config.wait_timeout_ms) == (1, WAIT_TIMEOUT_MS_DEFAULT)
        return
    with pytest.raises(ConfigError, match=refused):
        load(env)


async def test_reserves_answered_together_share_one_wait(pair: Pair, tag: str) -> None:
    store = RedisStore(pair.endpoint.url, wait_replicas=1, wait_timeout_ms=1_000)
    raw = redis.Redis(port=pair.primary.port, decode_responses=True)
    try:
        await put(store, tag, (Period.TOTAL, 100_000))
        raw.config_resetstat()
        held = await asyncio.gather(*(store.reserve(request(tag, tag, 1)) for _ in range(50)))
        assert len(held) == 50
        waits = int(raw.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))
        assert 1 <= waits < 50
    finally:
        await store.close()


def test_the_runtime_keeps_its_outage_journal_where_it_is_told(tmp_path: Path) -> None:
    from api.runtime import Runtime  # the runtime is where the setting takes effect

    env = {"CEILING_SINGLE_REPLICA": "1", "CEILING_OUTAGE_JOURNAL_DIR": str(tmp_path / "j")}
    rt = Runtime.from_env(env, instance_id="i1")
    assert rt.service is not None
    assert (tmp_path / "j" / "outage-i1.jsonl").exists()
    (tmp_path / "file").write_text("")
    refused = Runtime.from_env({**env, "CEILING_OUTAGE_JOURNAL_DIR": str(tmp_path / "file")})
    assert refused.service is None
    assert refused.problem is not None
    assert "CEILING_OUTAGE_JOURNAL_DIR" in refused.problem.message
