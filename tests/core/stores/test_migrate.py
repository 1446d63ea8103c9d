"""`ceiling ledger migrate` on a ledger format 1 wrote (tests/fixtures/ledger_v1, made by main at
859b48c with tests/fixtures/ledger_v1/make_ledger.py).

Judged by this version's public reads of the migrated ledger against what format 1's code read
on the ledger it wrote (expected.json): every budget and its balances, every secret and what it
may do, every reservation, end user, refusal count and alert; and by a second run, which changes
nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from api.views import leg_json
from core.budgets import BudgetId
from core.errors import LedgerUnavailable
from core.operations import Operations
from core.prices import PriceTable
from core.service import CeilingService, hash_api_key, key_id_of
from core.stores import keys, wire
from core.stores.migrate import migrate as core_migrate
from core.stores.operations import ScriptedCatalogue
from core.stores.redis import RedisStore, RedisTransport, redis_client
from core.stores.redis_cluster import RedisClusterStore
from core.stores.scripted import ScriptedStore
from core.stores.scripted_core import ADOPT_CHECK_INTERVAL_MS
from core.stores.upstash import UpstashStore
from infra.redis_cluster import LocalCluster
from infra.redis_server import RedisServer
from infra.upstash_bridge import UpstashBridge
from tests.api.test_cli import ceiling
from tests.core.stores.test_operations import LosingTransport
from tests.support import ManualClock

Raw = aioredis.Redis | aioredis.RedisCluster
FIXTURE = Path(__file__).parents[2] / "fixtures" / "ledger_v1"
EXPECTED: dict[str, Any] = json.loads((FIXTURE / "expected.json").read_text())


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer(durable=False) as s:
        yield s


@pytest.fixture
async def raw(server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(server.url, decode_responses=True)
    yield client
    await client.aclose()


async def load(raw: Raw) -> None:
    """The fixture's keys into an empty Redis, each with the time it had left to live."""
    for name, entry in json.loads((FIXTURE / "ledger.json").read_text()).items():
        kind, value = entry["type"], entry["value"]
        if kind == "string":
            await raw.set(name, value)
        elif kind == "hash":
            await raw.hset(name, mapping=value)
        elif kind == "zset":
            await raw.zadd(name, {m: s for m, s in value})
        elif kind == "set":
            await raw.sadd(name, *value)
        elif kind == "list":
            await raw.rpush(name, *value)
        else:
            assert kind == "stream", name
            for entry_id, fields in value:
                await raw.xadd(name, fields, id=entry_id)
        if entry["pttl_ms"] > 0:
            await raw.pexpire(name, entry["pttl_ms"])


async def contents(raw: Raw) -> dict[str, Any]:
    """Every key's type and value (not its time to live, which runs on)."""
    out: dict[str, Any] = {}
    async for name in raw.scan_iter(count=1000):
        kind = str(await raw.type(name))
        value = {"string": raw.get, "hash": raw.hgetall, "set": raw.smembers}.get(kind)
        if value is not None:
            out[name] = (kind, await value(name))
        elif kind == "zset":
            out[name] = (kind, await raw.zrange(name, 0, -1, withscores=True))
        else:
            out[name] = (kind, await raw.xrange(name) if kind == "stream"
                         else await raw.lrange(name, 0, -1))
    return out


async def migrate(server: RedisServer | LocalCluster, *more: str) -> dict[str, Any]:
    env = {"REDIS_CLUSTER": "1"} if isinstance(server, LocalCluster) else {}
    done = await asyncio.to_thread(
        ceiling, server, "ledger", "migrate", *more, env=env)  # type: ignore[arg-type]
    assert done.returncode == 0, done.stderr
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


