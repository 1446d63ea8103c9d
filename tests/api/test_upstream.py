"""The provider client routes through the proxy the environment names, as httpx's client does,
and relays the provider's headers the client gets."""

from __future__ import annotations

import httpx
import pytest

from api.upstream import declared_length, environment_proxy, relayed_headers

PROVIDER = httpx.URL("https://api.openai.com/v1/chat/completions")


@pytest.fixture(autouse=True)
def no_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)


def test_no_proxy_is_used_unless_the_environment_names_one() -> None:
    assert environment_proxy(PROVIDER) is None


def test_the_proxy_for_the_providers_scheme_is_used_and_all_proxy_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ALL_PROXY", "http://all.example:3128")
    assert environment_proxy(PROVIDER) == "http://all.example:3128"
    monkeypatch.setenv("HTTPS_PROXY", "http://egress.example:3128")
    assert environment_proxy(PROVIDER) == "http://egress.example:3128"
    assert environment_proxy(httpx.URL("http://127.0.0.1:8900/v1")) == "http://all.example:3128"


def test_no_proxy_exempts_a_provider(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://egress.example:3128")
    monkeypatch.setenv("NO_PROXY", "localhost,api.openai.com")
    assert environment_proxy(PROVIDER) is None


def test_the_relayed_headers_are_picked_by_name_or_prefix_and_keep_their_bytes() -> None:
    answer = httpx.Response(200, headers=[
        (b"Content-Type", b"application/json"), (b"Content-Length", b"12"),
        (b"Server", b"provider"), (b"Set-Cookie", b"session=1"),
        (b"X-Request-Id", b"req_1"), (b"openai-processing-ms", b"7"),
        (b"X-RateLimit-Remaining-Requests", b"99"), (b"anthropic-ratelimit-tokens-limit", b"5"),
        (b"retry-after", b"1"), (b"retry-after", b"2"), (b"x-request-ids", b"no"),
        (b"request-id", "caf\u00e9".encode("latin-1")),
    ])
    assert relayed_headers(answer) == {
        "content-type": "application/json", "x-request-id": "req_1",
        "openai-processing-ms": "7", "x-ratelimit-remaining-requests": "99",
        "anthropic-ratelimit-tokens-limit": "5", "retry-after": "1, 2",
        # As they are sent on (latin-1), byte for byte.
        "request-id": "caf\u00e9",
    }
    assert declared_length(answer) == "12"
    assert declared_length(httpx.Response(200, headers=[(b"server", b"x")])) == ""
