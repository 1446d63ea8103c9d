"""The gateway's cost per call, side by side with hardcap 0.1.0, the fastest Python gateway we know.

    .venv/bin/python -m bench.gateway            # ~2 min; --help for rounds and durations
    .venv/bin/python -m bench.gateway --quick    # a smoke run of ~25 s; its figures are not judged
                                                 # needs wrk: apt-get install wrk

Every process its own, all on loopback, started here and stopped by pid:

  stub       bench/stub_upstream.py (aiohttp): an OpenAI-compatible chat endpoint that answers
             every call at once with 20 prompt and 20 completion tokens and counts the calls by
             model. The same process is behind every gateway.
  ours       `ceiling serve` (one uvicorn worker) with its own redis-server (no persistence), a
             budget, a gateway-role API key and a priced model (CEILING_PRICES_FILE): per call,
             authenticate, price, reserve, forward, settle from the usage.
  hardcap    PyPI's hardcap 0.1.0 (aiohttp, one worker), from the benchmark's side venv
             (bench/side_venv.py), with its own redis-server (no persistence): one tenant whose
             token budget the run cannot spend, admitted and settled by its two Lua scripts.
  relay      bench/relay_app.py, the bare relay: one more FastAPI server and httpx client in the
             path and nothing else. The floor under any gateway served as ours is.
  direct     the stub itself, no gateway: the floor under every figure.

wrk (C, one thread, its own process) sends the same request to each: CONNECTIONS keep-alive
connections, in rounds interleaved A,B,B,A,A,B between ours (A) and hardcap (B), so a trend in
the machine's load favours neither; then one round each of the two floors. For every round it
prints calls/s, p50 and p99 (wrk's --latency histogram), the CPU each process spent per call (the
gateway's from /proc/<pid>/stat, its Redis's from INFO cpu, the stub's for scale) and the
1-minute load average when the round started. The summary gives each load's medians and the
ratios ours/hardcap: calls/s as the median of the adjacent pairs' ratios, CPU per call from the
rounds' totals. Before the rounds, one connection per target for a few seconds: the latency a
gateway adds to a call that waits for nothing.

After the run, what each gateway left in its Redis: INFO memory used_memory after the run less
its reading after the warm-up, per call the stub answered for that gateway meanwhile, the key
count, and the keys grouped by pattern. Then the books: ours must have committed exactly what
the stub's calls cost at the prices file's rates and hold nothing; hardcap must have counted the
stub's tokens and hold nothing. A loop that collected errors cannot pass for a fast one: any
answer that is not a 200 stops the run.

The machine may be shared: absolute figures move with its load; the ratios of the same run, and
CPU per call, move far less.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import uuid
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
import redis

from bench import side_venv
from core.errors import ensure
from infra.figures import ms, table
from infra.processes import free_port, stop, wait_ready
from infra.redis_server import RedisServer

REPO_ROOT = Path(__file__).resolve().parent.parent
CONNECTIONS = 16
ROUND_S = 10
# A = ours, B = hardcap: each goes first in a pair as often as the other.
SCHEDULE = "ABBAAB"
WARMUP_S = 2
FLOOR_S = 10
SERIAL_S = 3
# --quick: a smoke run that every part of the benchmark goes through, in about 25 s.
QUICK = {"seconds": 2, "schedule": "AB", "warmup_seconds": 1, "floor_seconds": 1,
         "serial_seconds": 1}
# A request still unanswered after this is a timeout in wrk's count, which fails the run.
REQUEST_TIMEOUT_S = 10
# wrk stops itself after its duration; one still running this long after is stuck.
WRK_MARGIN_S = 30.0
# Servers import their framework and answer their health route within seconds; 60 is broken.
START_TIMEOUT_S = 60.0
# A gateway under an instrumenting wrapper (`rig(under=...)`: callgrind) runs many times slower.
UNDER_START_TIMEOUT_S = 600.0
# Goals printed against the run's figures (a benchmark reports; it does not fail): a gateway
# that does more per call than hardcap (users, rates, idempotency, streams read to the end) is
# still a tenth faster, and its tail no longer.
CALLS_RATIO_MIN = 1.1
P99_RATIO_MAX = 1.0
BYTES_PER_CALL_MAX = 200

ADMIN_TOKEN = secrets.token_hex(16)
# A model per gateway, so the stub's counts say which gateway each call came through (each
# instance of ours is given `bench-<its key>`). Priced by
# the run's own prices file at whole micro-dollars per token (= USD per million tokens), so a
# call of the stub's 20 + 20 tokens costs an exact number of micro-dollars.
MODELS = {"hardcap": "bench-hardcap", "relay": "bench-floor", "direct": "bench-floor"}
INPUT_MICROS_PER_TOKEN = 1
OUTPUT_MICROS_PER_TOKEN = 2
# Far above what any run can spend, in micro-dollars (ours) and tokens (hardcap).
CEILING_MICROS = 10**12
HARDCAP_TOKENS = 10**12
# hardcap's budget window: one that no run crosses.
HARDCAP_WINDOW_S = 30 * 86_400
MAX_TOKENS = 64
HARDCAP_TENANT = "bench"


def chat_body(model: str) -> str:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hello"}],
                       "max_tokens": MAX_TOKENS}, separators=(",", ":"))


# Anthropic's Messages takes the same body; its route is measured one connection at a time, beside
# the chat route, against the relay's and the stub's same route (issue 15's latency goal).
messages_body = chat_body
ANTHROPIC_VERSION = "2023-06-01"
# The gateway's added p50 (over the direct call) within this of the bare relay's, in the same
# run, for chat and for Messages: the relay is one more server and client and nothing else.
ADDED_P50_OVER_RELAY_MAX_S = 0.0005


# -- processes ----------------------------------------------------------------------------------


def process_cpu_s(pid: int) -> float:
    """User plus system CPU a process has used, from /proc/<pid>/stat (Linux)."""
    user_s, system_s = process_times_s(pid)
    return user_s + system_s


def process_times_s(pid: int) -> tuple[float, float]:
    """User and system CPU a process has used: the system part is its syscalls' (on loopback,
    a send also runs the receiver's TCP stack in the sender's time)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    tick_s = 1 / os.sysconf("SC_CLK_TCK")
    return int(fields[11]) * tick_s, int(fields[12]) * tick_s