async def reads(server: RedisServer | LocalCluster, raw: Raw) -> dict[str, Any]:
    """What make_ledger.py's `expectations` reads, read by this version."""
    clock = ManualClock(EXPECTED["now_ms"])
    store: ScriptedStore = RedisClusterStore(server.url, clock=clock) \
        if isinstance(server, LocalCluster) else RedisStore(server.url, clock=clock)
    service = CeilingService(store, PriceTable.from_file(None))
    ops = Operations(service, ScriptedCatalogue(store))
    budgets = {}
    for path in EXPECTED["budgets"]:
        got = await store.get_budget(BudgetId(path))
        budgets[path] = {"definition": repr(got),
                         "legs": [leg_json(x) for x in await store.status((BudgetId(path),))]}
    taken = {}
    for secret in EXPECTED["keys_taken"]:
        record = await store.get_key(hash_api_key(secret), key_id_of(secret))
        taken[secret] = None if record is None else {
            "key_id": record.key_id, "budget_id": record.budget_id.path,
            "run_ceiling_micros": record.run_ceiling_micros, "roles": sorted(record.roles)}
    reservations = {}
    for tag in ("org:acme", "org:paris"):
        async for name in raw.scan_iter(f"sc:{{{tag}}}:r:*"):
            rid = name.rsplit(":", 1)[1]
            view = await store.inspect(tag, rid)
            reservations[rid] = None if view is None else repr(view)
    users = BudgetId("org:acme/team:users")
    found = {
        "now_ms": EXPECTED["now_ms"],
        "budgets": budgets,
        "keys_taken": taken,
        "keys_listed": sorted(json.dumps(x, sort_keys=True)
                              for x in (await ops.keys(None, None, 100)).items),
        "reservations": reservations,
        "users": {u.user: [leg_json(x) for x in await store.status((users,), user=u.user)]
                  for u in (await ops.users(users, None, 100)).page.users},
        "refusals": await store.refusal_counts(),
        "alerts": sorted(e.event_id for e in await store.alert_log("org:acme", 100)),
    }
    await store.close()
    return found


def assert_as_before(found: dict[str, Any]) -> None:
    """`found` (reads) is what format 1 read, but for the keys of the layout before records
    were by id: the migration listed them (format 1 listed only what the catalogue did), as they
    were made."""
    listed = [json.loads(x) for x in found.pop("keys_listed")]
    older = {x["key_id"]: x for x in listed if x["key_id"].startswith("key_0000000000000a0")}
    assert [x for x in listed if json.dumps(x, sort_keys=True) not in EXPECTED["keys_listed"]
            ] == list(older.values())
    taken = {v["key_id"]: v for v in EXPECTED["keys_taken"].values() if v is not None}
    fields = ("budget_id", "roles", "run_ceiling_micros")
    assert {k: {f: x[f] for f in fields} for k, x in older.items()} == {
        k: {f: taken[k][f] for f in fields} for k in older}
    assert [older[k]["created_ms"] for k in sorted(older)] == [EXPECTED["now_ms"] - 6_001, 1, 2]
    assert older["key_0000000000000a02"]["previous_secret_valid_ms"] > 0  # in its grace still
    assert found == {k: v for k, v in EXPECTED.items() if k != "keys_listed"}


async def test_a_ledger_of_format_1_is_refused_until_it_is_migrated(
    server: RedisServer, raw: aioredis.Redis
) -> None:
    await load(raw)
    store = RedisStore(server.url, clock=ManualClock(EXPECTED["now_ms"]))
    with pytest.raises(LedgerUnavailable) as info:
        await store.get_budget(BudgetId("org:acme"))
    assert info.value.reason == "ledger_reset"
    assert "earlier format (version 1; this instance reads version 2)" in info.value.message
    assert "`ceiling ledger migrate`" in info.value.message
    assert (await store.probe("i1")).reasons == ("ledger_reset",)
    await migrate(server)
    # The instance that refused it serves the migrated ledger at its next look, no restart.
    await asyncio.sleep(ADOPT_CHECK_INTERVAL_MS / 1000)
    assert await store.get_budget(BudgetId("org:acme")) is not None
    assert "ledger_reset" not in (await store.probe("i1")).reasons
    assert await store.open() == await raw.get(keys.LEDGER_ID_KEY)
    await store.close()


