"""The gateway's upstream client: one boundary (`upstream_transport`), two clients behind it.

httpx is the gateway's client API either way: requests, responses, errors and content decoding
are httpx's, and api/upstream.py sees only `UpstreamTransport` (prepare a request once, send it
with a body). What sends is chosen by CEILING_UPSTREAM_CLIENT:

- `aiohttp` (the default): aiohttp's connection pool under httpx's API (AiohttpTransport).
  httpx's own pool (httpcore) checks every pooled connection for readability on each request
  and runs through anyio's portability layer, both CPU on every call; aiohttp's pool learns
  that a connection closed from the event loop itself and hands out the next live one at once.
  docs/measured.md has what it buys per call.
- `httpx`: httpx's own transport, httpcore's pool (HttpxTransport): one HTTP library, for a
  deployment that would rather not carry the second, or to judge the first against it.

What an error proves is decided by when it happened, and that decides what the gateway does
with the money (api/upstream.py); both clients' errors are httpx's and mean the same:

- Before any byte of the request was written, httpx.ConnectError / httpx.ConnectTimeout /
  httpx.PoolTimeout: aiohttp raises ClientConnectorError (refused, no such name, TLS handshake,
  proxy unreachable) and ConnectionTimeoutError (no free connection in the pool, or no
  connection, in time) only from its connector, before a connection is handed to the request;
  httpcore raises its connect and pool errors only while it acquires a connection. The
  provider never saw the call.
- After that, everything else: a connection lost while the request was written or before the
  answer came, a reset, a garbled or cut-off answer, a read timeout. The provider may have read
  the request and run it. These are httpx.ReadError / httpx.WriteError /
  httpx.RemoteProtocolError / httpx.ReadTimeout / httpx.WriteTimeout, never a connect error,
  whatever aiohttp's own name for them suggests.

Neither client retries a POST once any of it was written (aiohttp's retry of a dropped
keep-alive connection is for idempotent methods only; httpcore retries only a connection that
was not yet given the request), so a call is written at most once.

Either transport keeps no cookies: one pool carries every tenant's calls, and a provider's
cookie drawn by one tenant's call must not ride on the next. Redirects are not followed: an
answer is relayed as the provider gave it. Bodies are left encoded for httpx to decode.
AiohttpTransport makes its ClientSession on first use inside the event loop that uses it
(aiohttp binds a session to its loop); used from another loop it makes itself a new one.
"""

from __future__ import annotations

import asyncio
import os
import ssl
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol, TypeVar

import aiohttp
import httpx
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

# Idle connections are closed after this long, before the provider closes them: a request
# written onto a connection the provider is closing at that moment may or may not have run, and
# is held as unknown. Servers commonly close idle connections after 5 s (uvicorn's default, and
# so vLLM's and most Python servers'), providers' load balancers later.
KEEPALIVE_S = 4.0
# Header lines of an answer, and the whole head's field count: a provider's answer has a few
# dozen short headers; above these it is refused as garbled (unanswered).
HEADER_LINE_BYTES_MAX = 16 * 1024
HEADERS_MAX = 256
PROXY_SCHEMES = frozenset({"http", "https"})

# The setting that picks the client behind the boundary (UpstreamClient), read when a provider's
# client is made.
UPSTREAM_CLIENT_SETTING = "CEILING_UPSTREAM_CLIENT"


class UpstreamClient(StrEnum):
    """What sends the gateway's calls; see the module docstring."""

    AIOHTTP = "aiohttp"
    HTTPX = "httpx"


P = TypeVar("P")


class UpstreamTransport(Protocol[P]):
    """What api/upstream.py sends through: a request prepared once, sent many times."""

    def prepare(self, method: str, url: str, headers: Iterable[tuple[str, str]],
                timeout: Mapping[str, float | None] | None = None) -> P:
        """A request's fixed parts (all but its body), in the form the client sends them.
        `timeout` as httpx gives it (Timeout.as_dict())."""
        ...

    async def send(self, prepared: P, content: bytes, headers: Iterable[tuple[str, str]] = (),
                   request: httpx.Request | None = None) -> httpx.Response:
        """Send `content` as the body of `prepared`, with `headers` added to its own; the answer
        once its head has arrived, its body to be read from the response's stream."""
        ...

    async def aclose(self) -> None: ...


def checked_proxy(proxy: str) -> URL:
    """`proxy` as a URL; ValueError unless it is one both clients carry out."""
    url = URL(proxy)
    if url.scheme not in PROXY_SCHEMES:
        raise ValueError(f"the provider's proxy must be http:// or https://: {proxy!r}")
    return url


