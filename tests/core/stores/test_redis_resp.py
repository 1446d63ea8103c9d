"""The scripts' own connections (core/stores/redis_resp.py), against a real redis-server: they
go where the URL says as the URL says, and no reply is ever taken for another command's."""

from __future__ import annotations

import asyncio
import inspect
import socket
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis import exceptions as rex
from redis.credentials import UsernamePasswordCredentialProvider

from core.budgets import Period
from core.errors import InvariantBroken, LedgerUnavailable
from core.ledger import ReservationRef
from core.stores import keys, wire
from core.stores.redis import (
    LEDGER_CALL_TIMEOUT_S,
    SCRIPT_CLIENT_SETTING,
    RedisStore,
    RedisTransport,
    ScriptClient,
    redis_client,
    script_client,
)
from core.stores.redis_resp import (
    ERRORS_BY_CODE,
    ArgumentRefused,
    Endpoint,
    RespConnection,
    pack,
    reply_error,
)
from core.stores.scripted import ScriptedStore
from core.stores.scripts import script
from infra.processes import free_port, stop, wait_ready
from infra.redis_server import RedisServer, redis_server_binary
from tests.core.stores import test_conformance as conformance
from tests.core.stores.test_conformance import OWNER, leg, put, request
from tests.support import ManualClock

