"""Fees, fields and bodies the gateway does not hold, tried as a hostile key holder would, judged
by the provider's bill.

- Search models bill a web search on every call that no usage reports. Before the gateway held
  it, 12 calls of `max_tokens: 1` to gpt-4o-mini-search-preview on a $0.05 budget were all
  answered and billed 2.4x the ceiling, and 300 calls 60x.
- Fields the gateway did not understand were forwarded: `plugins` and fallback `models`, which
  an OpenRouter-like upstream bills.
- A body nested 50,000 levels deep answered 500.

Through a real gateway instance (ServiceProcess) in front of the stub provider, with the real
`openai` SDK and raw HTTP; the stub bills search models' fee and, in its OpenRouter mode, the
web plugin and fallback models from its own table (infra/stub_prices.json).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from infra.stub_provider import StubProvider, fetch_bill, reset_bill
from tests.api.conftest import account, as_key, gateway, sdk
from tests.api.hostile import Attack, control, judge

# As the other attack batteries: real gateway processes and a real SDK, outside the dev loop.
pytestmark = pytest.mark.slow

HELLO: list[Any] = [{"role": "user", "content": "hello"}]
# Far above the output cap: every answer runs to its cap, so a call's bill is near its hold.
OUTPUT_TOKENS_MEAN = 1_000_000
DEFAULT_TIER = {"service_tier": "default"}
HOSTILE_ENV = {"CEILING_EXPIRE_POLICY": "release"}
SEARCH_MODEL = "gpt-4o-mini-search-preview"
# $0.05, as the issue's measurement: five searches' worth.
CEILING_MICROS = 50_000
# What the stub bills a search model's call besides its tokens ($10 per 1,000 calls).
SEARCH_FEE_MICROS = 10_000
# Calls that would bill 6x the ceiling if the search were not held.
SEARCH_CALLS = 30
DEPTH = 50_000


@pytest.fixture(scope="module")
def prices_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    """No overrides: every model at the bundled price, the stub at its own table's."""
    path = Path(tmp_path_factory.mktemp("hostile_fees")) / "prices.json"
    path.write_text(json.dumps({"models": {}}))
    return str(path)


@pytest.fixture(scope="module")
def stub() -> Iterator[StubProvider]:
    with StubProvider(seed=19, latency_ms_min=0, latency_ms_max=2,
                      output_tokens_mean=OUTPUT_TOKENS_MEAN) as provider:
        yield provider


@pytest.fixture(scope="module")
def gw(redis_server: RedisServer, prices_file: str, stub: StubProvider
       ) -> Iterator[ServiceProcess]:
    env = {**HOSTILE_ENV, "CEILING_ANTHROPIC_URL": stub.url}
    with gateway(redis_server, prices_file, f"{stub.url}/v1", 30, env) as service:
        yield service


@pytest.fixture(autouse=True)
def fresh_provider(stub: StubProvider) -> Iterator[None]:
    control(stub, default_service_tier="default")
    reset_bill(stub.url)
    yield
    control(stub)


def test_a_search_models_fee_is_held_on_every_call(
    gw: ServiceProcess, admin: Any, stub: StubProvider, redis_server: RedisServer,
) -> None:
    """Chat and Responses calls to a search model with the smallest output, concurrently: each
    is held its search, so the provider bills at most the ceiling, and the ledger commits what
    it billed, to the micro-dollar."""
    tag, key = account(admin, CEILING_MICROS)
    attack = Attack("search model's per-call fee")
    client = sdk(gw, key)

    def one(i: int) -> None:
        if i % 2:
            attack.send(client.chat.completions.with_raw_response.create, model=SEARCH_MODEL,
                        messages=HELLO, max_tokens=1, **DEFAULT_TIER)
        else:
            attack.send(client.responses.with_raw_response.create, model=SEARCH_MODEL,
                        input="hello", max_output_tokens=16, **DEFAULT_TIER)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(SEARCH_CALLS)))
    verdict = judge(attack, stub, redis_server, tag, CEILING_MICROS, exact=True)
    # The hole was the fee: every call the provider billed carried it, and no more were billed
    # than the ceiling has room for searches.
    assert verdict.bill.total.web_search_calls == verdict.provider_calls > 0
    assert verdict.provider_calls <= CEILING_MICROS // SEARCH_FEE_MICROS
    assert attack.refusals["budget_exceeded"] + attack.refusals["budget_busy"] > 0


