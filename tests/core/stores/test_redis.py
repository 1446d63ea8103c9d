"""What only a real Redis can show: its own clock, script loading, a wiped ledger, an outage."""

from __future__ import annotations

import contextlib
import ssl
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis import exceptions as rex
from redis.exceptions import ResponseError

from core.budgets import BudgetId, Period
from core.errors import BudgetNotFound, InvariantBroken, LedgerUnavailable
from core.ledger import KeyRecord, ReservationRef, Role
from core.limits import IDEMPOTENCY_WINDOW_MS, REPLAY_WINDOW_MS, RESEND_WINDOW_MS
from core.stores import keys, wire
from core.stores.redis import (
    LEDGER_CALL_TIMEOUT_S,
    ConnectionTornDown,
    RedisStore,
    client_call,
    translated,
)
from core.stores.redis_resp import ArgumentRefused
from core.stores.scripts import (
    LIBRARIES_RECENT_KEPT,
    LIBRARY_PREFIX,
    LIBRARY_RETENTION_MS,
    library,
    prune_libraries,
    script,
)
from infra.processes import free_port
from infra.redis_server import RedisServer
from tests.core.stores.test_conformance import OWNER, leg, put, request
from tests.support import ManualClock


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
    monkeypatch.setattr("core.stores.scripted_core.time.time", lambda: real_time() + skew_s)
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
        owner=OWNER, record_tail=wire.record_tail("fp", "v", "m"), user="", model="",
        now_ms="")
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
                keys.reservation(tag, r.reservation_id),
                keys.prefix(tag) + keys.WINDOWS}  # the day and month counters, for the sweep
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


async def test_a_role_unknown_here_grants_nothing(
    redis_server: RedisServer, tag: str
) -> None:
    store = RedisStore(redis_server.url)
    await store.open()
    # As a later version might write a key: a role this one does not know is ignored.
    key_id = "key_later" + tag.removeprefix("org:t")
    await store.put_key_record(key_id, "hash_later" + tag, tag, "", "auditor,sidecar")
    later = await store.get_key("hash_later" + tag, key_id)
    assert later is not None
    assert later.roles == {Role.SIDECAR}
    await store.close()


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        # A ledger script's BADARG: from redis-py's client (a code its parser does not know) and
        # from the scripts' own connection.
        (rex.ResponseError("BADARG reserved_micros"), "invariant"),
        (ArgumentRefused("BADARG reserved_micros"), "invariant"),
        (rex.DataError("Invalid input of type: 'NoneType'"), "invariant"),
        (rex.AuthenticationError("invalid username-password pair"), "ledger_auth"),
        (rex.NoPermissionError("User u has no permissions to run the 'fcall' command"),
         "ledger_auth"),
        (ConnectionTornDown("AttributeError: 'NoneType' object has no attribute 'writelines'"),
         "ledger_unreachable"),
        (rex.BusyLoadingError("Redis is loading the dataset in memory"), "ledger_unreachable"),
        (rex.ConnectionError("Error 111 connecting to 127.0.0.1:6379"), "ledger_unreachable"),
        (rex.MaxConnectionsError("Too many connections"), "ledger_unreachable"),
        (rex.TimeoutError("Timeout reading from 127.0.0.1:6379"), "ledger_unreachable"),
        (TimeoutError(), "ledger_unreachable"),  # asyncio.timeout's
        (ConnectionRefusedError(111, "Connection refused"), "ledger_unreachable"),
        (ssl.SSLCertVerificationError("CERTIFICATE_VERIFY_FAILED"), "ledger_unreachable"),
        (rex.NoScriptError("No matching script"), "ledger_error"),
        (rex.ReadOnlyError("You can't write against a read only replica."), "ledger_error"),
        (rex.OutOfMemoryError("command not allowed when used memory > 'maxmemory'"),
         "ledger_error"),
        (rex.ResponseError("WRONGTYPE Operation against a key"), "ledger_error"),
        (rex.InvalidResponse("Protocol Error: x"), "ledger_error"),
    ],
)
def test_each_client_error_type_becomes_its_core_error(exc: Exception, expected: str) -> None:
    with pytest.raises((InvariantBroken, LedgerUnavailable)) as info, translated():
        raise exc
    assert info.value.__cause__ is exc
    if expected == "invariant":
        assert type(info.value) is InvariantBroken
    else:
        assert isinstance(info.value, LedgerUnavailable)
        assert info.value.reason == expected


async def _torn_down_write() -> None:
    """What redis-py's asyncio connection raised in a Redis Cluster failover here, writing on a
    connection another task had just torn down."""
    writer: Any = None
    writer.writelines([])


async def test_a_connection_torn_down_under_redis_py_fails_closed_other_bugs_go_out() -> None:
    # Raised from inside a client call: a lost connection, and the call fails closed as one does.
    with pytest.raises(ConnectionTornDown):
        await client_call(_torn_down_write())
    with pytest.raises(LedgerUnavailable, match="connection was lost") as info, translated():
        await client_call(_torn_down_write())
    assert info.value.reason == "ledger_unreachable"
    # The same error raised by this project's own code is a bug and is not hidden.
    with pytest.raises(AttributeError), translated():
        await _torn_down_write()


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