def load_average() -> float:
    """The 1-minute load average: printed beside every figure, since the machine may be shared."""
    return os.getloadavg()[0]


@dataclass
class Server:
    """A server process of this benchmark's, ready once `live_path` answers 200; stopped by pid."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    live_path: str = "/health/live"
    start_timeout_s: float = START_TIMEOUT_S
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    # A file, not a pipe: a pipe nobody reads blocks a server that logs a burst of errors.
    _log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        ensure(self.process is not None, f"{self.name} runs")
        assert self.process is not None
        return self.process.pid

    def start(self) -> Server:
        argv = [*self.argv, "--host", "127.0.0.1", "--port", str(self.port)]
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in stop())
        self.process = subprocess.Popen(argv, env={**os.environ, **self.env}, cwd=REPO_ROOT,
                                        stdout=self._log, stderr=subprocess.STDOUT)

        def live() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"{self.url}{self.live_path}", timeout=1.0).status_code == 200
            return False

        try:
            wait_ready(self.process, live, timeout_s=self.start_timeout_s, what=self.name)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; its output: {self.output()[-2000:]}") from exc
        return self

    def output(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def stop(self) -> None:
        stop(self.process)
        self.process = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


def serve_argv() -> list[str]:
    """Ours, as an operator runs it."""
    return [sys.executable, "-m", "api.cli", "serve"]


@dataclass
class Target:
    """One thing wrk loads: its URL, the process whose CPU is its cost, and its Redis."""

    name: str
    url: str
    pid: int
    model: str
    api_key: str | None
    script: Path
    redis_url: str | None = None
    route: str = "chat"  # or "messages": Anthropic's body and headers

    def headers(self) -> dict[str, str]:
        if self.route == "messages":
            auth = {"x-api-key": self.api_key} if self.api_key else {}
            return {"content-type": "application/json", "anthropic-version": ANTHROPIC_VERSION,
                    **auth}
        auth = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return {"content-type": "application/json", **auth}

    def body(self) -> str:
        return messages_body(self.model) if self.route == "messages" else chat_body(self.model)


@dataclass(frozen=True)
class Ours:
    """One instance of our gateway in the rig: its server, its own Redis, its budget."""

    server: Server
    redis: RedisServer
    budget_id: str
    model: str


@dataclass
class Rig:
    """The stub, the gateways and their Redis servers, set up for wrk; see the module docstring."""

    directory: Path
    stub: Server
    targets: dict[str, Target]
    ours: dict[str, Ours]
    redis_by_target: dict[str, RedisServer]


def prices_file(directory: Path, models: Sequence[str]) -> Path:
    path = directory / "prices.json"
    rates = {"input_usd_per_mtok": str(INPUT_MICROS_PER_TOKEN),
             "output_usd_per_mtok": str(OUTPUT_MICROS_PER_TOKEN)}
    path.write_text(json.dumps({"models": dict.fromkeys(models, rates)}))
    return path


def hardcap_config(directory: Path, stub_url: str, redis_url: str, api_key: str) -> Path:
    """hardcap's own settings but for what the run needs: the stub, a Redis, one tenant whose
    budget (total tokens per window) the run cannot spend, and the model's price (which hardcap
    turns into a cost metric per call, as ours prices every call). JSON is YAML."""
    model = MODELS["hardcap"]
    path = directory / "hardcap.yaml"
    path.write_text(json.dumps({
        "redis_url": redis_url,
        "upstreams": {"stub": {"kind": "openai", "base_url": stub_url}},
        "routes": {model: {"targets": [{"upstream": "stub", "model": model}]}},
        "tenants": {HARDCAP_TENANT: {"api_keys": [api_key], "budget": {
            "window_s": HARDCAP_WINDOW_S, "total": HARDCAP_TOKENS}}},
        "pricing": {model: {"input": INPUT_MICROS_PER_TOKEN, "output": OUTPUT_MICROS_PER_TOKEN}},
    }))
    return path


WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = [[@BODY@]]
wrk.headers["Content-Type"] = "application/json"
@AUTH@

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '\\nBENCH {"requests": %d, "duration_us": %d, "socket_errors": %d, "status_errors": %d, ' ..
    '"timeouts": %d, "p50_us": %d, "p90_us": %d, "p99_us": %d, "p999_us": %d, "max_us": %d}\\n',
    summary.requests, summary.duration, e.connect + e.read + e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency:percentile(99.9), latency.max))
end
"""


