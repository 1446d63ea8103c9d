"""The providers the gateway forwards to: one pooled HTTP client per provider and process, made on
first use. A wire format names its provider (core/formats: WireFormat.provider): the setting
that holds its base URL and its key, and the header the key goes in (OpenAI-compatible calls to
CEILING_UPSTREAM_URL with a bearer key; Anthropic's Messages API to CEILING_ANTHROPIC_URL with an
x-api-key). The client's headers its format forwards (WireFormat.forwarded_headers) go with
each call.

Kept at module scope like the runtime's ledger connection, so a warm serverless instance reuses
its connections to the provider across invocations, and a cold start pays nothing for it until
its first gateway call. httpx and aiohttp (the transport, api/transport.py) are imported with
that first client, not with this module: the gateway's routes are part of every app, and
importing them is a share of a cold start that a deployment using only reserve/settle never
needs (bench/http.py prints the import tree).

Upstream implements the gateway's port, core/upstream.py Upstream, whose failure kinds decide
what happens to the money: a request that provably never left (no connection, no pool slot:
failed before any byte of it was written) is NotSent and can be released; any failure after
that may have been billed, and keeps its hold (tests/api/test_upstream_faults.py makes each of
them happen).
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from api.runtime import VERSION, runtime
from core.config import ConfigError
from core.formats import FORMATS, Api, Plan, WireFormat
from core.text import whole_number
from core.upstream import AnswerTooLarge, Headers, NotSent, Sent, Unanswered

if TYPE_CHECKING:
    import httpx

    from api.transport import Prepared

# Connecting to a provider takes milliseconds; ten seconds is a provider that is down.
CONNECT_TIMEOUT_S = 10.0
# Waiting this long for a free connection means the instance is overloaded: the call is
# released unsent rather than queued behind its lease.
POOL_TIMEOUT_S = 10.0
# Calls one instance makes to the provider at once.
CONNECTIONS_MAX = 256
# An error answer's body is relayed up to this size: an error message, not a document.
ERROR_BODY_BYTES_MAX = 64 * 1024
# A non-streamed answer is held whole (its usage is read from it, and it is relayed with the
# bill's headers), so one larger than this, decoded, is refused rather than read on: a key could
# otherwise make an instance hold gigabytes (n = 128 choices with top_logprobs = 20 is about
# 1.5 KB a token, 6 GB for 32k-token choices). Parsed, an answer dense with logprobs takes about
# six times its size; 32 MiB read and parsed, beside an instance's own ~150 MB, fits the 512 MB
# of a serverless instance (serverless.yml), which serves one call at a time. It relays every
# plain-text answer of a model whose output limit is 32k tokens, even at n = 128 (about 5 bytes a
# token: 21 MB), and Anthropic's answers (one choice, no logprobs); a larger answer is streamed
# (a stream is relayed as it comes, never held whole).
UPSTREAM_ANSWER_BYTES_MAX = 32 * 1024 * 1024
# A client whose paths are made per call (a cloud's name the model) prepares each path once, and
# keeps no more of them than this (a call names a model its upstream serves, resolved before it
# is sent, so an upstream's paths are few).
PATHS_PREPARED_MAX = 256
# Provider headers the client gets: request ids for support, rate limits and retry advice; and
# every provider's own by prefix, on every route (an OpenAI-compatible proxy may front another
# provider and pass its headers on).
RELAYED_HEADERS = frozenset(
    {"content-type", "x-request-id", "request-id", "retry-after", "retry-after-ms",
     "x-should-retry"}
)
RELAYED_HEADER_PREFIXES = tuple(dict.fromkeys(
    prefix for wire in FORMATS.values() for prefix in wire.provider.relayed_header_prefixes))
# The same, as the bytes an answer's head carries: its headers are picked before any is decoded.
_RELAYED_RAW = frozenset(name.encode() for name in RELAYED_HEADERS)
_RELAYED_PREFIXES_RAW = tuple(prefix.encode() for prefix in RELAYED_HEADER_PREFIXES)


def relayed_headers(response: httpx.Response) -> dict[str, str]:
    """The provider's headers the client gets, a repeated one joined with ", " (as httpx joins
    them). Read from the raw head rather than through httpx's decoded views, which decode every
    header of every answer (and first guess the head's encoding) to relay a few of them: CPU on
    every call. Decoded as latin-1, as they are encoded again when they are sent on, so their
    bytes pass unchanged."""
    relayed: dict[str, str] = {}
    for raw_name, raw_value in response.headers.raw:
        name_bytes = raw_name.lower()
        if name_bytes in _RELAYED_RAW or name_bytes.startswith(_RELAYED_PREFIXES_RAW):
            name, value = name_bytes.decode("latin-1"), raw_value.decode("latin-1")
            relayed[name] = f"{relayed[name]}, {value}" if name in relayed else value
    return relayed


def declared_length(response: httpx.Response) -> str:
    """The answer's content-length as it came ("" without one), read as relayed_headers reads."""
    for raw_name, raw_value in response.headers.raw:
        if raw_name.lower() == b"content-length":
            return raw_value.decode("latin-1")
    return ""


def environment_proxy(url: httpx.URL) -> str | None:
    """The proxy the environment names for `url` (HTTPS_PROXY, ALL_PROXY, less NO_PROXY): what
    httpx's client would route through, and its bare transport does not look up itself."""
    if urllib.request.proxy_bypass(url.host):
        return None
    proxies = urllib.request.getproxies()
    return proxies.get(url.scheme) or proxies.get("all")


class Upstream:
    """Sends calls through one pooled transport (api/transport.py: aiohttp's pool under
    httpx's API), without httpx's client.

    The client's per-request machinery (cookie jar, auth and redirect flows, event hooks, URL
    and header merging) is CPU on every call, and the gateway needs none of it: it never follows
    a redirect, and a cookie jar shared by every caller's calls would hand one tenant's provider
    cookies to the next. The transport maps its errors to httpx's by when they happened, and
    httpx.Response still decodes the body."""

    def __init__(self, base_url: str, auth: tuple[str, str] | None, timeout_s: float, *,
                 connections_max: int = CONNECTIONS_MAX,
                 answer_bytes_max: int = UPSTREAM_ANSWER_BYTES_MAX) -> None:
        """`auth`: the header that carries the provider's key, as (name, value)."""
        import httpx  # deferred: see the module docstring

        from api.transport import AiohttpStream, upstream_transport

        self.timeout_s = timeout_s
        self.answer_bytes_max = answer_bytes_max
        base = base_url.rstrip("/")
        headers = [("content-type", "application/json"), ("accept", "*/*"),
                   ("accept-encoding", "gzip, deflate"), ("user-agent", f"spend-ceiling/{VERSION}")]
        if auth is not None:
            headers.append(auth)
        timeout = httpx.Timeout(timeout_s, connect=min(CONNECT_TIMEOUT_S, timeout_s),
                                pool=min(POOL_TIMEOUT_S, timeout_s)).as_dict()
        proxy = environment_proxy(httpx.URL(base))
        try:
            self._transport = upstream_transport(connections_max=connections_max, proxy=proxy)
        except ValueError as exc:
            raise ConfigError(f"the proxy the environment names cannot be used: {exc}") from exc
        # Every call of a route is the same request but for its body (and the few headers of
        # the client's its format forwards): prepared once, for every format's path.
        self._prepared = {api: self._transport.prepare("POST", f"{base}/{api.value}", headers,
                                                       timeout) for api in Api}
        self._counting = {api: self._transport.prepare("POST", f"{base}/{wire.count_path}",
                                                       headers, timeout)
                          for api, wire in FORMATS.items() if wire.count_path}
        # httpx's errors, kept here since httpx is not imported at module scope.
        self._never_sent = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout,
                            httpx.UnsupportedProtocol)
        self._failed = httpx.HTTPError
        self._aiohttp_stream = AiohttpStream
        self._paths: dict[str, Prepared] = {}

    async def send(self, call_plan: Plan, deadline_s: float) -> Sent:
        """core.upstream.Upstream.send: the answer read whole (read()), unless it is an error's
        (ERROR_BODY_BYTES_MAX of it, read past the deadline) or a stream's (its chunks())."""
        try:
            async with asyncio.timeout_at(deadline_s):
                response = await self.open(call_plan)
                if response.status_code < 400 and not call_plan.stream:
                    return (response.status_code, relayed_headers(response),
                            await self.read(response))
        except TimeoutError as exc:
            raise Unanswered(f"no complete answer within {self.timeout_s} s") from exc
        if response.status_code >= 400:
            return (response.status_code, relayed_headers(response),
                    await self.error_body(response))
        return response.status_code, relayed_headers(response), self.chunks(response)

    def open(self, call_plan: Plan) -> Coroutine[Any, Any, httpx.Response]:
        """Send the call and return the provider's answer once its headers arrive: post's own
        coroutine, not one more awaited around it (each resume of the call passes through every
        coroutine it is awaited through)."""
        return self.post(self._prepared[call_plan.wire.api], call_plan.content(),
                         call_plan.headers)

    # What a subclass that makes its own paths and headers (api/upstreams/base.py) sends
    # through: the client's transport, prepared requests and failure sorting, and no more.

    def prepared_at(self, url: str) -> Prepared:
        """The request to `url`: this client's headers and timeouts, at that URL."""
        found = self._paths.get(url)
        if found is None:
            from yarl import URL  # with aiohttp, the transport's own

            # Every route's prepared request has the same headers and timeouts.
            found = replace(next(iter(self._prepared.values())), url=URL(url))
            if len(self._paths) < PATHS_PREPARED_MAX:
                self._paths[url] = found
        return found

    async def post(self, prepared: Prepared, content: bytes,
                   headers: Iterable[tuple[str, str]]) -> httpx.Response:
        """Send `content` to `prepared` and return the answer once its headers arrive: NotSent
        if it provably never left, Unanswered for any failure after."""
        try:
            return await self._transport.send(prepared, content, headers)
        except self._never_sent as exc:
            raise NotSent(_why(exc)) from exc
        except self._failed as exc:
            raise Unanswered(_why(exc)) from exc

    async def count(self, api: Api, content: bytes, headers: Headers, model: str = "") -> Sent:
        """core.upstream.Upstream.count: a count is small, so it is read like an error body.
        The model is the body's (`model` is the same name)."""
        del model
        try:
            response = await self._transport.send(self._counting[api], content, headers)
        except self._failed as exc:
            raise Unanswered(_why(exc)) from exc
        return (response.status_code, relayed_headers(response),
                await self.error_body(response))

    async def aclose(self) -> None:
        await self._transport.aclose()

    async def error_body(self, response: httpx.Response) -> bytes:
        """An error answer's body, up to ERROR_BODY_BYTES_MAX; what arrived if it broke off."""
        body = b""
        try:
            async for chunk in self.chunks(response):
                body += chunk
                if len(body) >= ERROR_BODY_BYTES_MAX:
                    break
        except Unanswered:
            pass
        finally:
            await response.aclose()
        return body[:ERROR_BODY_BYTES_MAX]

    async def read(self, response: httpx.Response) -> bytes:
        """The whole body of an answer, decoded; Unanswered if it broke off, AnswerTooLarge
        once it passes `answer_bytes_max` (UPSTREAM_ANSWER_BYTES_MAX).

        Read chunk by chunk and counted as it comes, so an answer too large is never held past
        the limit: the rest is left unread and its connection closed. An encoded (gzip) answer
        is counted decoded, what it takes in memory rather than on the wire; a chunk (one
        socket read, at most 256 KiB) is decoded whole before it is counted, which JSON's
        compression of about ten to one keeps to a few MiB past the limit."""
        limit = self.answer_bytes_max
        chunks: list[bytes] = []
        size = 0
        try:
            stream = response.stream
            pieces: AsyncIterator[bytes]
            if isinstance(stream, self._aiohttp_stream) and stream.unencoded():
                # Nothing to decode: its declared length is its size, and its chunks are read
                # as they came rather than through httpx's decoding pipeline.
                declared = declared_length(response)
                # Any other length is not trusted: the chunks are counted as they come.
                size_declared = whole_number(declared, len(str(limit)))
                if size_declared is not None and size_declared > limit:
                    raise AnswerTooLarge(f"the answer declares {declared} bytes")
                pieces = aiter(stream)
            else:
                pieces = response.aiter_bytes()
            async for chunk in pieces:
                size += len(chunk)
                if size > limit:
                    raise AnswerTooLarge(f"the answer passed {limit} bytes")
                chunks.append(chunk)
        except self._failed as exc:
            raise Unanswered(_why(exc)) from exc
        finally:
            await response.aclose()
        return b"".join(chunks)

    async def chunks(self, response: httpx.Response) -> AsyncGenerator[bytes, None]:
        """The body of an answer as it arrives; Unanswered if it breaks off. Its connection is
        freed once the body ends or the chunks are closed."""
        try:
            async for chunk in response.aiter_bytes():
                yield chunk
        except self._failed as exc:
            raise Unanswered(_why(exc)) from exc
        finally:
            await response.aclose()


def _why(exc: Exception) -> str:
    return str(exc) or type(exc).__name__  # httpx's timeouts often carry no message


_upstreams: dict[str, Upstream] = {}  # by the setting that names its provider's URL


def upstream(wire: WireFormat) -> Upstream:
    """This process's client of `wire`'s provider; ConfigError when none is configured."""
    provider = wire.provider
    found = _upstreams.get(provider.url_setting)
    if found is not None:
        return found
    config = runtime().config
    url = provider.url(config) if config is not None else None
    if config is None or not url:
        raise ConfigError(provider.unset)
    key = provider.api_key(config)
    found = Upstream(url, provider.auth(key) if key else None, config.upstream_timeout_s)
    return _upstreams.setdefault(provider.url_setting, found)