# -- the ledger's format version -----------------------------------------------------------------


async def test_a_new_ledger_is_stamped_with_its_format_version(own_redis: RedisServer) -> None:
    store = RedisStore(own_redis.url)
    await store.open()
    raw = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
    assert await raw.get(keys.LEDGER_FORMAT_KEY) == str(wire.LEDGER_FORMAT_VERSION) == "2"
    await raw.aclose()
    await store.close()


async def test_a_ledger_of_another_format_version_fails_closed_and_health_says_so(
    own_redis: RedisServer, tag: str
) -> None:
    store = RedisStore(own_redis.url)
    await put(store, tag, (Period.TOTAL, 1_000))
    await store.reserve(request(tag, tag, 10))
    raw = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
    # As a later version would stamp a ledger it made or moved to a format this one cannot read.
    await raw.set(keys.LEDGER_FORMAT_KEY, "3")

    fresh = RedisStore(own_redis.url)  # an instance that opens the ledger now
    for _ in range(2):  # refused at the open, then by the reset it found
        with pytest.raises(LedgerUnavailable) as info:
            await fresh.reserve(request(tag, tag, 10))
        assert info.value.reason == "ledger_reset"
        assert "written by another format version (3; this instance reads version 2)" in (
            info.value.message)
    probe = await fresh.probe("i1")
    assert (probe.reachable, probe.ledger_id, probe.reasons) == (True, None, ("ledger_reset",))
    # An instance that opened the ledger before finds it at its next health check.
    assert (await store.probe("i2")).reasons == ("ledger_reset",)
    with pytest.raises(LedgerUnavailable) as info:
        await store.reserve(request(tag, tag, 10))
    assert (info.value.reason, "another format version" in info.value.message) == (
        "ledger_reset", True)
    await raw.set(keys.LEDGER_FORMAT_KEY, "2")
    again = RedisStore(own_redis.url)
    assert (await leg(again, tag)).reserved_micros == 10  # only the first reserve held
    for s in (store, fresh, again):
        await s.close()
    await raw.aclose()


# -- the libraries of other versions -----------------------------------------------------------


def _other_library(digest: str) -> str:
    """A library as another version of the code would name it."""
    return (f"#!lua name={LIBRARY_PREFIX}{digest}\n"
            f"redis.register_function('sc_{digest}_read', function() return 1 end)\n")


async def _libraries(raw: aioredis.Redis) -> set[str]:
    listed = await raw.execute_command(  # type: ignore[no-untyped-call]
        "FUNCTION", "LIST", "LIBRARYNAME", LIBRARY_PREFIX + "*")
    return {str(lib["library_name"]) for lib in listed}


async def test_two_versions_taking_turns_keep_theirs_and_prune_the_rest(
    own_redis: RedisServer, clock: ManualClock, tag: str
) -> None:
    raw = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
    # Libraries earlier deploys loaded and never deleted, before there was a registry.
    stale = {f"{LIBRARY_PREFIX}{d * 12}" for d in "cde"}
    for name in stale:
        await raw.function_load(_other_library(name.removeprefix(LIBRARY_PREFIX)))
    ours, theirs = library().name, f"{LIBRARY_PREFIX}{'b' * 12}"
    first = RedisStore(own_redis.url, clock=clock)  # this version's first instance
    await put(first, tag, (Period.TOTAL, 10_000))
    await first.reserve(request(tag, tag, 1))
    # Seen for the first time: kept for the retention, like a library loaded just now.
    assert await _libraries(raw) == {ours, *stale}

    for turn in range(4):
        clock.advance(LIBRARY_RETENTION_MS + 1)
        # The other version's instance loads its library and opens the ledger (its first
        # instance records it and prunes; the ones after read one score).
        with contextlib.suppress(ResponseError):
            await raw.function_load(_other_library("b" * 12))
        await prune_libraries(first.transport.execute, theirs, first.ledger_time_ms)
        instance = RedisStore(own_redis.url, clock=clock)  # and this version's
        await instance.reserve(request(tag, tag, 1))
        assert await _libraries(raw) == {ours, theirs}, f"turn {turn}"
        assert len(await _libraries(raw)) <= LIBRARIES_RECENT_KEPT
        await instance.close()
    assert set(await raw.zrange(keys.LIBRARIES_KEY, 0, -1)) == {ours, theirs}

    # A third version: the least recently recorded of the two goes, and an instance still
    # running that version loads its library again at its next call, and makes it.
    clock.advance(LIBRARY_RETENTION_MS + 1)
    newest = f"{LIBRARY_PREFIX}{'f' * 12}"
    await raw.function_load(_other_library("f" * 12))
    assert await prune_libraries(first.transport.execute, newest, first.ledger_time_ms) == (
        ours,)
    assert await _libraries(raw) == {theirs, newest}
    assert (await first.reserve(request(tag, tag, 1))).reserved_micros == 1
    assert await _libraries(raw) == {ours, theirs, newest}
    books = await leg(first, tag)  # the leases of the earlier turns expired, charged
    assert books.committed_micros + books.reserved_micros == 6
    await first.close()
    await raw.aclose()
