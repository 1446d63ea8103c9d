"""The real JavaScript clients through the gateway, unchanged, judged by the provider's bill.

The Vercel AI SDK (OpenAI Responses, OpenAI chat, Anthropic: generateText, streamText,
generateObject, multi-step tools with a reasoning model; Google's provider on the Gemini API,
routed by CEILING_UPSTREAMS: generateText, streamText, multi-step tools), Claude Code (`claude
-p` with a tool turn) and Codex (`codex exec` with a tool turn), installed from their registry
at the versions of tests/clients/js/package-lock.json (infra/clients.py), each pointed at a
gateway with the base URL and a spend-ceiling key and nothing else that changes what it sends
(docs/clients.md).

Each case passes when the client finished without error and the ledger's committed spend equals
the stub provider's bill to the micro-dollar; shown a budget too small for one call, each
client must print the gateway's 402 and its message naming the budget, so its user sees why.

The CLIs run with a fresh home, their telemetry, update checks and plugin syncs off
(infra/clients.py): they reach the gateway on loopback and nothing else.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from infra.clients import ai_sdk_env, claude_env, codex_env, ensure_js_clients, stage_scripts
from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from infra.stub_provider import StubProvider, fetch_bill, reset_bill, stub_control
from tests.api.conftest import ADMIN_TOKEN, Client, client_for, gateway_to_stub, settled
from tests.support import write_prices

# The AI SDK's OpenAI cases use a reasoning model, as the multi-step case must (step 2 sends
# step 1's reasoning back); gpt-5-mini is in both price tables.
OPENAI_MODEL = "gpt-5-mini"
ANTHROPIC_MODEL = "claude-sonnet-4-5"
# Claude Code is run as it comes (its default model, claude-opus-5-5: adaptive thinking,
# `output_config` effort, deferred tools) and on claude-sonnet-4-5 (budgeted thinking), whose
# bodies differ; the refusal is shown on the one both price tables have long held.
CLAUDE_DEFAULT_MODEL = None
CLAUDE_MODELS = {"default-model": CLAUDE_DEFAULT_MODEL, ANTHROPIC_MODEL: ANTHROPIC_MODEL}
# Codex's default model (gpt-6.2-sol in 0.171) is in no price table; `-m` picks one that is.
CODEX_MODEL = "gpt-5-mini"
AI_SDK_CASES = ("generateText", "streamText", "generateObject", "tools")
AI_SDK_FLAVOURS = {
    "openai-responses": OPENAI_MODEL,
    "openai-chat": OPENAI_MODEL,
    "anthropic": ANTHROPIC_MODEL,
}
# Google's provider: a thinking model (2.5 Flash thinks by default, so the tool turn sends its
# thought signature back), in both price tables, reached through a `gemini` upstream.
GOOGLE_MODEL = "gemini-2.5-flash"
GOOGLE_CASES = ("generateText", "streamText", "tools")
# Far above what a case holds: Claude Code on its default model holds about $3 for its first
# call and over $4.90 for its second, whose thinking sent back is held at the model's context
# window; the AI SDK asks Anthropic for 64,000 output tokens a call (~$0.96 on sonnet-4-5).
ROOMY_MICROS = 20_000_000
# Below any call's hold: refused before anything is forwarded.
TOO_SMALL_MICROS = 100
# One client run: a Node start-up and a few loopback calls, or a CLI's (Codex first tries a
# WebSocket six times, about 7 s, before it falls back to HTTPS).
CLIENT_RUN_TIMEOUT_S = 120
PROMPT = "Run the shell command `echo hi` and tell me what it printed."
# The tool call the stub answers a CLI's first call with: each CLI's own shell tool.
CLAUDE_TOOL_CALL = {"name": "Bash", "input": {"command": "echo hi"}}
CODEX_TOOL_CALL = {"name": "exec_command", "arguments": {"cmd": "echo hi"}}
# Every internet-family address a traced process connects or sends to (DNS over UDP included).
INET_DESTINATION = re.compile(
    r'sa_family=AF_INET6?, sin6?_port=htons\((\d+)\), '
    r'(?:sin_addr=inet_addr\("([^"]+)"\)|sin6_flowinfo=[^,]*, inet_pton\(AF_INET6, "([^"]+)")')


@dataclass(frozen=True)
class Run:
    """What a client printed and how it exited."""

    returncode: int
    output: str

    def cases(self) -> dict[str, dict[str, Any]]:
        """ai_sdk.mjs's `CASE <name> ok|error <json>` lines, by case."""
        found = {}
        for line in self.output.splitlines():
            if line.startswith("CASE "):
                _, name, outcome, doc = line.split(" ", 3)
                found[name] = {"outcome": outcome, **json.loads(doc)}
        return found