def wrk_script(directory: Path, name: str, model: str, api_key: str | None,
               route: str = "chat") -> Path:
    if route == "messages":
        auth = (f'wrk.headers["x-api-key"] = "{api_key}"\n' if api_key else "") + (
            f'wrk.headers["anthropic-version"] = "{ANTHROPIC_VERSION}"')
        body = messages_body(model)
    else:
        auth = f'wrk.headers["Authorization"] = "Bearer {api_key}"' if api_key else ""
        body = chat_body(model)
    path = directory / f"{name}.lua"
    path.write_text(WRK_SCRIPT.replace("@BODY@", body).replace("@AUTH@", auth))
    return path


def messages_target(directory: Path, key: str, target: Target, base_url: str) -> Target:
    """`target`'s server on Anthropic's Messages route, for the one-connection measurement."""
    return Target(f"{target.name}, /v1/messages", f"{base_url}/v1/messages", target.pid,
                  target.model, target.api_key,
                  wrk_script(directory, f"{key}-messages", target.model, target.api_key,
                             "messages"), target.redis_url, "messages")


def create_key(ours: Server, budget_id: str, timeout_s: float = REQUEST_TIMEOUT_S) -> str:
    """A gateway-role key for the budget. Keys have roles on branches with issue 13's owners
    work, and `gateway` is the default there; a service without roles refuses the field."""
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    created = httpx.post(f"{ours.url}/v1/admin/keys", headers=admin,
                         json={"budget_id": budget_id, "roles": ["gateway"]}, timeout=timeout_s)
    if created.status_code == 422 and "roles" in created.text:
        created = httpx.post(f"{ours.url}/v1/admin/keys", headers=admin,
                             json={"budget_id": budget_id}, timeout=timeout_s)
    ensure(created.status_code == 201, f"create a key: {created.status_code} {created.text}")
    return str(created.json()["api_key"])


def start_ours(stack: contextlib.ExitStack, directory: Path, stub: Server, key: str, name: str,
               argv: Sequence[str], start_timeout_s: float = START_TIMEOUT_S
               ) -> tuple[Ours, Target]:
    """An instance of ours with its own Redis, a budget the run cannot spend and a key for it."""
    model = f"bench-{key}"
    redis_server = stack.enter_context(RedisServer(durable=False))
    server = stack.enter_context(Server(name, [*argv], {
        "REDIS_URL": redis_server.url, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN,
        # Persistence off, as the baselines run theirs: the run measures the call path.
        "CEILING_ACCEPT_NOT_DURABLE": "1",
        "CEILING_UPSTREAM_URL": f"{stub.url}/v1",
        "CEILING_ANTHROPIC_URL": stub.url,
        # The stub stands in for the providers' own hosts, whose calls are on their own bills
        # as in production (a proxy's go on `other`, with one more step per call).
        "CEILING_UPSTREAM_BILL": "openai",
        "CEILING_ANTHROPIC_BILL": "anthropic",
        "CEILING_PRICES_FILE": str(prices_file(directory / key, [model])),
    }, start_timeout_s=start_timeout_s))
    budget_id = f"org:bench{uuid.uuid4().hex[:8]}"
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    # The first admin request builds the admin surface (api/app.py): slow under a wrapper.
    httpx.put(f"{server.url}/v1/admin/budgets/{budget_id}", headers=admin, json={
        "limits": [{"period": "total", "ceiling_micros": CEILING_MICROS}]},
        timeout=start_timeout_s).raise_for_status()
    api_key = create_key(server, budget_id, start_timeout_s)
    target = Target(name, f"{server.url}/v1/chat/completions", server.pid, model, api_key,
                    wrk_script(directory, key, model, api_key), redis_server.url)
    return Ours(server, redis_server, budget_id, model), target


