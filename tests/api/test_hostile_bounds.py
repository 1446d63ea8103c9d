"""Fees, fields, bodies and runs the gateway did not bound, tried as a hostile key holder would,
judged by the provider's bill.

- Search models bill a web search on every call that no usage reports. Before the gateway held
  it, 12 calls of `max_tokens: 1` to gpt-4o-mini-search-preview on a $0.05 budget were all
  answered and billed 2.4x the ceiling, and 300 calls 60x.
- Fields the gateway did not understand were forwarded: `plugins` and fallback `models`, which
  an OpenRouter-like upstream bills.
- A body nested 50,000 levels deep answered 500.
- A key's run was counted in the counters of an operator's budget of the same id: see the
  last test.

Through a real gateway instance (ServiceProcess) in front of the stub provider, with the real
`openai` SDK and raw HTTP; the stub bills search models' fee and, in its OpenRouter mode, the
web plugin and fallback models from its own table (infra/stub_prices.json).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import redis

from core.stores import keys
from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from infra.stub_provider import StubProvider, fetch_bill, reset_bill
from tests.api.conftest import Client, account, as_key, gateway, sdk
from tests.api.hostile import Attack, blocking, control, expire_held, judge
from tests.support import write_prices

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
# gpt-4o at 100 output tokens: some 1,000 micro-dollars a call, so the run's ceiling admits a
# handful of the attack's calls and the organisation's (far above) never binds.
RUN_CEILING_MICROS = 5_000
ORG_CEILING_MICROS = 1_000_000
TEAM_CEILING_MICROS = 1_000_000
MAX_OUTPUT_TOKENS = 100
# More than twice what the run's ceiling admits: past it, the run must be refused.
ATTACK_CALLS = 12
RUN_ID = "batch"
# Run ids that try to name another budget's path or counter, or a hash tag: refused (422).
CRAFTED_RUN_IDS = ("x/team:t", "batch|total", "{org:x}", "run:batch", "../../team:t")


@pytest.fixture(scope="module")
def prices_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    """No overrides: every model at the bundled price, the stub at its own table's."""
    return write_prices(tmp_path_factory, "hostile_bounds", {"models": {}})


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


# -- a run against an operator's budget -------------------------------------------------------
# A key holder's runs tried against the operator's budgets, judged by the provider's bill and
# the ledger's records in Redis.
#
# The ledger counts a key's run as the budget `<key's budget>/run:<run id>`, in the counters
# (core/stores/keys.py counter) an operator's budget of that id would have. When an operator could
# make a budget `org:x/run:batch`, six calls of another key of org:x with `X-Ceiling-Run-Id: batch`
# moved that budget's committed spend from 601 to 72,607 micro-dollars, its own key was refused
# 402, and the run's idle expiry was put on that budget's lifetime total. Now `run` (and `user`)
# are scope kinds no operator may name: the operator's attempt is refused, and the run's calls move
# the run's counter and the key's own budget, nothing else, within the run's ceiling.


# -- the ledger's records, read from Redis ---------------------------------------------------


def stored(redis_url: str, tag: str) -> dict[str, tuple[Any, bool]]:
    """Every budget definition and counter of `tag` as Redis holds it: its value, and whether it
    goes by itself, by an expiry or by the sweep of its tag's windows or runs index (a lifetime
    total must not)."""
    raw = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        out: dict[str, tuple[Any, bool]] = {}
        for part in (keys.DEFINITION, keys.COUNTER):
            for name in raw.scan_iter(match=f"{keys.prefix(tag)}{part}*", count=1_000):
                value = raw.hgetall(name) if raw.type(name) == "hash" else raw.get(name)
                suffix = name.removeprefix(keys.prefix(tag))
                swept = any(raw.zscore(keys.prefix(tag) + index, suffix) is not None
                            for index in (keys.WINDOWS, keys.RUNS))
                out[name] = (value, raw.pttl(name) >= 0 or swept)
        return out
    finally:
        raw.close()


def committed(records: dict[str, tuple[Any, bool]], name: str) -> int:
    fields, _ = records.get(name, ({}, False))
    assert isinstance(fields, dict)
    assert int(fields.get("reserved", 0)) == 0, f"{name} still holds money"
    return int(fields.get("committed", 0))


