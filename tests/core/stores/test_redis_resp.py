"""The scripts' own connections (core/stores/redis_resp.py), against a real redis-server: they
go where the URL says as the URL says, and no reply is ever taken for another command's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis import exceptions as rex

from core.budgets import Period
from core.ledger import ReservationRef
from core.stores.redis import RedisStore, RedisTransport, redis_client
from core.stores.redis_resp import Endpoint, pack
from infra.redis_server import RedisServer
from tests.core.stores.test_conformance import OWNER, leg, put, request

PASSWORD = "s3cret-for-the-test"


@pytest.fixture
async def raw(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    await client.aclose()


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
    redis_server: RedisServer, raw: aioredis.Redis
) -> None:
    endpoint = Endpoint.of(redis_client(redis_server.url))
    assert endpoint is not None
    connection = await endpoint.connect()
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
    # Every other client's connection closed, as a Redis restart or its idle timeout does.
    killed = await raw.execute_command(  # type: ignore[no-untyped-call]
        "CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
    assert killed >= 8
    await asyncio.sleep(0.05)
    reservations = await asyncio.gather(*(store.reserve(request(tag, tag, 1)) for _ in range(8)))
    assert all(r.reserved_micros == 1 for r in reservations)
    assert (await leg(store, tag)).reserved_micros == 16
    await store.close()