@contextlib.contextmanager
def rig(*, with_hardcap: bool = True, with_floors: bool = True,
        ours: Mapping[str, tuple[str, Sequence[str]]] | None = None,
        under: Sequence[str] = ()) -> Iterator[Rig]:
    """Everything started, configured and checked to answer; all of it stopped on the way out.

    `ours` names the instances of our gateway to start, key -> (name, argv); by default one,
    "ours", run as `ceiling serve`. `under` is a command both gateways (ours and hardcap) run
    under, such as valgrind's: hardcap's console script is then run by its venv's python."""
    with contextlib.ExitStack() as stack:
        directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sc-bench-")))
        python = side_venv.python()
        stub = stack.enter_context(Server("bench stub", [python, "-m", "bench.stub_upstream"]))
        instances, targets, redis_by_target = {}, {}, {}
        start_timeout = UNDER_START_TIMEOUT_S if under else START_TIMEOUT_S
        for key, (name, argv) in (ours or {"ours": ("spend-ceiling", serve_argv())}).items():
            (directory / key).mkdir()
            instances[key], targets[key] = start_ours(
                stack, directory, stub, key, name, [*under, *argv], start_timeout)
            redis_by_target[key] = instances[key].redis
        if with_hardcap:
            redis_hardcap = stack.enter_context(RedisServer(durable=False))
            hardcap_key = f"sk-bench-{secrets.token_hex(8)}"
            config = hardcap_config(directory, stub.url, redis_hardcap.url, hardcap_key)
            hardcap = stack.enter_context(Server(
                "hardcap", [*under, *([python] if under else []), side_venv.tool("hardcap"),
                            "serve", "-c", str(config)],
                live_path="/healthz", start_timeout_s=start_timeout))
            targets["hardcap"] = Target(
                "hardcap 0.1.0", f"{hardcap.url}/v1/chat/completions", hardcap.pid,
                MODELS["hardcap"], hardcap_key,
                wrk_script(directory, "hardcap", MODELS["hardcap"], hardcap_key),
                redis_hardcap.url)
            redis_by_target["hardcap"] = redis_hardcap
        if with_floors:
            relay = stack.enter_context(Server("bare relay", [
                sys.executable, "-m", "bench.relay_app", "--upstream", f"{stub.url}/v1"]))
            floor = MODELS["relay"]
            targets["relay"] = Target("bare relay", f"{relay.url}/v1/chat/completions",
                                      relay.pid, floor, None,
                                      wrk_script(directory, "relay", floor, None))
            targets["direct"] = Target("direct (stub)", f"{stub.url}/v1/chat/completions",
                                       stub.pid, floor, None,
                                       wrk_script(directory, "direct", floor, None))
            # Messages: ours (the first instance), the relay and the stub, on that route. Their
            # calls count under the same models, so the books below check them too.
            first = next(iter(instances))
            for key, base_url in ((first, instances[first].server.url), ("relay", relay.url),
                                  ("direct", stub.url)):
                targets[f"{key}-messages"] = messages_target(directory, key, targets[key],
                                                             base_url)
        for target in targets.values():
            # One call each before any load: a gateway that answers anything but 200 stops here.
            answer = httpx.post(target.url, content=target.body(),
                                headers=target.headers(), timeout=start_timeout)
            ensure(answer.status_code == 200,
                   f"{target.name}: {answer.status_code} {answer.text[:500]}")
        yield Rig(directory, stub, targets, instances, redis_by_target)


