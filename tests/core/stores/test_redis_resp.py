"""The scripts' own connections (core/stores/redis_resp.py), against a real redis-server: they
go where the URL says as the URL says, and no reply is ever taken for another command's."""

from __future__ import annotations

import asyncio
import socket
import ssl
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis import exceptions as rex

from core.budgets import Period
from core.errors import LedgerUnavailable
from core.ledger import ReservationRef
from core.stores import keys
from core.stores.redis import RedisStore, RedisTransport, redis_client
from core.stores.redis_resp import Endpoint, RespConnection, pack
from core.stores.scripts import script
from infra.processes import free_port, stop, wait_ready
from infra.redis_server import RedisServer, redis_server_binary
from tests.core.stores.test_conformance import OWNER, leg, put, request

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


async def test_a_wrong_password_fails_closed() -> None:
    with RedisServer() as server:
        await require_password(server)
        endpoint = Endpoint.of(redis_client(f"redis://:wrong@127.0.0.1:{server.port}/0"))
        assert endpoint is not None
        with pytest.raises(rex.AuthenticationError):
            await endpoint.connect()


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


async def test_a_call_timed_out_on_the_transport_leaves_the_next_call_its_own_reply(
    redis_server: RedisServer, raw: aioredis.Redis, tag: str
) -> None:
    transport = RedisTransport(redis_client(redis_server.url), call_timeout_s=0.05)
    store = RedisStore(redis_server.url)
    await put(store, tag, (Period.TOTAL, 100))
    store._t = transport  # the same ledger, through a transport with a short call timeout
    r = await store.reserve(request(tag, tag, 30))
    await raw.execute_command("CLIENT", "PAUSE", "300", "ALL")  # type: ignore[no-untyped-call]
    with pytest.raises(Exception, match="unreachable"):
        await store.settle(ReservationRef(tag, r.reservation_id, OWNER), 20)
    await asyncio.sleep(0.4)
    # The settle may have run (its reply came late): a resend answers as a replay would, with
    # the settle's own reply, not the one left on a connection by the call that timed out.
    settled = await store.settle(ReservationRef(tag, r.reservation_id, OWNER), 20)
    assert settled.charged_micros == 20
    assert (await leg(store, tag)).committed_micros == 20
    await transport.close()
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