def upstream_client(environ: Mapping[str, str] = os.environ) -> UpstreamClient:
    """The client UPSTREAM_CLIENT_SETTING names (aiohttp when it is unset); ValueError for any
    other value."""
    given = environ.get(UPSTREAM_CLIENT_SETTING, "").strip().lower()
    try:
        return UpstreamClient(given or UpstreamClient.AIOHTTP)
    except ValueError:
        raise ValueError(f"{UPSTREAM_CLIENT_SETTING} must be one of "
                         f"{', '.join(UpstreamClient)}, not {given!r}") from None


def upstream_transport(*, connections_max: int, proxy: str | None = None,
                       verify: ssl.SSLContext | bool = True,
                       client: UpstreamClient | None = None) -> UpstreamTransport[Any]:
    """The transport of one provider's calls: `client`'s, or the one the environment names
    (upstream_client). ValueError for a proxy neither client can use, or an unknown client."""
    chosen = client or upstream_client()
    if chosen is UpstreamClient.HTTPX:
        return HttpxTransport(connections_max=connections_max, proxy=proxy, verify=verify)
    return AiohttpTransport(connections_max=connections_max, proxy=proxy, verify=verify)


@dataclass(frozen=True)
class Prepared:
    """What a request sent many times keeps: all but its body (AiohttpTransport.prepare)."""

    method: str
    url: URL
    headers: CIMultiDictProxy[str]
    timeout: aiohttp.ClientTimeout


class AiohttpTransport(httpx.AsyncBaseTransport):
    """Sends httpx requests through one pooled aiohttp.ClientSession; see the module docstring."""

    def __init__(self, *, connections_max: int, proxy: str | None = None,
                 verify: ssl.SSLContext | bool = True) -> None:
        self._connections_max = connections_max
        self._proxy: URL | None = None
        self._proxy_auth: aiohttp.BasicAuth | None = None
        if proxy is not None:
            url = checked_proxy(proxy)
            self._proxy_auth = aiohttp.BasicAuth.from_url(url)
            self._proxy = url.with_user(None)
        self._verify = verify
        self._ssl: ssl.SSLContext | bool | None = None
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _session_here(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop or self._session.closed:
            if self._ssl is None:
                # As httpx's own transport verifies (its CA bundle, SSL_CERT_FILE and
                # SSL_CERT_DIR), made once: loading a CA bundle is slow.
                self._ssl = (httpx.create_ssl_context(verify=self._verify)
                             if self._verify is not False else False)
            connector = aiohttp.TCPConnector(
                limit=self._connections_max, limit_per_host=0, keepalive_timeout=KEEPALIVE_S,
                ssl=self._ssl,
            )
            self._session = aiohttp.ClientSession(
                connector=connector, cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False, trust_env=False, proxy=self._proxy,
                proxy_auth=self._proxy_auth, timeout=aiohttp.ClientTimeout(total=None),
                max_field_size=HEADER_LINE_BYTES_MAX, max_line_size=HEADER_LINE_BYTES_MAX,
                max_headers=HEADERS_MAX,
            )
            self._loop = loop
        return self._session

    def prepare(self, method: str, url: str, headers: Iterable[tuple[str, str]],
                timeout: Mapping[str, float | None] | None = None) -> Prepared:
        """A request's fixed parts in the form aiohttp sends them, made once for many sends.

        `timeout` as httpx gives it (Timeout.as_dict()): aiohttp's `connect` covers the wait
        for a pool slot and the connecting, its `sock_connect` the connecting alone; aiohttp
        has no write timeout."""
        given = timeout or {}
        connect_s, read_s, pool_s = given.get("connect"), given.get("read"), given.get("pool")
        return Prepared(method, URL(url), CIMultiDictProxy(CIMultiDict(headers)),
                        aiohttp.ClientTimeout(
                            total=None, sock_connect=connect_s, sock_read=read_s,
                            connect=None if connect_s is None or pool_s is None
                            else connect_s + pool_s))

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        # The gateway sends through send() with requests it prepared once (api/upstream.py);
        # this is httpx's way in, for any other request.
        prepared = self.prepare(request.method, str(request.url), request.headers.multi_items(),
                                request.extensions.get("timeout"))
        return await self.send(prepared, request.content, request=request)

    async def send(self, prepared: Prepared, content: bytes,
                   headers: Iterable[tuple[str, str]] = (),
                   request: httpx.Request | None = None) -> httpx.Response:
        """Send `content` as the body of `prepared`, with `headers` added to its own; the answer
        once its head has arrived, its body to be read from the response's stream."""
        session = self._session_here()
        sent_headers: CIMultiDictProxy[str] | CIMultiDict[str] = prepared.headers
        if headers:
            sent_headers = CIMultiDict(prepared.headers)
            sent_headers.extend(headers)
        try:
            response = await session.request(
                prepared.method, prepared.url, headers=sent_headers, data=content,
                allow_redirects=False, timeout=prepared.timeout,
            )
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError,
                aiohttp.InvalidURL, aiohttp.NonHttpUrlClientError) as exc:
            raise not_sent(exc, request) from exc
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise unanswered(exc, request) from exc
        return httpx.Response(
            response.status, headers=response.raw_headers, stream=AiohttpStream(response, request),
            request=request,
            extensions={"http_version": b"HTTP/1.1",
                        "reason_phrase": (response.reason or "").encode()},
        )

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None


