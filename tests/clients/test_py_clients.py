"""The real Python clients through the gateway, unchanged, judged by the provider's bill.

The OpenAI Agents SDK, langchain-openai (the Responses API), langchain-anthropic and
pydantic-ai (Responses and Messages), at the versions tests/clients/py/requirements.lock pins,
installed by infra/py_clients.py in a virtualenv of their own. Each is pointed at a gateway
with the base URL and a key and nothing else, as a team would point it, and runs what its docs
show: an agent or a tool loop on a reasoning model, the model calling the tool (the stub
provider scripts that call: `tool_calls` on its /control) and the client sending the result
back in a second call, with the first call's reasoning (or thinking) in it.

Each case is judged by the stub's bill: the calls it served, and the ledger's committed spend
for the case equal to what it billed, to the micro-dollar. Each client is also shown a budget
too small for its first call: it must surface the 402 `budget_exceeded` as the error it raises,
and send it once (the gateway's refusal counter), the provider never called.

One process a client for its cases (ClientRun), one more for its refusal: each of these
libraries takes seconds to import.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from infra.py_clients import LOCK_FILE, SCRIPTS_DIR, ClientRun, client_env, ensure_py_clients
from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from infra.stub_provider import StubProvider, fetch_bill, reset_bill, stub_control
from tests.api.conftest import ADMIN_TOKEN, Client, account, gateway_to_stub, settled
from tests.support import write_prices

# Room for every case of a client: langchain-anthropic and pydantic-ai ask for claude-sonnet-4-5's
# whole output (max_tokens 64000, a hold of $0.96 a call); the cases spend cents.
ROOMY_MICROS = 50_000_000
# Below any call's hold: the first call is refused before the provider sees it.
TOO_SMALL_MICROS = 100
# Room for step 1 of a Responses tool turn on gpt-5-mini and not for step 2: step 1 is held for
# its body and the 4,096 output tokens the gateway adds (about $0.015), step 2, which sends step
# 1's reasoning back, for what that reasoning may be, up to the model's context window (400,000
# tokens: $0.10 of input alone).
STEP_1_ONLY_MICROS = 60_000
# The argument every scripted tool call passes (tests/clients/py/_report.py's `weather`).
TOOL_CALL = {"city": "Paris"}
TOOL_NAME = "weather"
# It installs the clients on a clean machine (half a minute) and starts a process a client:
# scheduled with the long modules (tests/conftest.py).
pytestmark = pytest.mark.slow

REFUSAL_METRIC = re.compile(r'^spend_ceiling_refusals_total\{code="budget_exceeded"\} (\S+)$',
                            re.MULTILINE)


@dataclass(frozen=True)
class Case:
    client: str  # its script in tests/clients/py/, without .py
    name: str  # the case, as the script names it
    api: str  # "responses", "chat" or "messages": the route, and how to script a tool call
    calls: int  # the calls the stub serves: 2 for a tool turn (the call, then the answer)
    # Whether the last call refers to input it does not hold, which the stub bills as
    # `referenced_input_tokens`: step 1's reasoning sent back (by id, or with its encrypted
    # content), or step 1's response named by previous_response_id.
    refers: bool = False

    @property
    def id(self) -> str:
        return f"{self.client}-{self.name}"


CASES = (
    Case("agents_sdk", "tools", "responses", 2, refers=True),
    Case("agents_sdk", "tools_stream", "responses", 2, refers=True),
    Case("agents_sdk", "tools_unstored", "responses", 2, refers=True),
    Case("agents_sdk", "plain", "responses", 1),
    Case("langchain_openai_client", "tools", "responses", 2, refers=True),
    Case("langchain_openai_client", "tools_stream", "responses", 2, refers=True),
    Case("langchain_openai_client", "tools_reasoning", "responses", 2, refers=True),
    Case("langchain_openai_client", "tools_unstored", "responses", 2, refers=True),
    Case("langchain_openai_client", "tools_previous_response", "responses", 2, refers=True),
    Case("langchain_openai_client", "chat_tools", "chat", 2),
    Case("langchain_anthropic_client", "tools", "messages", 2),
    Case("langchain_anthropic_client", "tools_stream", "messages", 2),
    Case("langchain_anthropic_client", "tools_thinking", "messages", 2),
    Case("pydantic_ai_client", "responses_tools", "responses", 2, refers=True),
    Case("pydantic_ai_client", "responses_tools_stream", "responses", 2, refers=True),
    Case("pydantic_ai_client", "anthropic_tools", "messages", 2),
)
# Each client's first case, shown a budget too small for it.
REFUSED = tuple({c.client: c for c in reversed(CASES)}.values())
# Each client's first Responses tool turn, shown a budget with room for its first step only.
REFUSED_MID_TURN = tuple({c.client: c for c in reversed(CASES)
                          if c.api == "responses" and c.refers}.values())


@pytest.fixture(scope="session")
def clients_python() -> Path:
    """The clients' interpreter, their virtualenv installed first if this lock has none."""
    return ensure_py_clients()


