"""A key holder's runs tried against the operator's budgets, judged by the provider's bill and
the ledger's records in Redis.

The ledger counts a key's run as the budget `<key's budget>/run:<run id>`, in the counters
(core/stores/keys.py counter) an operator's budget of that id would have. When an operator could
make a budget `org:x/run:batch`, six calls of another key of org:x with `X-Ceiling-Run-Id: batch`
moved that budget's committed spend from 601 to 72,607 micro-dollars, its own key was refused
402, and the run's idle expiry was put on that budget's lifetime total. Now `run` (and `user`)
are scope kinds no operator may name: the operator's attempt is refused, and the run's calls move
the run's counter and the key's own budget, nothing else, within the run's ceiling.

Through a real gateway instance (ServiceProcess) in front of the stub provider, with the real
`openai` SDK, as tests/api/test_hostile.py does.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from core.stores import keys
from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from infra.stub_provider import StubProvider, fetch_bill, reset_bill
from tests.api.conftest import Client, gateway, sdk
from tests.api.hostile import Attack, blocking, control, expire_held

# As the other attack batteries: real gateway processes and a real SDK, outside the dev loop.
pytestmark = pytest.mark.slow

HELLO: list[Any] = [{"role": "user", "content": "hello"}]
# Far above the output cap: every answer runs to its cap, so a call's bill is near its hold.
OUTPUT_TOKENS_MEAN = 1_000_000
# Every call names the default tier, so it is held at it (not at the dearest), near its bill.
# As the hostile gateways: not how a gateway call may be resolved, whatever this says.
HOSTILE_ENV = {"CEILING_EXPIRE_POLICY": "release"}
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
    """No overrides: gpt-4o at the bundled price, the stub at its own table's."""
    path = Path(tmp_path_factory.mktemp("hostile_runs")) / "prices.json"
    path.write_text(json.dumps({"models": {}}))
    return str(path)


@pytest.fixture(scope="module")
def stub() -> Iterator[StubProvider]:
    with StubProvider(seed=17, latency_ms_min=0, latency_ms_max=2,
                      output_tokens_mean=OUTPUT_TOKENS_MEAN) as provider:
        yield provider


@pytest.fixture(scope="module")
def gw(redis_server: RedisServer, prices_file: str, stub: StubProvider
       ) -> Iterator[ServiceProcess]:
    with gateway(redis_server, prices_file, f"{stub.url}/v1", 30, HOSTILE_ENV) as service:
        yield service


@pytest.fixture(autouse=True)
def fresh_provider(stub: StubProvider) -> Iterator[None]:
    control(stub, default_service_tier="default")
    reset_bill(stub.url)
    yield
    control(stub)


# -- the ledger's records, read from Redis ---------------------------------------------------


def stored(redis_url: str, tag: str) -> dict[str, tuple[Any, bool]]:
    """Every budget definition and counter of `tag` as Redis holds it: its value, and whether it
    has an expiry (a lifetime total must have none)."""
    raw = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        out: dict[str, tuple[Any, bool]] = {}
        for part in (keys.DEFINITION, keys.COUNTER):
            for name in raw.scan_iter(match=f"{keys.prefix(tag)}{part}*", count=1_000):
                value = raw.hgetall(name) if raw.type(name) == "hash" else raw.get(name)
                out[name] = (value, raw.pttl(name) >= 0)
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