async def test_migrate_keeps_every_budget_key_reservation_and_balance(
    server: RedisServer, raw: aioredis.Redis
) -> None:
    await load(raw)
    before = await contents(raw)
    dry = await migrate(server, "--dry-run")
    assert await contents(raw) == before  # a dry run writes nothing
    done = await migrate(server)
    counts = {k: v for k, v in done.items() if k not in ("ledger_id", "note")}
    # Three definitions used a week, a rate or per-user limits; three keys were of the layout
    # before records were by id, none of them in the catalogue.
    assert counts == {"format_found": "1", "format": 2, "definitions_rewritten": 3,
                      "keys_moved": 3, "organisations_catalogued": 0,
                      "budgets_catalogued": 0, "keys_catalogued": 3,
                      "reservations_without_tag": 0, "stamped": True,
                      "dry_run": False}
    assert {**dry, "dry_run": False} == done  # the dry run told what the run did
    assert await raw.get(keys.LEDGER_FORMAT_KEY) == str(wire.LEDGER_FORMAT_VERSION)
    # Nothing of the earlier layouts is left.
    ledger_id = await raw.get(keys.LEDGER_ID_KEY)
    definitions = [n async for n in raw.scan_iter("sc:{*}:def:*")]
    assert {await raw.hget(n, "ledger") for n in definitions} == {ledger_id}
    assert [n async for n in raw.scan_iter("sc:keyid:*")] == []
    assert [n async for n in raw.scan_iter("sc:keyprev:*")] == []
    entries = [n async for n in raw.scan_iter("sc:key:*") if "{" not in n]
    assert len(entries) == 4  # the three keys' current secrets, and one's previous
    assert {await raw.hget(n, "index_only") for n in entries} == {"1"}

    migrated = await contents(raw)
    again = await migrate(server)
    assert await contents(raw) == migrated  # a second run changes nothing
    assert {k: again[k] for k in ("definitions_rewritten", "keys_moved", "keys_catalogued",
                                  "stamped")} == {"definitions_rewritten": 0, "keys_moved": 0,
                                                  "keys_catalogued": 0, "stamped": False}

    assert_as_before(await reads(server, raw))


async def test_an_unstamped_ledger_is_migrated_as_format_1(
    server: RedisServer, raw: aioredis.Redis
) -> None:
    await load(raw)
    await raw.delete(keys.LEDGER_FORMAT_KEY)  # as the code before the stamp left a ledger
    # A reservation under an id minted before ids named their tag: counted, left as it is.
    record = next(n for n in json.loads((FIXTURE / "ledger.json").read_text())
                  if n.startswith("sc:{org:acme}:r:"))
    untagged = keys.reservation("org:acme", "0123456789abcdef0123456789abcdef")
    await raw.copy(record, untagged)
    store = RedisStore(server.url, clock=ManualClock(EXPECTED["now_ms"]))
    with pytest.raises(LedgerUnavailable) as info:
        await store.get_budget(BudgetId("org:acme"))
    assert "earlier format (not stamped;" in info.value.message
    await store.close()
    done = await migrate(server)
    assert (done["format_found"], done["stamped"], done["reservations_without_tag"]) == (
        None, True, 1)
    assert await raw.exists(untagged) == 1
    await raw.delete(untagged)
    assert_as_before(await reads(server, raw))


async def test_a_definition_put_before_alerts_gets_the_alert_fields_it_alerted_on(
    server: RedisServer, raw: aioredis.Redis
) -> None:
    await load(raw)
    before_alerts = keys.definition("org:acme", "org:acme/team:runs")
    assert await raw.hget(before_alerts, "alert_thresholds_pct") == "50 80 100"
    await raw.hdel(before_alerts, "alert_thresholds_pct", "alert_velocity")
    none = keys.definition("org:paris", "org:paris")
    await raw.hset(none, "alert_thresholds_pct", "")  # alerts on nothing: stays so
    done = await migrate(server)
    assert done["definitions_rewritten"] == 3 + 1
    assert await raw.hmget(before_alerts, "alert_thresholds_pct", "alert_velocity") == [
        "50 80 100", ""]
    assert await raw.hget(none, "alert_thresholds_pct") == ""
    assert (await migrate(server))["definitions_rewritten"] == 0
    await raw.hset(none, "alert_thresholds_pct", "25 100")
    assert_as_before(await reads(server, raw))