@pytest.fixture(scope="module")
def prices_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    # No rows of the test's own: the gateway prices these models from genai-prices, as it would
    # for a team, and the stub from its own table.
    return write_prices(tmp_path_factory, "py_clients", {"models": {}})


@pytest.fixture(scope="module")
def gw(redis_server: RedisServer, prices_file: str, stub: StubProvider
       ) -> Iterator[ServiceProcess]:
    with gateway_to_stub(redis_server, prices_file, stub, 30) as service:
        yield service


def start(stack: ExitStack, python: Path, gw: ServiceProcess, client: str,
          key: str) -> ClientRun:
    env = client_env(openai_base_url=f"{gw.url}/v1", anthropic_base_url=gw.url, api_key=key)
    return stack.enter_context(ClientRun(python, f"{client}.py", env))


@pytest.fixture(scope="module")
def runs(clients_python: Path, gw: ServiceProcess, admin: Client
         ) -> Iterator[dict[str, tuple[str, ClientRun]]]:
    """Each client's process with a roomy budget of its own, started at its first case: its
    budget's tag and the process."""
    with ExitStack() as stack:

        class Runs(dict[str, tuple[str, ClientRun]]):
            def __missing__(self, client: str) -> tuple[str, ClientRun]:
                tag, key = account(admin, ROOMY_MICROS)
                self[client] = (tag, start(stack, clients_python, gw, client, key))
                return self[client]

        yield Runs()


def script_tool_call(stub: StubProvider, api: str) -> None:
    """The next call offering the tool calls it; the one after answers."""
    arguments = "input" if api == "messages" else "arguments"
    try:
        stub_control(stub.url, {"tool_calls": [{"name": TOOL_NAME, arguments: TOOL_CALL}]})
    except httpx.HTTPStatusError as exc:
        pytest.fail(f"the stub provider cannot script a tool call: {exc.response.text}")


def failure(result: dict[str, Any]) -> str:
    return (f"{result.get('error_type')} (HTTP {result.get('error_status')}, "
            f"{result.get('error_code')}): "
            f"{result.get('error')}\n{result.get('traceback', '')}")