# -- wrk ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    """What one wrk run counted, and the CPU each process spent meanwhile."""

    target: str
    connections: int
    requests: int
    elapsed_s: float
    p50_s: float
    p90_s: float
    p99_s: float
    p999_s: float
    max_s: float
    gateway_cpu_s: float
    gateway_system_s: float
    redis_cpu_s: float | None
    stub_cpu_s: float
    load_average: float

    @property
    def system_share(self) -> float:
        return self.gateway_system_s / self.gateway_cpu_s if self.gateway_cpu_s else 0.0

    @property
    def calls_per_s(self) -> float:
        return self.requests / self.elapsed_s

    def per_call_s(self, cpu_s: float | None) -> float | None:
        return None if cpu_s is None else cpu_s / self.requests


def redis_cpu_s(url: str) -> float:
    """CPU Redis has used (INFO cpu: its main process, user plus system)."""
    with redis.Redis.from_url(url) as client:
        info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def run_wrk(target: Target, stub_pid: int, connections: int, seconds: int) -> Load:
    binary = shutil.which("wrk")
    if binary is None:
        raise RuntimeError("wrk is not installed (apt-get install wrk)")
    argv = [binary, "-t1", f"-c{connections}", f"-d{seconds}s", f"--timeout={REQUEST_TIMEOUT_S}s",
            "--latency", "-s", str(target.script), target.url]
    load_now = load_average()
    redis_before_s = redis_cpu_s(target.redis_url) if target.redis_url else None
    (user_before_s, system_before_s), stub_before_s = (process_times_s(target.pid),
                                                       process_cpu_s(stub_pid))
    # run() kills wrk if this process is interrupted while waiting for it.
    done = subprocess.run(argv, capture_output=True, timeout=seconds + WRK_MARGIN_S, check=False)
    user_s, system_s = process_times_s(target.pid)
    gateway_system_s = system_s - system_before_s
    gateway_cpu_s = user_s - user_before_s + gateway_system_s
    stub_cpu_s = process_cpu_s(stub_pid) - stub_before_s
    redis_used_s = (redis_cpu_s(target.redis_url) - redis_before_s
                    if target.redis_url and redis_before_s is not None else None)
    out = done.stdout.decode()
    lines = [line for line in out.splitlines() if line.startswith("BENCH ")]
    if done.returncode != 0 or len(lines) != 1:
        raise RuntimeError(f"wrk exited with {done.returncode}: {out}{done.stderr.decode()}")
    got = json.loads(lines[0].removeprefix("BENCH "))
    failed = got["socket_errors"] + got["status_errors"] + got["timeouts"]
    ensure(failed == 0, f"{target.name}: every call answered 200: {got}")
    ensure(got["requests"] > 0, f"{target.name}: wrk counted calls")
    return Load(target.name, connections, got["requests"], got["duration_us"] / 1e6,
                got["p50_us"] / 1e6, got["p90_us"] / 1e6, got["p99_us"] / 1e6,
                got["p999_us"] / 1e6, got["max_us"] / 1e6, gateway_cpu_s, gateway_system_s,
                redis_used_s, stub_cpu_s, load_now)


# -- what a gateway leaves in Redis ---------------------------------------------------------------


@dataclass(frozen=True)
class RedisState:
    used_memory_bytes: int
    keys: int
    calls: int  # calls the stub had answered for this gateway when the state was read


def key_pattern(key: str) -> str:
    """A key with its ids (hex, digits, base64-ish runs of 8+) as `*`: what kind of key it is."""
    return re.sub(r"[0-9a-f]{8,}|[A-Za-z0-9_-]{20,}|\d+", "*", key)


def redis_state(url: str, calls: int) -> RedisState:
    with redis.Redis.from_url(url) as client:
        return RedisState(int(client.info("memory")["used_memory"]), int(client.dbsize()), calls)


def key_patterns(url: str, top: int = 6) -> list[tuple[str, int]]:
    with redis.Redis.from_url(url, decode_responses=True) as client:
        return Counter(key_pattern(k) for k in client.scan_iter(count=1000)).most_common(top)


def stub_calls(stub: Server) -> dict[str, int]:
    bill = httpx.get(f"{stub.url}/billing", timeout=REQUEST_TIMEOUT_S).json()
    return {str(k): int(v) for k, v in bill["calls_by_model"].items()}


# -- the run ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Results:
    serial: dict[str, Load]
    rounds: tuple[tuple[str, Load], ...]  # (target key, load) in the order run
    kept: dict[str, tuple[RedisState, RedisState, list[tuple[str, int]]]]
    books: list[str]
    load_before: float
    load_after: float

    def loads(self, key: str) -> list[Load]:
        return [load for k, load in self.rounds if k == key]


