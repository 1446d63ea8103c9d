"""What only a real Redis can show: its own clock, script loading, a wiped ledger, an outage."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from core.budgets import BudgetId, Period
from core.errors import BudgetNotFound, LedgerUnavailable
from core.ledger import ROLES_OF_LEGACY_KEYS, KeyRecord, ReservationRef, Role
from core.limits import IDEMPOTENCY_WINDOW_MS, REPLAY_WINDOW_MS, RESEND_WINDOW_MS
from core.stores import keys, wire
from core.stores.redis import LEDGER_CALL_TIMEOUT_S, RedisStore, lost_connection, translated
from core.stores.scripts import library, script
from infra.processes import free_port
from infra.redis_server import RedisServer
from tests.core.stores.test_conformance import OWNER, leg, put, request


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A Redis of this test's own, for tests that flush or stop it."""
    with RedisServer() as server:
        yield server


@pytest.fixture
async def raw(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    await client.aclose()


async def test_ledger_time_is_redis_time_not_the_instance_clock(
    redis_server: RedisServer, tag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = RedisStore(redis_server.url)
    await put(store, tag, (Period.DAY, 1_000))
    # This instance's clock runs three days and seven minutes ahead of the ledger.
    skew_s = 3 * 86_400 + 420
    real_time = time.time
    monkeypatch.setattr("core.stores.scripted.time.time", lambda: real_time() + skew_s)
    before_ms = int(real_time() * 1000)
    r = await store.reserve(request(tag, tag, 10))
    after_ms = int(real_time() * 1000)
    assert before_ms + 60_000 - 50 <= r.expires_at_ms <= after_ms + 60_000 + 50
    today = datetime.fromtimestamp(r.now_ms / 1000, tz=UTC).strftime("%Y-%m-%d")
    assert r.legs[0].window_key == f"day:{today}"
    await store.close()


async def test_a_flushed_library_or_script_cache_is_reloaded(
    redis_server: RedisServer, raw: aioredis.Redis, tag: str
) -> None:
    # As after a failover to a server that never loaded this version's library or scripts.
    for functions in (True, False):
        store = RedisStore(redis_server.url, functions=functions)
        await put(store, tag, (Period.TOTAL, 1_000))
        await raw.function_flush()
        await raw.script_flush()
        r = await store.reserve(request(tag, tag, 10))
        assert r.reserved_micros == 10
        await store.close()
        loaded = (library().name in str(await raw.function_list()),
                  await raw.script_exists(script("reserve").sha1) == [True])
        assert loaded == ((True, False) if functions else (False, True))


async def test_a_server_without_functions_runs_every_call_as_a_script(tag: str) -> None:
    # Redis before 7.0 has no FCALL; renamed away here, the server answers as such a one does.
    with RedisServer(extra_args=("--rename-command", "FCALL", "")) as old:
        store = RedisStore(old.url)
        await put(store, tag, (Period.TOTAL, 1_000))
        r = await store.reserve(request(tag, tag, 10))
        settled = await store.settle(ReservationRef(tag, r.reservation_id, OWNER), 4)
        assert settled.charged_micros == 4
        assert (await leg(store, tag)).committed_micros == 4
        await store.close()


async def test_a_flushed_ledger_is_detected_not_served_as_empty(
    own_redis: RedisServer, tag: str
) -> None:
    store = RedisStore(own_redis.url)
    await put(store, tag, (Period.TOTAL, 100))
    await store.put_key(KeyRecord("key_a", "hash_a", BudgetId(tag), None))
    r = await store.reserve(request(tag, tag, 100))
    other = RedisStore(own_redis.url)  # another instance, which has not yet seen the reset
    await other.open()
    raw = aioredis.Redis.from_url(own_redis.url)
    await raw.flushall()
    await raw.aclose()
    # A settle by usage on an instance that did not make the reservation first reads it (for
    # its model): gone with the ledger is a reset, never "no such reservation".
    with pytest.raises(LedgerUnavailable) as info:
        await other.reservation(ReservationRef(tag, r.reservation_id, OWNER))
    assert info.value.reason == "ledger_reset"
    await other.close()
    with pytest.raises(LedgerUnavailable) as info:
        await store.reserve(request(tag, tag, 100))
    assert info.value.reason == "ledger_reset"
    with pytest.raises(LedgerUnavailable):
        await store.settle(ReservationRef(tag, r.reservation_id, OWNER), 10)
    with pytest.raises(LedgerUnavailable):
        await store.get_key("hash_a")
    probe = await store.probe("i1")
    assert probe.reasons == ("ledger_reset",)
    await store.close()

    # A new instance finds an empty ledger: nothing to enforce against, so nothing is admitted.
    fresh = RedisStore(own_redis.url)
    with pytest.raises(BudgetNotFound):
        await fresh.reserve(request(tag, tag, 1))
    assert await fresh.get_key("hash_a") is None
    await fresh.close()


async def test_a_restart_without_persistence_is_a_reset(own_redis: RedisServer, tag: str) -> None:
    store = RedisStore(own_redis.url)
    await put(store, tag, (Period.TOTAL, 100))
    own_redis.restart(wipe=True)
    with pytest.raises(LedgerUnavailable) as info:
        await store.reserve(request(tag, tag, 1))
    assert info.value.reason == "ledger_reset"
    await store.close()


async def test_an_unreachable_ledger_fails_closed_quickly(tag: str) -> None:
    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0")
    started = time.monotonic()
    with pytest.raises(LedgerUnavailable) as info:
        await store.reserve(request(tag, tag, 1))
    assert info.value.reason == "ledger_unreachable"
    assert time.monotonic() - started < LEDGER_CALL_TIMEOUT_S * 3
    probe = await store.probe("i1")
    assert (probe.reachable, probe.reasons) == (False, ("ledger_unreachable",))
    await store.close()


async def test_a_ledger_that_comes_back_is_used_without_a_new_store(
    own_redis: RedisServer, tag: str
) -> None:
    own_redis.durable = True
    own_redis.restart()
    store = RedisStore(own_redis.url)
    await put(store, tag, (Period.TOTAL, 100))
    own_redis.stop()
    with pytest.raises(LedgerUnavailable):
        await store.reserve(request(tag, tag, 1))
    own_redis.start()
    assert (await store.reserve(request(tag, tag, 1))).reserved_micros == 1
    assert (await store.probe("i1")).reasons == ()
    await store.close()


@pytest.mark.parametrize(
    "bad", ["-0", "1.5", "1e3", "9007199254740993", "", "-1", "0x10", "0", "012"]
)
async def test_the_reserve_script_refuses_a_bad_amount_before_writing(
    redis_server: RedisServer, raw: aioredis.Redis, tag: str, bad: str
) -> None:
    store = RedisStore(redis_server.url)
    ledger_id = await store.open()
    await put(store, tag, (Period.TOTAL, 1_000))
    rid = "bad-amount"
    args = wire.arguments(
        wire.RESERVE_ARGS, ledger_id=ledger_id, reserved_micros=bad, ttl_ms="60000",
        budget_ids=tag, run="", zones="", expire_policy="charge", retention_ms="1000",
        owner=OWNER, record_tail=wire.record_tail("fp", "v", "m"), now_ms="")
    reserve = script("reserve")
    # As a script of its own, and as the library's function.
    with pytest.raises(ResponseError, match="BADARG reserved_micros"):
        await raw.eval(reserve.source, 3, keys.meta(tag), keys.reservation(tag, rid),
                       keys.open_leases(tag), *args)
    await raw.function_load(library().source, replace=True)
    with pytest.raises(ResponseError, match="BADARG reserved_micros"):
        await raw.fcall(reserve.function, 3, keys.meta(tag), keys.reservation(tag, rid),
                        keys.open_leases(tag), *args)
    assert not await raw.exists(keys.reservation(tag, rid))
    assert (await leg(store, tag)).reserved_micros == 0
    # The same call with an amount that is one is held: the refusals above were the amount's.
    good = [*args[:1], "1", *args[2:]]
    assert (await raw.eval(reserve.source, 3, keys.meta(tag), keys.reservation(tag, rid),
                           keys.open_leases(tag), *good))[0] == "ok"
    await store.close()


async def test_amounts_near_the_limits_survive_lua_exactly(
    redis_server: RedisServer, tag: str
) -> None:
    store = RedisStore(redis_server.url)
    ceiling = 10**15 - 7
    amount = 10**12 - 3
    await put(store, tag, (Period.TOTAL, ceiling))
    for _ in range(3):
        r = await store.reserve(request(tag, tag, amount))
        await store.settle(ReservationRef(tag, r.reservation_id, OWNER), amount + 1)
    total = await leg(store, tag)
    assert (total.committed_micros, total.overshoot_micros) == (3 * (amount + 1), 3)
    assert total.remaining_micros == ceiling - 3 * (amount + 1)
    await store.close()


@pytest.mark.parametrize("retention_ms", [RESEND_WINDOW_MS, IDEMPOTENCY_WINDOW_MS])
@pytest.mark.parametrize("functions", [True, False], ids=["functions", "scripts"])
async def test_a_call_writes_its_tags_keys_and_no_other(
    redis_server: RedisServer, raw: aioredis.Redis, tag: str, functions: bool,
    retention_ms: int,
) -> None:
    store = RedisStore(redis_server.url, functions=functions)
    await put(store, tag, (Period.DAY, 1_000), (Period.TOTAL, 1_000))
    await put(store, f"{tag}/team:a", (Period.MONTH, 1_000))
    made = request(tag, f"{tag}/team:a/key:k", 10, retention_ms=retention_ms,
                   fingerprint="" if retention_ms == RESEND_WINDOW_MS else "fp")
    r = await store.reserve(made)
    opened = {k async for k in raw.scan_iter(match=f"*{tag}*")}
    await store.settle(ReservationRef(tag, r.reservation_id, OWNER), 5)
    written = {k async for k in raw.scan_iter(match=f"*{tag}*")}
    day, month = r.legs[0].window_key, r.legs[2].window_key
    expected = {keys.meta(tag), keys.definition(tag, tag), keys.definition(tag, f"{tag}/team:a"),
                keys.counter(tag, tag, day), keys.counter(tag, tag, "total"),
                keys.counter(tag, f"{tag}/team:a", month),
                keys.reservation(tag, r.reservation_id)}
    if retention_ms != RESEND_WINDOW_MS:
        expected.add(keys.quota(tag, OWNER))  # a record kept past a resend counts in its quota
    assert opened == expected | {keys.open_leases(tag)}
    # The settle books each budget's hourly spend (issue 16), one bucket per budget.
    buckets = {k for k in written if k.startswith(keys.prefix(tag) + keys.SPEND)}
    assert sorted(k.removeprefix(keys.prefix(tag) + keys.SPEND).rsplit("|", 1)[0]
                  for k in buckets) == sorted([tag, f"{tag}/team:a"])
    assert written - buckets == expected  # the open-lease set goes with its last lease
    assert all(k.startswith(f"sc:{{{tag}}}:") for k in written)
    # Kept for as long as its kind of call needs it (core/limits.py).
    assert 0 < await raw.pttl(keys.reservation(tag, r.reservation_id)) <= retention_ms
    await store.close()


async def test_a_key_stored_before_roles_keeps_both_and_a_role_unknown_here_grants_nothing(
    redis_server: RedisServer, raw: aioredis.Redis, tag: str
) -> None:
    store = RedisStore(redis_server.url)
    await store.open()
    # As an earlier version wrote it: no roles field.
    await raw.hset(keys.api_key("hash_legacy" + tag), mapping={
        "key_id": "key_legacy", "budget_id": tag, "run": ""})
    legacy = await store.get_key("hash_legacy" + tag)
    assert legacy is not None
    assert legacy.roles == ROLES_OF_LEGACY_KEYS == {Role.GATEWAY, Role.SIDECAR}
    # As a later version might write it: a role this one does not know is ignored.
    await raw.hset(keys.api_key("hash_later" + tag), mapping={
        "key_id": "key_later", "budget_id": tag, "run": "", "roles": "auditor,sidecar"})
    later = await store.get_key("hash_later" + tag)
    assert later is not None
    assert later.roles == {Role.SIDECAR}
    await store.close()


def _raised_in(filename: str, source: str) -> AttributeError:
    try:
        exec(compile(source, filename, "exec"))  # noqa: S102 - the frame a client raises from
    except AttributeError as exc:
        return exc
    raise AssertionError("the source raises")


async def test_a_connection_torn_down_under_redis_py_fails_closed_other_bugs_go_out() -> None:
    # What redis-py's asyncio connection raised in a Redis Cluster failover here, writing on a
    # connection another task had just torn down (redis/redis-py#4287): the call fails closed, as
    # a lost connection does. The same error raised anywhere else is a bug and is not hidden.
    torn = _raised_in("/venv/site-packages/redis/asyncio/connection.py", "None.writelines([])")
    assert lost_connection(torn)
    with pytest.raises(LedgerUnavailable) as info, translated():
        raise torn
    assert info.value.reason == "ledger_unreachable"
    ours = _raised_in("/work/core/stores/scripted.py", "None.writelines([])")
    assert not lost_connection(ours)
    with pytest.raises(AttributeError), translated():
        raise ours


async def test_a_reservation_that_moved_no_money_is_kept_for_replays_only(
    redis_server: RedisServer, raw: aioredis.Redis, tag: str
) -> None:
    store = RedisStore(redis_server.url)
    await put(store, tag, (Period.TOTAL, 10_000))
    released, zero, settled = (request(tag, tag, 100) for _ in range(3))
    for made in (released, zero, settled):
        await store.reserve(made)
    await store.release(released.ref)
    await store.settle(zero.ref, 0)
    await store.settle(settled.ref, 40)
    for nothing_moved in (released, zero):
        key = keys.reservation(tag, nothing_moved.ref.reservation_id)
        assert 0 < await raw.pttl(key) <= REPLAY_WINDOW_MS
    key = keys.reservation(tag, settled.ref.reservation_id)
    assert REPLAY_WINDOW_MS < await raw.pttl(key) <= IDEMPOTENCY_WINDOW_MS
    await store.close()
