"""A ledger outage does not open a budget's model rules: the outage allowance admits only a
model the path's allow-lists (as last read from the ledger) name, and no call of a model with
per_model limits on the path, which only the ledger can hold. Judged by the stub's request
count: a refused call reaches no provider.

Its own Redis (stopped for the outage), one gateway instance and the stub provider.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from infra.stub_provider import StubProvider, fetch_bill
from tests.api.conftest import ADMIN_TOKEN
from tests.api.test_hostile_models import call_of, new_tag, per_model, put_budget, send
from tests.api.test_hostile_users import new_key

pytestmark = pytest.mark.slow

STUB_KEY = "models-outage-stub-key"
ALLOWANCE_MICROS = 50_000_000


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    with RedisServer(durable=True) as server:
        yield server


@pytest.fixture
def stub() -> Iterator[StubProvider]:
    with StubProvider(seed=47, latency_ms_min=0, latency_ms_max=2, api_key=STUB_KEY) as provider:
        yield provider


def test_an_outage_admits_no_model_the_ledger_would_refuse_or_limit(
        own_redis: RedisServer, stub: StubProvider, tmp_path: Path) -> None:
    upstreams = tmp_path / "upstreams.json"
    upstreams.write_text(json.dumps({"upstreams": [
        {"name": "openai", "api": "openai", "base_url": f"{stub.url}/v1",
         "api_key_env": "STUB_KEY",
         "models": ["gpt-4o", "gpt-4o-2024-08-06", "gpt-4o-mini", "gpt-4.1"]}]}))
    env = {"REDIS_URL": own_redis.url, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN,
           "CEILING_UPSTREAMS": str(upstreams), "STUB_KEY": STUB_KEY}
    with ServiceProcess(env) as gw:
        tag = new_tag()
        put_budget(gw, tag, outage_allowance_micros=ALLOWANCE_MICROS,
                   models={"allow": ["gpt-4o", "gpt-4o-mini"]},
                   per_model=per_model("gpt-4o", 10_000_000))
        key = new_key(gw, tag)
        # While the ledger answers: the instance learns the path's allowance and its rules.
        assert send(gw, call_of("chat", key, "gpt-4o-mini")).status_code == 200
        assert send(gw, call_of("chat", key, "gpt-4.1")).status_code == 403
        own_redis.stop()
        requests = fetch_bill(stub.url).requests
        # The allow-list's model without per_model limits: the allowance admits it.
        answer = send(gw, call_of("chat", key, "gpt-4o-mini"))
        assert answer.status_code == 200, answer.text
        assert fetch_bill(stub.url).requests == requests + 1
        # A model the allow-list does not name, and one only the ledger can hold: refused,
        # not forwarded.
        for model in ("gpt-4.1", "gpt-4.1", "gpt-4o", "gpt-4o-2024-08-06"):
            answer = send(gw, call_of("chat", key, model))
            assert answer.status_code in (403, 503), (model, answer.text)
        assert fetch_bill(stub.url).requests == requests + 1, "a refused call was forwarded"
