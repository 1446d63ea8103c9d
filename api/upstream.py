"""The provider the gateway forwards to: one pooled HTTP client per process, made on first use.

Kept at module scope like the runtime's ledger connection, so a warm serverless instance reuses
its connections to the provider across invocations, and a cold start pays nothing for it until
its first gateway call.

What a failure proves decides what happens to the money: a request that provably never left
(no connection, no pool slot) can be released; any failure after the request was written may
have been billed, and keeps its hold.
"""

from __future__ import annotations

import httpx

from api.runtime import runtime
from core.config import ConfigError
from core.gateway import Plan

# Connecting to a provider takes milliseconds; ten seconds is a provider that is down.
CONNECT_TIMEOUT_S = 10.0
# Waiting this long for a free connection means the instance is overloaded: the call is
# released unsent rather than queued behind its lease.
POOL_TIMEOUT_S = 10.0
# Calls one instance makes to the provider at once, and connections it keeps warm between them.
CONNECTIONS_MAX = 256
KEEPALIVE_CONNECTIONS_MAX = 64
# An error answer's body is relayed up to this size: an error message, not a document.
ERROR_BODY_BYTES_MAX = 64 * 1024
# Provider headers the client gets: request ids for support, rate limits and retry advice.
RELAYED_HEADERS = frozenset(
    {"content-type", "x-request-id", "retry-after", "retry-after-ms", "x-should-retry"}
)
RELAYED_HEADER_PREFIXES = ("openai-", "x-ratelimit-")


class NotSent(Exception):
    """The request provably never reached the provider."""


class Unanswered(Exception):
    """The request may have reached the provider, and no answer came back."""


def relayed_headers(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items()
            if k in RELAYED_HEADERS or k.startswith(RELAYED_HEADER_PREFIXES)}


class Upstream:
    def __init__(self, base_url: str, api_key: str | None, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._base_url = base_url.rstrip("/")
        headers = {"content-type": "application/json"}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        self.client = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=min(CONNECT_TIMEOUT_S, timeout_s),
                                  pool=min(POOL_TIMEOUT_S, timeout_s)),
            limits=httpx.Limits(max_connections=CONNECTIONS_MAX,
                                max_keepalive_connections=KEEPALIVE_CONNECTIONS_MAX),
        )

    async def open(self, call_plan: Plan) -> httpx.Response:
        """Send the call and return the provider's answer once its headers arrive."""
        request = self.client.build_request(
            "POST", f"{self._base_url}/{call_plan.api.value}", content=call_plan.content()
        )
        try:
            return await self.client.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout,
                httpx.UnsupportedProtocol, httpx.LocalProtocolError) as exc:
            raise NotSent(str(exc) or type(exc).__name__) from exc
        except httpx.HTTPError as exc:
            raise Unanswered(str(exc) or type(exc).__name__) from exc

    async def error_body(self, response: httpx.Response) -> bytes:
        """An error answer's body, up to ERROR_BODY_BYTES_MAX; what arrived if it broke off."""
        body = b""
        try:
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) >= ERROR_BODY_BYTES_MAX:
                    break
        except httpx.HTTPError:
            pass
        finally:
            await response.aclose()
        return body[:ERROR_BODY_BYTES_MAX]


_upstream: Upstream | None = None


def upstream() -> Upstream:
    """This process's provider client; ConfigError when no provider is configured."""
    global _upstream
    if _upstream is None:
        config = runtime().config
        if config is None or not config.upstream_url:
            raise ConfigError(
                "CEILING_UPSTREAM_URL is not set: the gateway has no provider to forward to; "
                "set it to the provider's base URL, such as https://api.openai.com/v1"
            )
        _upstream = Upstream(config.upstream_url, config.upstream_api_key,
                             config.upstream_timeout_s)
    return _upstream
