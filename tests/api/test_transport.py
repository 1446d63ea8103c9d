"""api/transport.py: the upstream boundary, each client behind it held to the same answers.

tests/api/test_upstream_faults.py judges the gateway's provider client (api/upstream.py) on a
misbehaving provider; these judge each transport it may send through (CEILING_UPSTREAM_CLIENT)
on the same provider: a call relayed, connections reused without cookies, and each failure
raised as the httpx error that says whether the request could have been read.
"""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest

from api.transport import (
    UPSTREAM_CLIENT_SETTING,
    AiohttpTransport,
    HttpxTransport,
    UpstreamClient,
    UpstreamTransport,
    upstream_client,
    upstream_transport,
)
from infra.processes import free_port
from tests.api.test_upstream_faults import ANSWER, HostileProvider, answer, reset

TIMEOUT = httpx.Timeout(1.0, connect=1.0, pool=0.2).as_dict()
HEADERS = (("content-type", "application/json"), ("authorization", "Bearer sk-provider"))
CALL = b'{"model": "m", "messages": [{"role": "user", "content": "hello"}]}'
# What api/upstream.py takes for "the provider never saw the call"; anything else is unanswered.
NEVER_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout,
              httpx.UnsupportedProtocol)
Serve = Callable[..., Awaitable[tuple[HostileProvider, str]]]
Behaviour = Callable[[asyncio.StreamReader, asyncio.StreamWriter, HostileProvider],
                     Awaitable[None]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    servers: list[asyncio.Server] = []

    async def start(behave: Behaviour) -> tuple[HostileProvider, str]:
        provider = HostileProvider(behave)
        server = await asyncio.start_server(provider._serve, "127.0.0.1", 0)
        servers.append(server)
        return provider, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


@pytest.fixture(params=list(UpstreamClient), ids=str)
async def transports(request: pytest.FixtureRequest
                     ) -> AsyncIterator[Callable[..., UpstreamTransport[Any]]]:
    made: list[UpstreamTransport[Any]] = []

    def make(connections_max: int = 8) -> UpstreamTransport[Any]:
        made.append(upstream_transport(connections_max=connections_max, client=request.param))
        return made[-1]

    yield make
    for transport in made:
        await transport.aclose()


async def call(transport: UpstreamTransport[Any], url: str) -> httpx.Response:
    prepared = transport.prepare("POST", f"{url}/chat/completions", HEADERS, TIMEOUT)
    return await transport.send(prepared, CALL, (("openai-organization", "org-1"),))


async def answer_each(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      provider: HostileProvider) -> None:
    while await provider.read_request(reader) is not None:
        # A provider's cookie belongs to the tenant whose call drew it: never sent back.
        writer.write(answer(gzip.compress(ANSWER),
                            b"content-encoding: gzip\r\nset-cookie: tenant=a\r\n"))
        await writer.drain()


def test_the_environment_picks_the_client(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(UPSTREAM_CLIENT_SETTING, raising=False)
    assert upstream_client() is UpstreamClient.AIOHTTP
    assert isinstance(upstream_transport(connections_max=1), AiohttpTransport)
    monkeypatch.setenv(UPSTREAM_CLIENT_SETTING, "httpx")
    assert isinstance(upstream_transport(connections_max=1), HttpxTransport)
    monkeypatch.setenv(UPSTREAM_CLIENT_SETTING, "requests")
    with pytest.raises(ValueError, match=UPSTREAM_CLIENT_SETTING):
        upstream_transport(connections_max=1)


@pytest.mark.parametrize("client", list(UpstreamClient), ids=str)
def test_a_proxy_neither_client_carries_out_is_refused(client: UpstreamClient) -> None:
    with pytest.raises(ValueError, match="proxy"):
        upstream_transport(connections_max=1, proxy="socks5://127.0.0.1:1080", client=client)


async def test_calls_are_relayed_decoded_on_one_connection_without_cookies(
    serve: Serve, transports: Callable[..., UpstreamTransport[Any]]
) -> None:
    provider, url = await serve(answer_each)
    transport = transports()
    for _ in range(3):
        response = await call(transport, url)
        assert response.status_code == 200
        assert await response.aread() == ANSWER
    assert (provider.connections, len(provider.requests)) == (1, 3)
    for sent in provider.requests:
        head = sent.head.lower()
        assert head.startswith(b"post /v1/chat/completions http/1.1")
        assert b"authorization: bearer sk-provider" in head
        assert b"openai-organization: org-1" in head
        assert f"content-length: {len(CALL)}".encode() in head
        assert b"cookie" not in head
        assert sent.body == CALL


async def test_a_refused_connection_is_a_never_sent_error(
    transports: Callable[..., UpstreamTransport[Any]]
) -> None:
    with pytest.raises(NEVER_SENT):
        await call(transports(), f"http://127.0.0.1:{free_port()}/v1")


async def test_no_free_connection_in_time_is_a_never_sent_error(
    serve: Serve, transports: Callable[..., UpstreamTransport[Any]]
) -> None:
    async def head_then_nothing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                                provider: HostileProvider) -> None:
        await provider.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(30)

    provider, url = await serve(head_then_nothing)
    transport = transports(connections_max=1)
    first = await call(transport, url)
    with pytest.raises(NEVER_SENT):
        await call(transport, url)
    assert len(provider.requests) == 1
    await first.aclose()


@pytest.mark.parametrize("hang_up", ["close", "reset", "garble"])
async def test_a_provider_that_read_the_call_and_failed_is_never_a_never_sent_error(
    serve: Serve, transports: Callable[..., UpstreamTransport[Any]], hang_up: str
) -> None:
    async def read_then_fail(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                             provider: HostileProvider) -> None:
        await provider.read_request(reader)
        if hang_up == "reset":
            reset(writer)
        elif hang_up == "garble":
            writer.write(b"HTTP/1.1 2OO nonsense\r\n\r\n")
            await writer.drain()

    provider, url = await serve(read_then_fail)
    with pytest.raises(httpx.TransportError) as raised:
        await call(transports(), url)
    assert not isinstance(raised.value, NEVER_SENT)
    assert [r.complete for r in provider.requests] == [True]


async def test_an_answer_cut_off_mid_body_fails_its_read_as_unanswered(
    serve: Serve, transports: Callable[..., UpstreamTransport[Any]]
) -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                  provider: HostileProvider) -> None:
        await provider.read_request(reader)
        writer.write(answer()[:-10])
        await writer.drain()
        reset(writer)

    _, url = await serve(cut)
    response = await call(transports(), url)
    with pytest.raises(httpx.TransportError) as raised:
        await response.aread()
    assert not isinstance(raised.value, NEVER_SENT)
