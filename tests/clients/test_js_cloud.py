"""Claude Code bought through a cloud: the real `claude -p` pointed at the gateway as at
Anthropic, the gateway's CEILING_UPSTREAMS sending its models to Claude on Amazon Bedrock or on
Google Vertex AI (both the stub provider's), judged by the stub's bill.

Claude Code sends what it sends Anthropic: `anthropic-beta` flags, `context_management`,
`metadata.user_id`, thinking (adaptive on its default model, budgeted on claude-sonnet-4-5) and
its tools. Each cloud takes these its own way (Bedrock: `anthropic_version` and the betas in the
body, no `model` or `stream` there; Vertex: the model in the path, the betas as the header) and
refuses what it does not know: the stubs refuse as the clouds do (infra/stub_bedrock.py,
infra/stub_vertex.py), so a body the gateway translated wrong fails the run.

Each case passes when Claude Code finished its tool turn and the ledger's committed spend is the
stub's bill to the micro-dollar; shown a budget too small for one call, it prints the gateway's
402 naming the budget, and the stub saw nothing. Every run is under strace: Claude Code reaches
the gateway on loopback and nothing else (infra/clients.py keeps it off the network).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from infra.stub_provider import StubProvider, fetch_bill, reset_bill, stub_control
from tests.api.clouds import bedrock, cloud_gateway, trust_the_key_pair, vertex
from tests.api.conftest import Client
from tests.clients.test_js_clients import (
    ANTHROPIC_MODEL,
    CLAUDE_MODELS,
    CLAUDE_TOOL_CALL,
    ROOMY_MICROS,
    TOO_SMALL_MICROS,
    account,
    assert_budget_refusal_shown,
    assert_only_the_gateway_reached,
    assert_tool_turn_booked,
    claude,
    node_modules,  # noqa: F401 (the session's fixture, found here by name)
)
from tests.support import write_prices

# Claude Code's two models as each cloud names them. Bedrock: its default model by its global
# profile (the global rates), claude-sonnet-4-5 by its US profile (billed at the regional ones).
# Vertex: the names Claude Code sends, at the global endpoint (one price for every model).
CLAUDE_DEFAULT = "claude-opus-5-5"
BEDROCK_MODEL_IDS = {CLAUDE_DEFAULT: "global.anthropic.claude-opus-5-5",
                     ANTHROPIC_MODEL: "us.anthropic.claude-sonnet-4-5-20250929-v1:0"}
VERTEX_MODELS = [CLAUDE_DEFAULT, ANTHROPIC_MODEL]
# Each cloud's API on the stub's bill, by the upstream kind that calls it.
CLOUD_API = {"bedrock": "bedrock.invoke", "vertex": "vertex.messages"}
CLOUDS = tuple(CLOUD_API)


@pytest.fixture(scope="module", params=CLOUDS)
def cloud(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def gw(cloud: str, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory,
       stub: StubProvider) -> Iterator[ServiceProcess]:
    """A gateway whose one upstream, `cloud`, serves Claude Code's models."""
    directory = tmp_path_factory.mktemp(f"js_{cloud}")
    prices_file = write_prices(tmp_path_factory, f"js_{cloud}_prices", {"models": {}})
    upstream = (bedrock(stub, "bedrock", BEDROCK_MODEL_IDS) if cloud == "bedrock"
                else vertex(stub, directory, "vertex", "global", VERTEX_MODELS))
    with cloud_gateway(redis_server, prices_file, directory, [upstream],
                       {"CEILING_UPSTREAM_TIMEOUT_S": "60"}) as service:
        yield service


@pytest.fixture(autouse=True)
def fresh_provider(stub: StubProvider) -> None:
    """Each test is judged by its own bill, with nothing scripted left over."""
    reset_bill(stub.url)
    trust_the_key_pair(stub)


@pytest.mark.parametrize("model", CLAUDE_MODELS.values(), ids=CLAUDE_MODELS.keys())
def test_claude_code_through_a_cloud_bills_what_the_ledger_books(
        model: str | None, cloud: str, node_modules: Path, tmp_path: Path,  # noqa: F811
        gw: ServiceProcess, admin: Client, stub: StubProvider) -> None:
    """`claude -p` with a tool turn, every call to the cloud: the stub answers the first with a
    Bash call, Claude Code runs it and sends the result back; the ledger books every call as
    the cloud billed it."""
    stub_control(stub.url, {"tool_calls": [CLAUDE_TOOL_CALL]})
    tag, key = account(admin, ROOMY_MICROS)
    trace = tmp_path / "strace"
    result = claude(node_modules, tmp_path, gw, key, model, trace)
    assert_only_the_gateway_reached(trace, gw)
    assert_tool_turn_booked(result, admin, stub, tag)
    # Every call reached the cloud in a shape it takes: none refused there (Claude Code retries
    # a call refused for its betas without them, which would hide a translation gone wrong).
    log = fetch_bill(stub.url).log
    assert [(c.api, c.status) for c in log] == [(CLOUD_API[cloud], 200)] * len(
        log)


def test_claude_code_through_a_cloud_shows_the_budget_refusal(
        node_modules: Path, tmp_path: Path, gw: ServiceProcess,  # noqa: F811
        admin: Client, stub: StubProvider) -> None:
    tag, key = account(admin, TOO_SMALL_MICROS)
    trace = tmp_path / "strace"
    result = claude(node_modules, tmp_path, gw, key, ANTHROPIC_MODEL, trace)
    assert_only_the_gateway_reached(trace, gw)
    assert_budget_refusal_shown(result, stub, tag)
    assert fetch_bill(stub.url).requests == 0