def refusals(admin: Client) -> float:
    r = admin.get("/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert r.status_code == 200, r.text
    found = REFUSAL_METRIC.search(r.text)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_each_client_runs_unchanged_and_the_ledger_equals_the_bill(
        case: Case, runs: dict[str, tuple[str, ClientRun]], stub: StubProvider,
        admin: Client) -> None:
    tag, run = runs[case.client]
    reset_bill(stub.url)
    if case.calls > 1:
        script_tool_call(stub, case.api)
    committed_before = settled(admin, tag)["committed_micros"]
    result = run.case(case.name)
    bill = fetch_bill(stub.url)
    period = settled(admin, tag)
    assert result["ok"], failure(result)
    assert (bill.requests, bill.total.calls) == (case.calls, case.calls), list(bill.log)
    if case.refers:
        # The case does what it is here for: the step 2 call the ledger was held for carried
        # the reference, and the provider billed what it names.
        assert bill.log[-1].usage.referenced_input_tokens > 0, list(bill.log)
    assert (period["committed_micros"] - committed_before, period["reserved_micros"]) == (
        bill.total.cost_micros, 0)


@pytest.mark.parametrize("case", REFUSED, ids=[c.client for c in REFUSED])
def test_each_client_surfaces_the_402_once_and_the_provider_is_never_called(
        case: Case, clients_python: Path, gw: ServiceProcess, stub: StubProvider,
        admin: Client) -> None:
    tag, key = account(admin, TOO_SMALL_MICROS)
    reset_bill(stub.url)
    refused_before = refusals(admin)
    with ExitStack() as stack:
        result = start(stack, clients_python, gw, case.client, key).case(case.name)
    assert not result["ok"], result
    # The client raises the gateway's refusal as it came: its status, its code, and the message
    # that names the budget.
    assert (result["error_status"], result["error_code"]) == (402, "budget_exceeded"), (
        failure(result))
    assert f"budget {tag} (total) has no room left" in result["error"], failure(result)
    # Sent once: a client that retried a 402 would be refused again, and counted again.
    assert refusals(admin) - refused_before == 1
    assert fetch_bill(stub.url).requests == 0
    assert settled(admin, tag)["committed_micros"] == 0


@pytest.mark.parametrize("case", REFUSED_MID_TURN, ids=[c.client for c in REFUSED_MID_TURN])
def test_a_402_in_the_middle_of_a_tool_turn_is_surfaced_and_step_1_is_charged_as_billed(
        case: Case, clients_python: Path, gw: ServiceProcess, stub: StubProvider,
        admin: Client) -> None:
    """The tool ran and step 2 is refused: the client raises the 402 (no retry), and the
    ledger holds what step 1 cost, as the provider billed it."""
    tag, key = account(admin, STEP_1_ONLY_MICROS)
    reset_bill(stub.url)
    script_tool_call(stub, case.api)
    refused_before = refusals(admin)
    with ExitStack() as stack:
        result = start(stack, clients_python, gw, case.client, key).case(case.name)
    bill = fetch_bill(stub.url)
    assert not result["ok"], result
    assert (result["error_status"], result["error_code"]) == (402, "budget_exceeded"), (
        failure(result))
    assert refusals(admin) - refused_before == 1
    assert (bill.requests, bill.total.calls) == (1, 1), list(bill.log)
    assert (settled(admin, tag)["committed_micros"], bill.total.cost_micros > 0) == (
        bill.total.cost_micros, True)


def test_the_lock_pins_each_client_and_no_telemetry_exporter() -> None:
    """The lock is what requirements.in asks for, and it installs no exporter: pydantic-ai's
    `logfire` is absent (only logfire-api, its no-op shim, comes with pydantic-ai-slim); the
    Agents SDK's tracing and LangSmith are off by environment (tests/clients/py/_report.py)."""
    asked = SCRIPTS_DIR / "requirements.in"
    lock = LOCK_FILE.read_text()
    pinned = dict(re.findall(r"^([a-z0-9-]+)==(\S+)", lock, re.MULTILINE))
    for line in asked.read_text().split("\n"):
        if line.strip():
            name, version = re.sub(r"\[.*\]", "", line.strip()).split("==")
            assert pinned.get(name) == version, (name, version)
    assert "logfire" not in pinned
    # Every pin carries its hashes (pip and uv then install with --require-hashes).
    hashed = re.findall(r"^[a-z0-9-]+==[^\n]* \\\n +--hash=sha256:", lock, re.MULTILINE)
    assert len(hashed) == len(pinned)