def test_a_run_never_moves_a_budget_an_operator_made(
    gw: ServiceProcess, admin: Client, stub: StubProvider, redis_server: RedisServer,
) -> None:
    tag = f"org:h{uuid.uuid4().hex[:10]}"
    team = f"{tag}/team:t"
    admin.budget(tag, ORG_CEILING_MICROS)
    admin.budget(team, TEAM_CEILING_MICROS)
    # The team spends first, under a run of the same id, so its budget and its own run have
    # counters the attack could move.
    team_key = admin.key(team, RUN_CEILING_MICROS)["Authorization"].removeprefix("Bearer ")
    sdk(gw, team_key).chat.completions.create(
        model="gpt-4o", messages=HELLO, max_tokens=MAX_OUTPUT_TOKENS,
        extra_headers={"X-Ceiling-Run-Id": RUN_ID}, service_tier="default")

    # The operator tries to make the budget the run's counter would be: refused, nothing stored.
    run_budget = f"{tag}/run:{RUN_ID}"
    for method, path, body in (
        ("PUT", f"/v1/admin/budgets/{run_budget}",
         {"limits": [{"period": "total", "ceiling_micros": TEAM_CEILING_MICROS}]}),
        ("POST", "/v1/admin/keys", {"budget_id": run_budget}),
    ):
        r = admin.admin(method, path, json=body)
        assert (r.status_code, r.json()["error"]["code"]) == (422, "invalid_request"), r.text
        assert "reserved kind 'run'" in r.json()["error"]["message"]
    assert admin.admin("GET", f"/v1/admin/budgets/{run_budget}").status_code == 404
    before = stored(redis_server.url, tag)
    assert keys.definition(tag, run_budget) not in before
    reset_bill(stub.url)  # the attack is judged by its own bill

    # The attack: another key of org:x, with a run ceiling, spends under the run id `batch`,
    # past the run's ceiling, then with run ids that try to name other paths and counters.
    key = admin.key(tag, RUN_CEILING_MICROS)["Authorization"].removeprefix("Bearer ")
    chat = sdk(gw, key).chat.completions
    attack = Attack("runs: a run named as an operator's budget")
    for run_id in [RUN_ID] * ATTACK_CALLS + list(CRAFTED_RUN_IDS):
        attack.send(chat.with_raw_response.create, model="gpt-4o", messages=HELLO,
                    max_tokens=MAX_OUTPUT_TOKENS, extra_headers={"X-Ceiling-Run-Id": run_id},
                    service_tier="default")
    assert attack.refusals["budget_exceeded"] > 0, "the run's ceiling never refused a call"
    assert attack.refusals["invalid_request"] == len(CRAFTED_RUN_IDS)
    assert set(attack.outcomes()) == {"billed"}

    # Judged as tests/api/hostile.py judges: every hold resolved, then the bill and the books.
    blocking(expire_held(redis_server.url, tag))
    bill = fetch_bill(stub.url)
    after = stored(redis_server.url, tag)
    org_counter = keys.counter(tag, tag, "total")
    run_counter = keys.counter(tag, run_budget, "total")
    org_moved = committed(after, org_counter) - committed(before, org_counter)
    run_committed = committed(after, run_counter)
    print(f"\nhostile | runs | calls {attack.calls}, provider billed {bill.total.calls} | run "
          f"ceiling {RUN_CEILING_MICROS} | billed {bill.total.cost_micros} | run committed "
          f"{run_committed} | org moved {org_moved} | refusals {dict(attack.refusals)}")

    assert len(bill.log) == len(attack.forwarded) == bill.total.calls
    over = [(f.reservation_id, f.held_micros, c.cost_micros)
            for f, c in zip(attack.forwarded, bill.log, strict=True)
            if c.cost_micros > f.held_micros]
    assert not over, f"billed above the hold (id, held, billed): {over}"
    assert bill.total.cost_micros <= RUN_CEILING_MICROS, "the provider's bill passed the run"
    assert bill.total.cost_micros <= committed(after, org_counter), "org:x committed less"
    # Every outcome was known: the run holds the bill to the micro-dollar, and org:x moved by
    # the run's spend, no more.
    assert run_committed == org_moved == bill.total.cost_micros > 0

    # The run's counter (new, expiring when idle) and the key's own budget are all that moved:
    # every other definition and counter of org:x is as it was, the team's lifetime total still
    # without an expiry, and no definition was made under the run's id.
    assert run_counter not in before
    assert after[run_counter][1], "a run's counter expires when idle"
    moved = {name for name in before.keys() | after.keys() if before.get(name) != after.get(name)}
    assert moved == {org_counter, run_counter}, moved
    team_total = keys.counter(tag, team, "total")
    assert committed(after, team_total) > 0
    assert after[team_total] == before[team_total]
    assert not after[team_total][1], "the team's lifetime total was given an expiry"
    assert not any(name.startswith(keys.definition(tag, run_budget)) for name in after)
    # The team's key still spends: nothing of the attack reached its budget or its run.
    raw = sdk(gw, team_key).chat.completions.with_raw_response.create(
        model="gpt-4o", messages=HELLO, max_tokens=MAX_OUTPUT_TOKENS,
        extra_headers={"X-Ceiling-Run-Id": RUN_ID}, service_tier="default")
    assert raw.http_response.status_code == 200