def measure(rig_: Rig, options: argparse.Namespace) -> Results:
    load_before = load_average()
    stub_pid = rig_.stub.pid
    targets = rig_.targets
    for target in targets.values():
        run_wrk(target, stub_pid, options.connections, options.warmup_seconds)
    # The reading against which what each gateway keeps is measured: scripts loaded, pools full.
    calls = stub_calls(rig_.stub)
    baseline = {k: redis_state(r.url, calls.get(targets[k].model, 0))
                for k, r in rig_.redis_by_target.items()}
    serial = {}
    if options.serial_seconds:
        for key, target in targets.items():
            serial[key] = run_wrk(target, stub_pid, 1, options.serial_seconds)
    rounds: list[tuple[str, Load]] = []
    schedule = [{"A": "ours", "B": "hardcap"}[c] for c in options.schedule]
    floors = [k for k in ("relay", "direct") if k in targets]
    for key in [k for k in schedule if k in targets] + floors:
        seconds = options.floor_seconds if key in floors else options.seconds
        rounds.append((key, run_wrk(targets[key], stub_pid, options.connections, seconds)))
    calls = stub_calls(rig_.stub)
    kept = {}
    for key, server in rig_.redis_by_target.items():
        after = redis_state(server.url, calls.get(targets[key].model, 0))
        kept[key] = (baseline[key], after, key_patterns(server.url))
    books = [check_ours(instance, calls) for instance in rig_.ours.values()]
    if "hardcap" in targets:
        books.append(check_hardcap(rig_.redis_by_target["hardcap"].url, calls))
    return Results(serial, tuple(rounds), kept, books, load_before, load_average())


def check_ours(ours: Ours, calls: dict[str, int]) -> str:
    """Ours must have committed what the stub's calls cost, to the micro-dollar, and hold
    nothing: every call it forwarded was settled from the stub's usage."""
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    budget = httpx.get(f"{ours.server.url}/v1/admin/budgets/{ours.budget_id}", headers=admin,
                       timeout=REQUEST_TIMEOUT_S).json()
    period = budget["periods"][0]
    served = calls.get(ours.model, 0)
    bill_micros = served * (20 * INPUT_MICROS_PER_TOKEN + 20 * OUTPUT_MICROS_PER_TOKEN)
    ensure(period["reserved_micros"] == 0, f"ours holds nothing after the run: {period}")
    ensure(period["committed_micros"] == bill_micros,
           f"ours committed {period['committed_micros']}, the stub's {served} calls cost "
           f"{bill_micros}")
    return (f"{ours.server.name}: {served:,} calls through it reached the stub, committed "
            f"{period['committed_micros']:,} micro-dollars = their cost; nothing held")


def check_hardcap(url: str, calls: dict[str, int]) -> str:
    """hardcap's token counters against the stub's: every call counted, nothing reserved."""
    served = calls.get(MODELS["hardcap"], 0)
    totals: Counter[str] = Counter()
    with redis.Redis.from_url(url, decode_responses=True) as client:
        for key in client.scan_iter(match=f"hardcap:{{{HARDCAP_TENANT}}}:b:*"):
            totals.update({k: int(v) for k, v in client.hgetall(key).items()})
    ensure(totals["in"] == served * 20 and totals["out"] == served * 20,
           f"hardcap counted {dict(totals)} tokens for the stub's {served} calls")
    ensure(totals["rin"] == 0 and totals["rout"] == 0, f"hardcap holds nothing: {dict(totals)}")
    return (f"hardcap: {served:,} calls through it reached the stub, counted "
            f"{totals['in']:,} + {totals['out']:,} tokens = theirs; nothing reserved")


# -- the report ---------------------------------------------------------------------------------


def us(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e6:.0f}"


def total_per_call_s(loads: Sequence[Load], attribute: str) -> float | None:
    spent = [getattr(x, attribute) for x in loads]
    if not loads or any(s is None for s in spent):
        return None
    return float(sum(spent)) / sum(x.requests for x in loads)


def ratio(a: float | None, b: float | None) -> str:
    return "" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def pair_ratios(results: Results) -> list[float]:
    """ours/hardcap calls/s of each adjacent A,B pair of rounds, in the order run."""
    ab = [(k, x) for k, x in results.rounds if k in ("ours", "hardcap")]
    return [a.calls_per_s / b.calls_per_s if ka == "ours" else b.calls_per_s / a.calls_per_s
            for (ka, a), (kb, b) in zip(ab[::2], ab[1::2], strict=False) if ka != kb]


def uvicorn_picks() -> str:
    """What uvicorn's `auto` runs `ceiling serve` on in this venv: uvloop and httptools when
    they are installed, asyncio and h11 when not."""
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    return f"{loop} + {http}"