class AiohttpStream(httpx.AsyncByteStream):
    """An answer's body as it arrives; the connection goes back to the pool once the body was
    read to its end, and is closed if it was left unread."""

    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request | None) -> None:
        self._response = response
        self._request = request

    def __aiter__(self) -> AsyncIterator[bytes]:
        # Its own iterator, read once: an async generator over aiohttp's iter_any() made two
        # iterators and a generator's steps for every answer.
        return self

    async def __anext__(self) -> bytes:
        try:
            chunk = await self._response.content.readany()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise unanswered(exc, self._request) from exc
        if not chunk:  # readany's end of the body
            raise StopAsyncIteration
        return chunk

    def unencoded(self) -> bool:
        """Whether the body has no content-encoding: its chunks, as they come, are then the
        body, with nothing for httpx to decode."""
        return "Content-Encoding" not in self._response.headers

    async def aclose(self) -> None:
        self._response.release()


@dataclass(frozen=True)
class HttpxPrepared:
    """What a request sent many times keeps, for HttpxTransport: all but its body."""

    method: str
    url: httpx.URL
    headers: tuple[tuple[bytes, bytes], ...]
    timeout: dict[str, float | None]


class HttpxTransport(httpx.AsyncBaseTransport):
    """Sends through httpx's own pooled transport (httpcore), without httpx's client: the
    client's per-request machinery (cookie jar, auth and redirect flows, event hooks, URL and
    header merging) is nothing the gateway wants; see the module docstring."""

    def __init__(self, *, connections_max: int, proxy: str | None = None,
                 verify: ssl.SSLContext | bool = True) -> None:
        if proxy is not None:
            checked_proxy(proxy)
        self._pool = httpx.AsyncHTTPTransport(
            verify=verify, proxy=proxy, retries=0,
            limits=httpx.Limits(max_connections=connections_max,
                                max_keepalive_connections=connections_max,
                                keepalive_expiry=KEEPALIVE_S))

    def prepare(self, method: str, url: str, headers: Iterable[tuple[str, str]],
                timeout: Mapping[str, float | None] | None = None) -> HttpxPrepared:
        made = httpx.Request(method, url, headers=list(headers))
        # httpx adds Host and a Content-Length for an empty body: each send gives its own length.
        return HttpxPrepared(made.method, made.url,
                             tuple((k, v) for k, v in made.headers.raw
                                   if k.lower() != b"content-length"),
                             dict(timeout or {}))

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self._pool.handle_async_request(request)

    async def send(self, prepared: HttpxPrepared, content: bytes,
                   headers: Iterable[tuple[str, str]] = (),
                   request: httpx.Request | None = None) -> httpx.Response:
        sent_headers = [*prepared.headers, *((k.encode(), v.encode()) for k, v in headers),
                        (b"content-length", str(len(content)).encode())]
        request = httpx.Request(prepared.method, prepared.url, headers=sent_headers,
                                content=content, extensions={"timeout": prepared.timeout})
        response = await self._pool.handle_async_request(request)
        response.request = request
        return response

    async def aclose(self) -> None:
        await self._pool.aclose()


def not_sent(exc: Exception, request: httpx.Request | None) -> httpx.TransportError:
    message = describe(exc)
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(message, request=request)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(message, request=request)
    return httpx.UnsupportedProtocol(message, request=request)


def unanswered(exc: BaseException, request: httpx.Request | None) -> httpx.TransportError:
    message = describe(exc)
    if isinstance(exc, TimeoutError):
        return httpx.ReadTimeout(message, request=request)
    if isinstance(exc, aiohttp.ClientPayloadError | aiohttp.ClientResponseError):
        return httpx.RemoteProtocolError(message, request=request)
    return httpx.ReadError(message, request=request)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