async def test_a_ledger_of_a_later_format_is_neither_read_nor_migrated(
    server: RedisServer, raw: aioredis.Redis
) -> None:
    await load(raw)
    await raw.set(keys.LEDGER_FORMAT_KEY, "3")
    before = await contents(raw)
    done = await asyncio.to_thread(ceiling, server, "ledger", "migrate")
    assert done.returncode == 1
    assert "format 3, which this version neither reads nor migrates" in done.stderr
    assert await contents(raw) == before
    store = RedisStore(server.url)
    with pytest.raises(LedgerUnavailable) as info:
        await store.get_budget(BudgetId("org:acme"))
    assert "another format version (3; this instance reads version 2)" in info.value.message
    await store.close()


async def test_a_new_ledger_is_made_at_the_current_format_and_needs_no_migration(
    server: RedisServer, raw: aioredis.Redis
) -> None:
    assert (await migrate(server))["ledger_id"] is None  # nothing there yet
    store = RedisStore(server.url)
    await store.open()
    assert await raw.get(keys.LEDGER_FORMAT_KEY) == str(wire.LEDGER_FORMAT_VERSION) == "2"
    done = await migrate(server)
    assert (done["format_found"], done["stamped"], done["definitions_rewritten"]) == (
        "2", False, 0)
    await store.close()


async def test_a_redis_cluster_is_migrated_through_the_same_transport() -> None:
    """Each tag's keys in their own slot, the catalogue and the keys of the older layout each in
    theirs, over three masters: the migration finds them on every master (a SCAN of each) and
    writes each key or tag in its own slot."""
    with LocalCluster(masters_count=3, replicas_per_master=0) as cluster:
        raw = aioredis.RedisCluster.from_url(cluster.url, decode_responses=True)
        await load(raw)
        done = await migrate(cluster)
        assert (done["definitions_rewritten"], done["keys_moved"], done["keys_catalogued"],
                done["stamped"]) == (3, 3, 3, True)
        migrated = await contents(raw)
        assert (await migrate(cluster))["keys_moved"] == 0
        assert await contents(raw) == migrated
        assert_as_before(await reads(cluster, raw))
        await raw.aclose()


@pytest.mark.parametrize("reply_lost", [False, True], ids=["before", "after"])
async def test_a_migration_cut_short_anywhere_is_finished_by_the_next(
    server: RedisServer, raw: aioredis.Redis, reply_lost: bool
) -> None:
    """At every command of a migration the connection is lost once (before the command reached
    the ledger, or after it ran there). The ledger stays refused until a migration runs to the
    end; the next one does, and the ledger reads as it did."""
    points = 0
    for lose_after in itertools.count(1):
        await raw.flushall()
        await load(raw)
        transport = LosingTransport(RedisTransport(redis_client(server.url)),
                                    reply_lost=reply_lost)
        store = ScriptedStore(transport, clock=ManualClock(EXPECTED["now_ms"]))
        transport.arm(lose_after)
        with contextlib.suppress(LedgerUnavailable):
            await core_migrate(store)
        await store.close()
        if await raw.get(keys.LEDGER_FORMAT_KEY) != str(wire.LEDGER_FORMAT_VERSION):
            assert transport.lost
        await migrate(server)
        assert_as_before(await reads(server, raw))
        if not transport.lost:
            break
        points += 1
    assert points >= 40  # every command of it (45 for this fixture), the last one the stamp


async def test_upstash_is_migrated_through_its_rest_transport(
    server: RedisServer, raw: aioredis.Redis
) -> None:
    await load(raw)
    with UpstashBridge(server.url) as bridge:
        store = UpstashStore(bridge.url, bridge.token)
        done = await core_migrate(store)
        assert (done.definitions_rewritten, done.keys_moved, done.keys_catalogued,
                done.stamped) == (3, 3, 3, True)
        migrated = await contents(raw)
        assert (await core_migrate(store)).keys_moved == 0
        assert await contents(raw) == migrated
        await store.close()
    assert_as_before(await reads(server, raw))


async def test_a_budget_deleted_before_its_index_entry_is_not_half_made_again(
    server: RedisServer, raw: aioredis.Redis
) -> None:
    """The budgets index may name a budget whose definition a delete removed first: the
    migration writes nothing there, and every budget still reads."""
    await load(raw)
    gone = keys.definition("org:acme", "org:acme/team:runs")
    await raw.delete(gone)
    await migrate(server)
    assert await raw.exists(gone) == 0