def report(results: Results, options: argparse.Namespace) -> str:
    out = [f"load average (1 min): {results.load_before:.2f} before the run, "
           f"{results.load_after:.2f} after it; {os.cpu_count()} cores. `ceiling serve` runs "
           f"on {uvicorn_picks()} in this venv"]
    if results.serial:
        rows = []
        for key, x in results.serial.items():
            direct = results.serial.get(direct_of(key))
            added = "" if direct is None or direct is x else ms(x.p50_s - direct.p50_s)
            rows.append([x.target, f"{x.load_average:.2f}", f"{x.requests:,}", ms(x.p50_s),
                         ms(x.p99_s), added, us(x.per_call_s(x.gateway_cpu_s))])
        out += ["", table(["one connection", "load", "calls", "p50 ms", "p99 ms",
                           "p50 added ms", "CPU us/call"], rows)]
        out += latency_goals(results.serial)
    rows = [[f"{i + 1}", x.target, f"{x.load_average:.2f}", f"{x.calls_per_s:,.0f}",
             ms(x.p50_s), ms(x.p99_s), ms(x.p999_s), ms(x.max_s),
             us(x.per_call_s(x.gateway_cpu_s)), f"{100 * x.system_share:.0f}",
             us(x.per_call_s(x.redis_cpu_s)), us(x.per_call_s(x.stub_cpu_s))]
            for i, (_, x) in enumerate(results.rounds)]
    out += ["", table([f"round ({options.connections} conn.)", "target", "load", "calls/s",
                       "p50 ms", "p99 ms", "p99.9 ms", "max ms", "gw CPU us/call", "sys %",
                       "redis us/call", "stub us/call"], rows)]
    summary: dict[str, dict[str, Any]] = {}
    rows = []
    for key in ("ours", "hardcap", "relay", "direct"):
        loads = results.loads(key)
        if not loads:
            continue
        s = summary[key] = {
            "calls_per_s": statistics.median(x.calls_per_s for x in loads),
            "p50_s": statistics.median(x.p50_s for x in loads),
            "p99_s": statistics.median(x.p99_s for x in loads),
            "p99_range": (min(x.p99_s for x in loads), max(x.p99_s for x in loads)),
            "gateway": total_per_call_s(loads, "gateway_cpu_s"),
            "system": (sum(x.gateway_system_s for x in loads)
                       / max(sum(x.gateway_cpu_s for x in loads), 1e-9)),
            "redis": total_per_call_s(loads, "redis_cpu_s"),
            "stub": total_per_call_s(loads, "stub_cpu_s"),
            "load": statistics.median(x.load_average for x in loads),
        }
        low, high = s["p99_range"]
        rows.append([loads[0].target, f"{len(loads)}", f"{s['load']:.2f}",
                     f"{s['calls_per_s']:,.0f}", ms(s["p50_s"]), ms(s["p99_s"]),
                     f"{ms(low)}-{ms(high)}", us(s["gateway"]), f"{100 * s['system']:.0f}",
                     us(s["redis"]), us(s["stub"])])
    if "ours" in summary and "hardcap" in summary:
        a, b = summary["ours"], summary["hardcap"]
        pairs = pair_ratios(results)
        rows.append(["ours / hardcap", "", "",
                     f"{statistics.median(pairs):.2f}" if pairs else "",
                     ratio(a["p50_s"], b["p50_s"]), ratio(a["p99_s"], b["p99_s"]), "",
                     ratio(a["gateway"], b["gateway"]), "", ratio(a["redis"], b["redis"]), ""])
    out += ["", table(["medians of rounds", "rounds", "load", "calls/s", "p50 ms", "p99 ms",
                       "p99 range", "gw CPU us/call", "sys %", "redis us/call", "stub us/call"],
                      rows)]
    if "ours" in summary and "hardcap" in summary:
        pairs = pair_ratios(results)
        out.append(f"calls/s ratio of each A,B pair: {', '.join(f'{p:.2f}' for p in pairs)} "
                   "(the median is the ratio above); CPU per call: all rounds' CPU / calls")
    rows = []
    for key, (before, after, _) in results.kept.items():
        calls = after.calls - before.calls
        grown = after.used_memory_bytes - before.used_memory_bytes
        rows.append([results.loads(key)[0].target if results.loads(key) else key, f"{calls:,}",
                     f"{grown:,}", f"{grown / calls:.0f}" if calls else "",
                     f"{before.keys:,} -> {after.keys:,}",
                     f"{(after.keys - before.keys) / calls:.2f}" if calls else ""])
    out += ["", table(["kept in Redis (after warm-up -> after run)", "calls", "used_memory +B",
                       "B/call", "keys", "keys/call"], rows)]
    for key, (_, _, patterns) in results.kept.items():
        out.append(f"{key} keys by pattern: " + ", ".join(f"{p} x{n:,}" for p, n in patterns))
    out += ["", *results.books]
    if "ours" in summary and "hardcap" in summary:
        out += ["", verdict(results, summary)]
    return "\n".join(out)