@pytest.mark.parametrize("model", ["gpt-4o-search-preview", "gpt-5-search-api"])
def test_a_search_model_whose_fee_is_not_known_is_never_forwarded(
    gw: ServiceProcess, admin: Any, stub: StubProvider, model: str,
) -> None:
    _, key = account(admin, CEILING_MICROS)
    attack = Attack(f"search model {model} with no known fee")
    for _ in range(5):
        attack.send(sdk(gw, key).chat.completions.with_raw_response.create, model=model,
                    messages=HELLO, max_tokens=1)
    assert attack.refusals == {"model_unbounded": 5}
    assert fetch_bill(stub.url).requests == 0


@pytest.mark.parametrize("extra", [
    {"plugins": [{"id": "web"}]},  # OpenRouter bills each result
    {"models": ["gpt-4o", "o3"]},  # OpenRouter bills the fallback it served
    {"plugins": [{"id": "web", "max_results": 10}], "models": ["gpt-4o"]},
])
def test_fields_an_upstream_bills_never_reach_it(
    gw: ServiceProcess, admin: Any, stub: StubProvider, redis_server: RedisServer,
    extra: dict[str, Any],
) -> None:
    """Against an upstream that bills `plugins` and `models` (the stub's OpenRouter mode), on
    both OpenAI routes, streamed and not: every call is refused by the field's name, nothing
    reaches the provider, nothing is held."""
    control(stub, default_service_tier="default", upstream_fields="openrouter")
    tag, key = account(admin, CEILING_MICROS)
    attack = Attack(f"unknown fields {sorted(extra)}")
    client = sdk(gw, key)
    for stream in (False, True):
        for _ in range(3):
            attack.send(client.chat.completions.with_raw_response.create, model="gpt-4o-mini",
                        messages=HELLO, max_tokens=50, stream=stream, extra_body=extra)
            attack.send(client.responses.with_raw_response.create, model="gpt-4o-mini",
                        input="hello", max_output_tokens=50, stream=stream, extra_body=extra)
    assert attack.refusals == {"field_unsupported": 12}
    assert fetch_bill(stub.url).requests == 0
    judge(attack, stub, redis_server, tag, CEILING_MICROS, exact=True)


@pytest.mark.parametrize(("path", "auth"), [
    ("/v1/chat/completions", "authorization"),
    ("/v1/responses", "authorization"),
    ("/v1/messages", "x-api-key"),
    ("/v1/reservations", "authorization"),
])
def test_a_body_nested_too_deep_is_a_4xx_on_every_route(
    gw: ServiceProcess, admin: Any, stub: StubProvider, redis_server: RedisServer,
    path: str, auth: str,
) -> None:
    tag, key = account(admin, CEILING_MICROS, roles=("gateway", "sidecar"))
    headers = as_key(key) if auth == "authorization" else {"x-api-key": key}
    deep = b"[" * DEPTH + b"]" * DEPTH
    attack = Attack(f"{DEPTH}-deep body on {path}")
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        for raw in (deep, b'{"model": "gpt-4o", "max_tokens": 5, "metadata": ' + deep + b"}"):
            answer = http.post(path, content=raw, headers={
                **headers, "content-type": "application/json",
                "anthropic-version": "2023-06-01"})
            attack.calls += 1
            assert 400 <= answer.status_code < 500, (path, answer.status_code, answer.text)
    assert fetch_bill(stub.url).requests == 0
    judge(attack, stub, redis_server, tag, CEILING_MICROS, exact=True)