PASSWORD = "s3cret-for-the-test"
# redis-server answers a TLS handshake within seconds of starting.
TLS_START_TIMEOUT_S = 10.0
# Calls on loopback that take longer than this are stuck, not slow.
CALLS_TIMEOUT_S = 5.0


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """A redis-server that speaks only TLS, with a password, and its self-signed certificate."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    port = free_port()
    process = subprocess.Popen(
        [redis_server_binary(), "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-auth-clients", "no",
         "--requirepass", PASSWORD, "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    trusting = ssl.create_default_context(cafile=str(cert))

    def handshakes() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as raw_socket, \
                    trusting.wrap_socket(raw_socket, server_hostname="127.0.0.1"):
                return True
        except OSError:
            return False

    wait_ready(process, handshakes, timeout_s=TLS_START_TIMEOUT_S, what="redis-server over TLS")
    yield port, cert
    stop(process)


@pytest.fixture
async def raw(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture
async def connection(redis_server: RedisServer) -> AsyncIterator[RespConnection]:
    """One of the scripts' connections to the test's server, closed after the test."""
    endpoint = Endpoint.of(redis_client(redis_server.url))
    assert endpoint is not None
    connected = await endpoint.connect()
    yield connected
    connected.close()


async def require_password(server: RedisServer) -> None:
    # Set once the server answers: its readiness check signs in with no password.
    client = aioredis.Redis.from_url(server.url)
    await client.config_set("requirepass", PASSWORD)
    await client.aclose()


async def test_the_scripts_sign_in_and_use_the_database_the_url_names(tag: str) -> None:
    with RedisServer() as server:
        await require_password(server)
        for calls, user in enumerate(("", "default"), start=1):
            url = f"redis://{user}:{PASSWORD}@127.0.0.1:{server.port}/3"
            store = RedisStore(url)
            await put(store, tag, (Period.TOTAL, 100))
            r = await store.reserve(request(tag, tag, 30))
            await store.settle(ReservationRef(tag, r.reservation_id, OWNER), 20)
            assert (await leg(store, tag)).committed_micros == 20 * calls
            await store.close()
        for db, has_keys in ((0, False), (3, True)):
            checker = aioredis.Redis.from_url(f"redis://:{PASSWORD}@127.0.0.1:{server.port}/{db}")
            assert (await checker.dbsize() > 0) is has_keys
            await checker.aclose()


async def test_a_wrong_password_fails_closed(tag: str) -> None:
    with RedisServer() as server:
        await require_password(server)
        url = f"redis://:wrong@127.0.0.1:{server.port}/0"
        endpoint = Endpoint.of(redis_client(url))
        assert endpoint is not None
        with pytest.raises(rex.AuthenticationError):
            await endpoint.connect()
        # Through the transport, the scripts' connection's refusal: said to be the credentials,
        # not a ledger out of reach.
        transport = RedisTransport(redis_client(url))
        with pytest.raises(LedgerUnavailable, match="refused the credentials") as info:
            await transport.run(script("read"), (keys.meta(tag), keys.reservation(tag, "r")), [])
        assert info.value.reason == "ledger_auth"
        await transport.close()


async def test_a_user_without_the_right_to_run_scripts_is_a_credentials_error(tag: str) -> None:
    with RedisServer() as server:
        admin = aioredis.Redis.from_url(server.url)
        await admin.acl_setuser("ledger", enabled=True, passwords=[f"+{PASSWORD}"],
                                keys=["*"], commands=["+@all", "-fcall", "-evalsha", "-eval"])
        await admin.aclose()
        store = RedisStore(f"redis://ledger:{PASSWORD}@127.0.0.1:{server.port}/0")
        with pytest.raises(LedgerUnavailable, match="may not run") as info:
            await store.reserve(request(tag, tag, 1))
        assert info.value.reason == "ledger_auth"
        await store.close()


async def test_a_script_that_refuses_an_argument_is_a_programmer_error(
    redis_server: RedisServer, tag: str
) -> None:
    # BADARG, the scripts' own error code, on the scripts' own connection.
    store = RedisStore(redis_server.url)
    ledger_id = await store.open()
    args = wire.arguments(
        wire.RESERVE_ARGS, ledger_id=ledger_id, reserved_micros="-1", ttl_ms="60000",
        budget_ids=tag, run="", zones="", expire_policy="charge", retention_ms="1000",
        owner=OWNER, record_tail=wire.record_tail("fp", "v", "m"), user="", model="",
        now_ms="")
    for functions in (True, False):
        transport = RedisTransport(redis_client(redis_server.url), functions=functions)
        with pytest.raises(InvariantBroken, match="refused an argument: BADARG reserved_micros"):
            await transport.run(script("reserve"), (keys.meta(tag), keys.reservation(tag, "r"),
                                                    keys.open_leases(tag)), args)
        await transport.close()
    await store.close()


@pytest.mark.parametrize("code", sorted(ERRORS_BY_CODE))
def test_an_error_reply_is_the_type_its_code_names_its_message_whole(code: str) -> None:
    error = reply_error(f"{code} what the server said")
    assert type(error) is ERRORS_BY_CODE[code]
    assert str(error) == f"{code} what the server said"
    assert type(reply_error("ERR Error running script")) is rex.ResponseError
    assert isinstance(reply_error("BADARG x"), ArgumentRefused)


def test_the_endpoint_is_what_redis_py_made_of_the_url() -> None:
    """Endpoint.of reads redis-py's public attributes of a connection it made (not opened):
    this fails if one of them moves or changes its meaning."""
    made = Endpoint.of(redis_client("redis://us%40r:p%3Ass@ledger.example:6390/4"))
    assert made == Endpoint("ledger.example", 6390, 4, "us@r", "p:ss", None,
                            LEDGER_CALL_TIMEOUT_S, "utf-8")
    # redis-py's defaults, not ours (port 6379, database 0, no password, replies as bytes), and
    # the URL's settings.
    plain = Endpoint.of(aioredis.Redis.from_url("redis://ledger.example?socket_connect_timeout=3"))
    assert plain == Endpoint("ledger.example", 6379, 0, None, None, None, 3.0, None)
    # TLS as the URL says, verification included.
    tls = Endpoint.of(redis_client("rediss://ledger.example/0?ssl_cert_reqs=none"))
    assert tls is not None
    assert tls.ssl_context is not None
    assert tls.ssl_context.verify_mode == ssl.CERT_NONE
    verified = Endpoint.of(redis_client("rediss://ledger.example/0"))
    assert verified is not None
    assert verified.ssl_context is not None
    assert verified.ssl_context.verify_mode == ssl.CERT_REQUIRED
    assert verified.ssl_context.check_hostname
    # What this module does not carry out leaves the scripts on redis-py's client.
    assert Endpoint.of(redis_client("unix:///tmp/redis.sock")) is None
    provider = UsernamePasswordCredentialProvider("u", "p")
    pool = aioredis.ConnectionPool(host="ledger.example", credential_provider=provider)
    assert Endpoint.of(aioredis.Redis(connection_pool=pool)) is None


async def test_a_reply_that_came_too_late_is_never_read_as_the_next_ones(
    connection: RespConnection, raw: aioredis.Redis
) -> None:
    assert await connection.call(pack(("ECHO", "first"))) == "first"
    await raw.execute_command("CLIENT", "PAUSE", "300", "ALL")  # type: ignore[no-untyped-call]
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await connection.call(pack(("ECHO", "late")))
    # Its reply comes once the pause is over; the connection is closed before it can.
    assert not connection.usable
    with pytest.raises(rex.ConnectionError):
        await connection.call(pack(("ECHO", "next")))
    await asyncio.sleep(0.4)


async def test_a_call_past_its_deadline_times_out_and_breaks_the_connection(
    connection: RespConnection, raw: aioredis.Redis
) -> None:
    loop = asyncio.get_running_loop()
    assert await connection.call(pack(("ECHO", "first")), loop.time() + 1) == "first"
    await raw.execute_command("CLIENT", "PAUSE", "300", "ALL")  # type: ignore[no-untyped-call]
    started_s = loop.time()
    late = asyncio.ensure_future(connection.call(pack(("ECHO", "late")), started_s + 0.05))
    patient = asyncio.ensure_future(connection.call(pack(("ECHO", "patient")), started_s + 5))
    with pytest.raises(TimeoutError):
        await late
    assert loop.time() - started_s < 0.25  # by its own deadline, not the pause's end
    # The other call's reply could be taken for the late one's: it fails, to be retried.
    with pytest.raises(rex.ConnectionError):
        await patient
    assert not connection.usable
    await asyncio.sleep(0.4)


async def test_calls_answered_in_time_leave_one_watch_for_the_earliest_still_waiting(
    connection: RespConnection,
) -> None:
    loop = asyncio.get_running_loop()
    first = loop.time() + 30
    replies = await asyncio.gather(*(connection.call(pack(("ECHO", str(i))), first + i)
                                     for i in range(5)))
    assert replies == [str(i) for i in range(5)]
    # One timer, armed once by the first call; it fails nobody once it fires.
    assert connection._watch is not None
    assert connection._watch_at_s == first
    connection._overdue()
    assert connection.usable
    assert connection._watch is None


async def test_a_call_timed_out_on_the_transport_leaves_the_next_call_its_own_reply(
    redis_server: RedisServer, raw: aioredis.Redis, tag: str
) -> None:
    store = RedisStore(redis_server.url)
    await put(store, tag, (Period.TOTAL, 100))
    # The same ledger, through a transport with a short call timeout.
    short = ScriptedStore(RedisTransport(redis_client(redis_server.url), call_timeout_s=0.05))
    r = await short.reserve(request(tag, tag, 30))
    await raw.execute_command("CLIENT", "PAUSE", "300", "ALL")  # type: ignore[no-untyped-call]
    with pytest.raises(LedgerUnavailable, match="unreachable"):
        await short.settle(ReservationRef(tag, r.reservation_id, OWNER), 20)
    await asyncio.sleep(0.4)
    # The settle may have run (its reply came late): a resend answers as a replay would, with
    # the settle's own reply, not the one left on a connection by the call that timed out.
    settled = await short.settle(ReservationRef(tag, r.reservation_id, OWNER), 20)
    assert settled.charged_micros == 20
    assert (await leg(store, tag)).committed_micros == 20
    await short.close()
    await store.close()


async def test_connections_the_server_closed_are_replaced_without_a_failed_call(
    redis_server: RedisServer, raw: aioredis.Redis, tag: str
) -> None:
    store = RedisStore(redis_server.url)
    await put(store, tag, (Period.TOTAL, 1_000))
    await asyncio.gather(*(store.reserve(request(tag, tag, 1)) for _ in range(8)))
    # Every other client's connection closed, as a Redis restart or its idle timeout does: the
    # scripts' one and the client's.
    killed = await raw.execute_command(  # type: ignore[no-untyped-call]
        "CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
    assert killed >= 2
    await asyncio.sleep(0.05)
    reservations = await asyncio.gather(*(store.reserve(request(tag, tag, 1)) for _ in range(8)))
    assert all(r.reserved_micros == 1 for r in reservations)
    assert (await leg(store, tag)).reserved_micros == 16
    await store.close()


async def test_rediss_urls_are_served_over_tls_with_their_verification(
    tls_redis: tuple[int, Path], tag: str
) -> None:
    port, cert = tls_redis
    base = f"rediss://:{PASSWORD}@127.0.0.1:{port}/2"
    store = RedisStore(f"{base}?ssl_ca_certs={cert}")
    await put(store, tag, (Period.TOTAL, 100))
    r = await store.reserve(request(tag, tag, 30))
    await store.settle(ReservationRef(tag, r.reservation_id, OWNER), 20)
    assert (await leg(store, tag)).committed_micros == 20
    await store.close()
    # Verification is on unless the URL turns it off: a certificate nobody vouches for fails.
    untrusting = RedisTransport(redis_client(base))
    with pytest.raises(LedgerUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
        await untrusting.run(script("read"), (keys.meta(tag), keys.reservation(tag, "r1")), [])
    await untrusting.close()


async def test_calls_in_flight_share_one_connection_and_each_gets_its_own_reply(
    connection: RespConnection, raw: aioredis.Redis
) -> None:
    before = (await raw.info("stats"))["total_reads_processed"]
    words = [f"call-{i}" for i in range(200)]
    async with asyncio.timeout(CALLS_TIMEOUT_S):
        replies = await asyncio.gather(*(connection.call(pack(("ECHO", w))) for w in words))
    assert replies == words
    # Sent in one pass of the loop, they went out together: the server read them in a few
    # reads (one, unless the kernel split the write), not one read a command.
    reads = (await raw.info("stats"))["total_reads_processed"] - before
    assert reads <= 10, reads


async def test_every_call_in_flight_on_a_connection_that_breaks_is_retried_on_a_fresh_one(
    redis_server: RedisServer, raw: aioredis.Redis, tag: str
) -> None:
    store = RedisStore(redis_server.url)
    await put(store, tag, (Period.TOTAL, 1_000))
    await store.reserve(request(tag, tag, 1))  # the scripts' connection is open
    await raw.execute_command("CLIENT", "PAUSE", "200", "ALL")  # type: ignore[no-untyped-call]
    calls = [asyncio.ensure_future(store.reserve(request(tag, tag, 1))) for _ in range(8)]
    await asyncio.sleep(0.05)  # sent, and waiting on the paused server
    killed = await raw.execute_command(  # type: ignore[no-untyped-call]
        "CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
    assert killed >= 1
    async with asyncio.timeout(CALLS_TIMEOUT_S):
        reservations = await asyncio.gather(*calls)
    assert all(r.reserved_micros == 1 for r in reservations)
    # Each held once, though its first try may have run before its connection broke.
    assert (await leg(store, tag)).reserved_micros == 9
    await store.close()


# -- the switch: the scripts on either client, held to the same answers ---------------------------

# The conformance suite's tests that run the ledger's scripts (reserve, settle, release, expiry,
# replays, runs): run here on each script client, with everything else left to redis-py.
CONFORMANCE_SUBSET = (
    conformance.test_reserve_holds_in_every_budget_and_period_on_the_path,
    conformance.test_refusal_is_all_or_nothing,
    conformance.test_exceeded_and_busy_are_told_apart,
    conformance.test_settle_replays_its_first_answer_and_refuses_another_amount,
    conformance.test_reserve_replay_returns_the_first_answer_and_holds_once,
    conformance.test_release_returns_the_hold_once,
    conformance.test_another_owner_cannot_see_settle_or_release,
    conformance.test_expiry_charges_the_hold_and_marks_the_outcome_unknown,
    conformance.test_a_run_budget_is_checked_with_the_others,
)


def test_the_environment_picks_the_script_client(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SCRIPT_CLIENT_SETTING, raising=False)
    assert script_client() is ScriptClient.RESP
    monkeypatch.setenv(SCRIPT_CLIENT_SETTING, "redis-py")
    assert script_client() is ScriptClient.REDIS_PY
    assert RedisTransport(redis_client("redis://127.0.0.1:1")).scripts_on is ScriptClient.REDIS_PY
    monkeypatch.setenv(SCRIPT_CLIENT_SETTING, "hiredis")
    with pytest.raises(InvariantBroken, match=SCRIPT_CLIENT_SETTING):
        script_client()


@pytest.mark.parametrize("scripts_on", list(ScriptClient), ids=str)
@pytest.mark.parametrize("case", CONFORMANCE_SUBSET, ids=lambda case: case.__name__[5:])
async def test_the_scripts_keep_the_ledger_alike_on_either_client(
    case: Callable[..., Awaitable[None]], scripts_on: ScriptClient, redis_server: RedisServer,
    tag: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent_on_resp: list[int] = []
    original = RespConnection.call

    async def counted(self: RespConnection, packed: bytes, *rest: float) -> Any:
        sent_on_resp.append(1)
        return await original(self, packed, *rest)

    monkeypatch.setattr(RespConnection, "call", counted)
    clock = ManualClock()
    store = RedisStore(redis_server.url, clock=clock, scripts_on=scripts_on)
    await store.open()
    try:
        given = {"store": store, "tag": tag, "clock": clock}
        await case(**{name: given[name] for name in inspect.signature(case).parameters})
    finally:
        await store.close()
    # The scripts went out where they were sent, and only there.
    assert bool(sent_on_resp) == (scripts_on is ScriptClient.RESP)
