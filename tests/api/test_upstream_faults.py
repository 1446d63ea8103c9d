"""What a failure to reach the provider proves, decided by when it happened (api/upstream.py).

A failure before any byte of the request was written proves the provider never saw the call:
NotSent, and the gateway releases its hold. Any failure after that may come after the provider
read the request and started billing it: Unanswered, and the hold is kept as unknown. Each test
is a provider misbehaving on a real loopback socket (HostileProvider) in front of the gateway's
own client, judged by what the provider's socket received, never by what the client says.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from api.upstream import CONNECTIONS_MAX, Upstream
from core.formats import Api, Plan
from core.gateway_request import plan
from core.upstream import NotSent, Unanswered
from infra.processes import free_port

# Long enough for a body that is still being written when the provider resets: more than a
# loopback socket's buffers take at once.
LONG_TEXT_BYTES = 8 * 1024 * 1024
# A provider that answers nothing is given up on this fast.
TIMEOUT_S = 1.0
ANSWER = json.dumps({"id": "x", "choices": [], "usage": {
    "prompt_tokens": 1, "completion_tokens": 1}}).encode()


def call_plan(text: str = "hello") -> Plan:
    return plan(Api.CHAT, json.dumps({
        "model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 5,
    }).encode())


def answer(body: bytes = ANSWER, extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n" + extra + b"\r\n" + body)


def reset(writer: asyncio.StreamWriter) -> None:
    """Hang up with a TCP reset, as a crashing server or a middlebox does."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@dataclass
class Request:
    head: bytes
    body: bytes
    complete: bool