@pytest.fixture(scope="session")
def node_modules() -> Path:
    """The pinned clients, installed once per lockfile into the cache outside the clone."""
    return ensure_js_clients()


@pytest.fixture(scope="module")
def scripts(node_modules: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return stage_scripts(node_modules, tmp_path_factory.mktemp("js-scripts"))


@pytest.fixture(scope="module")
def gw(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory,
       stub: StubProvider) -> Iterator[ServiceProcess]:
    prices_file = write_prices(tmp_path_factory, "js_clients", {"models": {}})
    with gateway_to_stub(redis_server, prices_file, stub, 60) as service:
        yield service


@pytest.fixture(scope="module")
def gw_google(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory,
              stub: StubProvider) -> Iterator[ServiceProcess]:
    """A gateway whose one named upstream is the stub's Gemini API, as a team reaching Google
    through the gateway configures it (CEILING_UPSTREAMS)."""
    path = tmp_path_factory.mktemp("js_google") / "upstreams.json"
    path.write_text(json.dumps({"upstreams": [{
        "name": "google", "api": "gemini", "base_url": stub.url, "api_key_env": "GEMINI_KEY",
        "models": [GOOGLE_MODEL]}]}))
    with ServiceProcess({"REDIS_URL": redis_server.url, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN,
                         "CEILING_UPSTREAM_TIMEOUT_S": "60", "CEILING_UPSTREAMS": str(path),
                         "GEMINI_KEY": "stub-key-unchecked"}) as service:
        yield service


@pytest.fixture(scope="module")
def admin_google(gw_google: ServiceProcess) -> Iterator[Client]:
    with client_for(gw_google) as client:
        yield client


@pytest.fixture(autouse=True)
def fresh_provider(stub: StubProvider) -> None:
    """Each test is judged by its own bill, with nothing scripted left over."""
    reset_bill(stub.url)
    stub_control(stub.url, {})


def account(admin: Client, ceiling_micros: int) -> tuple[str, str]:
    """A budget of its own and a gateway key for it."""
    tag = f"org:js{uuid.uuid4().hex[:10]}"
    admin.budget(tag, ceiling_micros)
    return tag, admin.key(tag)["Authorization"].removeprefix("Bearer ")


def run(argv: list[str], env: dict[str, str], cwd: Path, trace: Path | None = None) -> Run:
    """Run a client; with `trace`, under strace, which writes there every connect and send of
    the client and its children."""
    cwd.mkdir(parents=True, exist_ok=True)
    if trace is not None:
        strace = shutil.which("strace")
        assert strace is not None, "strace shows what the CLIs reach: apt-get install strace"
        argv = [strace, "-f", "-qq", "-e", "trace=connect,sendto,sendmsg,sendmmsg",
                "-o", str(trace), *argv]
    done = subprocess.run(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=CLIENT_RUN_TIMEOUT_S, check=False)
    return Run(done.returncode, done.stdout)


def ai_sdk(scripts: Path, tmp_path: Path, gw: ServiceProcess, key: str, flavour: str,
           cases: tuple[str, ...], trace: Path | None = None) -> Run:
    model = GOOGLE_MODEL if flavour == "google" else AI_SDK_FLAVOURS[flavour]
    return run(["node", str(scripts / "ai_sdk.mjs"), flavour, model, *cases],
               ai_sdk_env(tmp_path / "home", gw.url, key), tmp_path / "work", trace)


def claude(node_modules: Path, tmp_path: Path, gw: ServiceProcess, key: str,
           model: str | None, trace: Path | None = None) -> Run:
    # `--allowedTools Bash` lets it run the shell without asking, as a user of `claude -p`
    # allows for a task: a permission, not a setting of the connection.
    chosen = [] if model is None else ["--model", model]
    return run([str(node_modules / ".bin" / "claude"), "-p", PROMPT, *chosen,
                "--allowedTools", "Bash"],
               claude_env(tmp_path / "home", gw.url, key), tmp_path / "work", trace)


def codex(node_modules: Path, tmp_path: Path, gw: ServiceProcess, key: str,
          trace: Path | None = None) -> Run:
    # danger-full-access: the container is the sandbox (Codex's own needs Landlock or
    # bubblewrap, which a root container may lack); the work directory is no git repository.
    return run([str(node_modules / ".bin" / "codex"), "exec", "--skip-git-repo-check",
                "--sandbox", "danger-full-access", "-m", CODEX_MODEL, PROMPT],
               codex_env(tmp_path / "home", gw.url, key), tmp_path / "work", trace)


def assert_ledger_is_bill(admin: Client, stub: StubProvider, tag: str) -> None:
    bill = fetch_bill(stub.url, with_log=False)
    period = settled(admin, tag)
    assert bill.total.calls > 0
    assert (period["committed_micros"], period["reserved_micros"]) == (
        bill.total.cost_micros, 0)


def assert_tool_turn_booked(result: Run, admin: Client, stub: StubProvider, tag: str) -> None:
    """The CLI finished its tool turn, at least two calls (the one answered with the tool call,
    then the one sending its output back), and the ledger books what the stub billed."""
    assert result.returncode == 0, result.output
    assert fetch_bill(stub.url, with_log=False).total.calls >= 2, result.output
    assert_ledger_is_bill(admin, stub, tag)


def assert_only_the_gateway_reached(trace: Path, gw: ServiceProcess) -> None:
    """The client and its children sent to no internet address but the gateway's: no
    telemetry, update check or DNS query left the machine."""
    reached = set()
    for line in trace.read_text().splitlines():
        if "AF_INET" in line:
            found = INET_DESTINATION.search(line)
            assert found is not None, f"an address this test cannot read: {line}"
            port, v4, v6 = found.groups()
            reached.add((port, v4 or v6))
    assert reached == {(str(gw.port), "127.0.0.1")}


def assert_budget_refusal_shown(result: Run, stub: StubProvider, tag: str) -> None:
    """The client failed and told its user why: the status and the gateway's message, which
    names the budget. (The CLIs print the status and `error.message`, not `error.code`.)"""
    assert result.returncode != 0, result.output
    assert "402" in result.output, result.output
    assert f"budget {tag} " in result.output, result.output
    assert fetch_bill(stub.url, with_log=False).total.calls == 0


@pytest.mark.parametrize("flavour", AI_SDK_FLAVOURS)
def test_ai_sdk_cases_bill_what_the_ledger_books(
        flavour: str, scripts: Path, tmp_path: Path, gw: ServiceProcess, admin: Client,
        stub: StubProvider) -> None:
    """Every case of one provider in one Node process; each must finish, and the ledger must
    book what the provider billed for them all."""
    tag, key = account(admin, ROOMY_MICROS)
    result = ai_sdk(scripts, tmp_path, gw, key, flavour, AI_SDK_CASES)
    cases = result.cases()
    outcomes = {name: case["outcome"] for name, case in cases.items()}
    assert outcomes == dict.fromkeys(AI_SDK_CASES, "ok"), result.output
    # The tool's result went back to the model: a second step, with step 1's reasoning.
    assert cases["tools"]["steps"] >= 2, result.output
    assert_ledger_is_bill(admin, stub, tag)


@pytest.mark.parametrize("flavour", AI_SDK_FLAVOURS)
def test_ai_sdk_shows_the_budget_refusal(
        flavour: str, scripts: Path, tmp_path: Path, gw: ServiceProcess, admin: Client,
        stub: StubProvider) -> None:
    tag, key = account(admin, TOO_SMALL_MICROS)
    result = ai_sdk(scripts, tmp_path, gw, key, flavour, ("generateText",))
    [case] = result.cases().values()
    assert (case["outcome"], case["status"]) == ("error", 402), result.output
    assert_budget_refusal_shown(result, stub, tag)
    assert "budget_exceeded" in case["body"]


def test_ai_sdk_google_cases_bill_what_the_ledger_books(
        scripts: Path, tmp_path: Path, gw_google: ServiceProcess, admin_google: Client,
        stub: StubProvider) -> None:
    """Google's provider with a base URL and a key: each case finishes, the ledger books what
    the stub billed for them all, and Node reached the gateway and nothing else."""
    tag, key = account(admin_google, ROOMY_MICROS)
    trace = tmp_path / "strace"
    result = ai_sdk(scripts, tmp_path, gw_google, key, "google", GOOGLE_CASES, trace)
    cases = result.cases()
    outcomes = {name: case["outcome"] for name, case in cases.items()}
    assert outcomes == dict.fromkeys(GOOGLE_CASES, "ok"), result.output
    # The function's result went back to the model: a second step.
    assert cases["tools"]["steps"] >= 2, result.output
    assert_ledger_is_bill(admin_google, stub, tag)
    assert_only_the_gateway_reached(trace, gw_google)


def test_ai_sdk_google_shows_the_budget_refusal(
        scripts: Path, tmp_path: Path, gw_google: ServiceProcess, admin_google: Client,
        stub: StubProvider) -> None:
    """Google's shape: 400 FAILED_PRECONDITION, the gateway's code as the ErrorInfo's reason
    and its message naming the budget, which the SDK raises unretried; nothing forwarded."""
    tag, key = account(admin_google, TOO_SMALL_MICROS)
    result = ai_sdk(scripts, tmp_path, gw_google, key, "google", ("generateText",))
    [case] = result.cases().values()
    assert (case["outcome"], case["status"]) == ("error", 400), result.output
    error = json.loads(case["body"])["error"]
    assert (error["status"], error["details"][0]["reason"]) == (
        "FAILED_PRECONDITION", "budget_exceeded"), result.output
    assert f"budget {tag} " in error["message"], result.output
    assert fetch_bill(stub.url, with_log=False).total.calls == 0
    assert settled(admin_google, tag)["committed_micros"] == 0


@pytest.mark.parametrize("model", CLAUDE_MODELS.values(), ids=CLAUDE_MODELS.keys())
def test_claude_code_tool_turn_bills_what_the_ledger_books(
        model: str | None, node_modules: Path, tmp_path: Path, gw: ServiceProcess,
        admin: Client, stub: StubProvider) -> None:
    """`claude -p` with a tool turn: the stub answers the first call with a Bash call, Claude
    Code runs it and sends the result back; the ledger books both calls as billed."""
    stub_control(stub.url, {"tool_calls": [CLAUDE_TOOL_CALL]})
    tag, key = account(admin, ROOMY_MICROS)
    result = claude(node_modules, tmp_path, gw, key, model)
    assert_tool_turn_booked(result, admin, stub, tag)


def test_claude_code_shows_the_budget_refusal(
        node_modules: Path, tmp_path: Path, gw: ServiceProcess, admin: Client,
        stub: StubProvider) -> None:
    """Run under strace: Claude Code reaches the gateway and nothing else."""
    tag, key = account(admin, TOO_SMALL_MICROS)
    trace = tmp_path / "strace"
    result = claude(node_modules, tmp_path, gw, key, ANTHROPIC_MODEL, trace)
    assert_only_the_gateway_reached(trace, gw)
    assert_budget_refusal_shown(result, stub, tag)


def test_codex_tool_turn_bills_what_the_ledger_books(
        node_modules: Path, tmp_path: Path, gw: ServiceProcess, admin: Client,
        stub: StubProvider) -> None:
    """`codex exec` with a tool turn: the stub answers the first call with an exec_command
    call, Codex runs `echo hi` and sends the output back with its reasoning item."""
    stub_control(stub.url, {"tool_calls": [CODEX_TOOL_CALL]})
    tag, key = account(admin, ROOMY_MICROS)
    result = codex(node_modules, tmp_path, gw, key)
    assert_tool_turn_booked(result, admin, stub, tag)


def test_codex_shows_the_budget_refusal(
        node_modules: Path, tmp_path: Path, gw: ServiceProcess, admin: Client,
        stub: StubProvider) -> None:
    """Run under strace: Codex reaches the gateway and nothing else (its plugin sync, off in
    its config, would reach github.com)."""
    tag, key = account(admin, TOO_SMALL_MICROS)
    trace = tmp_path / "strace"
    result = codex(node_modules, tmp_path, gw, key, trace)
    assert_only_the_gateway_reached(trace, gw)
    assert_budget_refusal_shown(result, stub, tag)