def direct_of(key: str) -> str:
    """The direct call on the same route as target `key`."""
    return "direct-messages" if key.endswith("-messages") else "direct"


def latency_goals(serial: dict[str, Load]) -> list[str]:
    """Issue 15's goal, one connection at a time: the p50 our gateway adds to a direct call is
    within ADDED_P50_OVER_RELAY_MAX_S of what the bare relay adds, on each route."""
    lines = []
    for ours, relay in (("ours", "relay"), ("ours-messages", "relay-messages")):
        if not {ours, relay, direct_of(ours)} <= serial.keys():
            continue
        direct = serial[direct_of(ours)].p50_s
        added, floor = serial[ours].p50_s - direct, serial[relay].p50_s - direct
        ok = added - floor <= ADDED_P50_OVER_RELAY_MAX_S
        lines.append(f"{'PASS' if ok else 'FAIL'}: {serial[ours].target}: p50 added within "
                     f"{ADDED_P50_OVER_RELAY_MAX_S * 1000:.1f} ms of the bare relay's "
                     f"({ms(added)} vs {ms(floor)} ms, {ms(added - floor)} over)")
    return lines


def verdict(results: Results, summary: dict[str, dict[str, Any]]) -> str:
    a, b = summary["ours"], summary["hardcap"]
    pairs = pair_ratios(results)
    calls_ratio = statistics.median(pairs) if pairs else float("nan")
    before, after, _ = results.kept["ours"]
    calls = after.calls - before.calls
    kept = (after.used_memory_bytes - before.used_memory_bytes) / calls if calls else float("nan")
    goals = [
        (f"calls/s >= {CALLS_RATIO_MIN:.1f}x hardcap's", calls_ratio >= CALLS_RATIO_MIN,
         f"{calls_ratio:.2f}x"),
        ("gateway CPU per call <= hardcap's", a["gateway"] <= b["gateway"],
         f"{us(a['gateway'])} vs {us(b['gateway'])} us"),
        ("Redis CPU per call <= hardcap's", a["redis"] <= b["redis"],
         f"{us(a['redis'])} vs {us(b['redis'])} us"),
        (f"p99 <= {P99_RATIO_MAX:.1f}x hardcap's", a["p99_s"] <= P99_RATIO_MAX * b["p99_s"],
         f"{ms(a['p99_s'])} vs {ms(b['p99_s'])} ms"),
        (f"<= {BYTES_PER_CALL_MAX} bytes kept per call", kept <= BYTES_PER_CALL_MAX,
         f"{kept:.0f} B"),
    ]
    return "\n".join(f"{'PASS' if ok else 'FAIL'}: {goal} ({got})" for goal, ok, got in goals)


def options_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    quick = ", ".join(f"{k}={v}" for k, v in QUICK.items())
    parser.add_argument("--quick", action="store_true", help=f"a short smoke run: {quick}")
    parser.add_argument("--connections", type=int, default=CONNECTIONS)
    parser.add_argument("--seconds", type=int, default=ROUND_S, help="per A or B round")
    parser.add_argument("--schedule", default=SCHEDULE,
                        help="rounds of ours (A) and hardcap (B), in order")
    parser.add_argument("--warmup-seconds", type=int, default=WARMUP_S)
    parser.add_argument("--floor-seconds", type=int, default=FLOOR_S,
                        help="the relay's and the direct round's")
    parser.add_argument("--serial-seconds", type=int, default=SERIAL_S,
                        help="one connection per target first; 0 skips it")
    return parser


def parse_options(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = options_parser()
    options = parser.parse_args(argv)
    if options.quick:
        parser.set_defaults(**QUICK)
        options = parser.parse_args(argv)
    ensure(set(options.schedule) <= {"A", "B"}, "--schedule is made of A and B")
    return options


def main(argv: Sequence[str] | None = None) -> None:
    options = parse_options(argv)
    with rig() as rig_:
        results = measure(rig_, options)
    print(report(results, options))


if __name__ == "__main__":
    main()