@dataclass
class HostileProvider:
    """A loopback HTTP/1.1 server that runs `behave` on each connection.

    `behave` gets the connection's reader and writer and the provider itself; `requests` keeps
    what each request's bytes were as the provider read them, and `connections` how many
    connections it accepted."""

    behave: Callable[[asyncio.StreamReader, asyncio.StreamWriter, HostileProvider],
                     Awaitable[None]]
    requests: list[Request] = field(default_factory=list)
    connections: int = 0
    received: asyncio.Event = field(default_factory=asyncio.Event)

    async def read_request(self, reader: asyncio.StreamReader, body_bytes_max: int | None = None
                           ) -> Request | None:
        """One request as far as the provider reads it: its head, and its body up to
        `body_bytes_max` (None: all of it)."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        wanted = length if body_bytes_max is None else min(length, body_bytes_max)
        body = await reader.readexactly(wanted)
        request = Request(head, body, complete=wanted == length)
        self.requests.append(request)
        self.received.set()
        return request

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.behave(reader, writer, self)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Awaitable[tuple[HostileProvider, str]]]]:
    servers: list[asyncio.Server] = []

    async def start(behave: Callable[..., Awaitable[None]]) -> tuple[HostileProvider, str]:
        provider = HostileProvider(behave)
        server = await asyncio.start_server(provider._serve, "127.0.0.1", 0)
        servers.append(server)
        port = server.sockets[0].getsockname()[1]
        return provider, f"http://127.0.0.1:{port}/v1"

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


@pytest.fixture(params=["aiohttp", "httpx"])
async def clients(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
                  ) -> AsyncIterator[Callable[..., Upstream]]:
    """Each fault on both upstream clients (CEILING_UPSTREAM_CLIENT): the money rules hold
    whichever carries the call."""
    monkeypatch.setenv("CEILING_UPSTREAM_CLIENT", request.param)
    made: list[Upstream] = []

    def make(url: str, *, connections_max: int = CONNECTIONS_MAX) -> Upstream:
        client = Upstream(url, ("authorization", "Bearer sk-provider"), TIMEOUT_S,
                          connections_max=connections_max)
        made.append(client)
        return client

    yield make
    for client in made:
        await client.aclose()


async def read_then_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           provider: HostileProvider) -> None:
    while await provider.read_request(reader) is not None:
        writer.write(answer())
        await writer.drain()


# -- before anything is written: nothing was sent -------------------------------------------------


async def test_a_refused_connection_was_not_sent(clients: Callable[..., Upstream]) -> None:
    with pytest.raises(NotSent):
        await clients(f"http://127.0.0.1:{free_port()}/v1").open(call_plan())


async def test_a_name_that_does_not_resolve_was_not_sent(clients: Callable[..., Upstream]) -> None:
    # .invalid never resolves (RFC 6761): the resolver answers at once that it does not exist.
    with pytest.raises(NotSent):
        await clients("http://provider.invalid/v1").open(call_plan())


async def test_no_free_connection_in_time_was_not_sent(
    serve: Callable[..., Awaitable[tuple[HostileProvider, str]]],
    clients: Callable[..., Upstream],
) -> None:
    async def headers_then_nothing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                                   provider: HostileProvider) -> None:
        await provider.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"content-length: 100\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(30)

    provider, url = await serve(headers_then_nothing)
    client = clients(url, connections_max=1)
    # The one connection is taken by an answer whose body has not come yet.
    first = await client.open(call_plan())
    with pytest.raises(NotSent):
        await client.open(call_plan())
    assert (provider.connections, len(provider.requests)) == (1, 1)
    await first.aclose()


# -- once the request may have been read: unanswered, held ----------------------------------------


async def test_a_provider_that_reads_the_request_and_hangs_up_left_it_unanswered(
    serve: Callable[..., Awaitable[tuple[HostileProvider, str]]],
    clients: Callable[..., Upstream],
) -> None:
    async def read_and_hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                               provider: HostileProvider) -> None:
        await provider.read_request(reader)

    provider, url = await serve(read_and_hang_up)
    with pytest.raises(Unanswered):
        await clients(url).open(call_plan())
    (request,) = provider.requests
    assert request.complete  # the provider had the whole call: it may have run it


async def test_a_provider_that_reads_the_request_and_resets_left_it_unanswered(
    serve: Callable[..., Awaitable[tuple[HostileProvider, str]]],
    clients: Callable[..., Upstream],
) -> None:
    async def read_and_reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                             provider: HostileProvider) -> None:
        await provider.read_request(reader)
        reset(writer)

    provider, url = await serve(read_and_reset)
    with pytest.raises(Unanswered):
        await clients(url).open(call_plan())
    assert [r.complete for r in provider.requests] == [True]


async def test_a_provider_that_resets_mid_body_left_it_unanswered(
    serve: Callable[..., Awaitable[tuple[HostileProvider, str]]],
    clients: Callable[..., Upstream],
) -> None:
    async def reset_mid_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                             provider: HostileProvider) -> None:
        await provider.read_request(reader, body_bytes_max=1024)
        reset(writer)

    provider, url = await serve(reset_mid_body)
    with pytest.raises(Unanswered):
        await clients(url).open(call_plan("x" * LONG_TEXT_BYTES))
    (request,) = provider.requests
    assert not request.complete
    assert len(request.body) == 1024


async def test_a_provider_that_never_answers_left_it_unanswered(
    serve: Callable[..., Awaitable[tuple[HostileProvider, str]]],
    clients: Callable[..., Upstream],
) -> None:
    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           provider: HostileProvider) -> None:
        await provider.read_request(reader)
        await asyncio.sleep(30)

    provider, url = await serve(never_answer)
    started_s = asyncio.get_running_loop().time()
    with pytest.raises(Unanswered):
        await clients(url).open(call_plan())
    assert asyncio.get_running_loop().time() - started_s < 5 * TIMEOUT_S
    assert [r.complete for r in provider.requests] == [True]


async def test_an_answer_cut_off_mid_body_is_unanswered_when_read(
    serve: Callable[..., Awaitable[tuple[HostileProvider, str]]],
    clients: Callable[..., Upstream],
) -> None:
    async def cut_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         provider: HostileProvider) -> None:
        await provider.read_request(reader)
        writer.write(answer()[:-10])
        await writer.drain()
        reset(writer)

    _, url = await serve(cut_answer)
    client = clients(url)
    response = await client.open(call_plan())
    assert response.status_code == 200
    with pytest.raises(Unanswered):
        await client.read(response)
    response = await client.open(call_plan())
    with pytest.raises(Unanswered):
        async for _ in client.chunks(response):
            pass


async def test_a_garbled_answer_is_unanswered(
    serve: Callable[..., Awaitable[tuple[HostileProvider, str]]],
    clients: Callable[..., Upstream],
) -> None:
    async def garble(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     provider: HostileProvider) -> None:
        await provider.read_request(reader)
        writer.write(b"HTTP/1.1 2OO nonsense\r\n\r\n")
        await writer.drain()

    _, url = await serve(garble)
    with pytest.raises(Unanswered):
        await clients(url).open(call_plan())


# -- the pool: one per process, no cookies, connections reused only while they are alive ----------


async def test_calls_share_connections_and_no_cookie_goes_back(
    serve: Callable[..., Awaitable[tuple[HostileProvider, str]]],
    clients: Callable[..., Upstream],
) -> None:
    async def set_cookie(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         provider: HostileProvider) -> None:
        while await provider.read_request(reader) is not None:
            # A provider's cookie (a load balancer's affinity, a session) belongs to whichever
            # tenant's call drew it: the next call, maybe another tenant's, must not carry it.
            writer.write(answer(extra=b"set-cookie: tenant=a; Path=/\r\n"))
            await writer.drain()

    provider, url = await serve(set_cookie)
    client = clients(url)
    for _ in range(3):
        response = await client.open(call_plan())
        assert await client.read(response) == ANSWER
    assert (provider.connections, len(provider.requests)) == (1, 3)
    assert not any(b"cookie" in r.head.lower().replace(b"set-cookie", b"")
                   for r in provider.requests)
    head = provider.requests[0].head.lower()
    assert b"authorization: bearer sk-provider" in head
    assert b"post /v1/chat/completions http/1.1" in head


async def test_a_connection_the_provider_closed_is_not_reused(
    serve: Callable[..., Awaitable[tuple[HostileProvider, str]]],
    clients: Callable[..., Upstream],
) -> None:
    async def answer_and_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                               provider: HostileProvider) -> None:
        await provider.read_request(reader)
        writer.write(answer())  # keep-alive by HTTP/1.1's default, then closed while idle
        await writer.drain()
        await asyncio.sleep(0.05)

    provider, url = await serve(answer_and_close)
    client = clients(url)
    for _ in range(3):
        response = await client.open(call_plan())
        assert await client.read(response) == ANSWER
        await asyncio.sleep(0.2)
    assert (provider.connections, len(provider.requests)) == (3, 3)


async def test_a_compressed_answer_is_read_decoded(
    serve: Callable[..., Awaitable[tuple[HostileProvider, str]]],
    clients: Callable[..., Upstream],
) -> None:
    async def gzipped(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      provider: HostileProvider) -> None:
        await provider.read_request(reader)
        writer.write(answer(gzip.compress(ANSWER), b"content-encoding: gzip\r\n"))
        await writer.drain()

    _, url = await serve(gzipped)
    client = clients(url)
    assert await client.read(await client.open(call_plan())) == ANSWER


async def test_the_environments_proxy_carries_the_call(
    serve: Callable[..., Awaitable[tuple[HostileProvider, str]]],
    clients: Callable[..., Upstream],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    proxy, proxy_url = await serve(read_then_answer)
    for name in ("no_proxy", "NO_PROXY", "all_proxy", "ALL_PROXY", "https_proxy", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", proxy_url.removesuffix("/v1"))
    client = clients("http://provider.example/v1")  # resolved by the proxy, not here
    assert await client.read(await client.open(call_plan())) == ANSWER
    (request,) = proxy.requests
    assert request.head.startswith(b"POST http://provider.example/v1/chat/completions HTTP/1.1")
