"""The provider client routes through the proxy the environment names, as httpx's client does."""

from __future__ import annotations

import httpx
import pytest

from api.upstream import environment_proxy

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
