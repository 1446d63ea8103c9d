"""HTTP throughput of POST /v1/reservations against a bare FCALL endpoint, and the cold start.

    .venv/bin/python -m bench.http      # ~70 s on a quiet machine, ~2 min on a busy one; --help
                                        # needs wrk: apt-get install wrk

Run it as a module from the repository root (`python bench/http.py` would put bench/ first on
sys.path, where this file hides the standard library's `http`).

One redis-server (AOF everysec, as in production) and two uvicorn servers, each one worker
started as `ceiling serve` starts it (gc.freeze() after start-up), all on free loopback ports
and stopped by pid:

  service  `ceiling serve` (infra.service.ServiceProcess) with REDIS_URL and CEILING_ADMIN_TOKEN;
           a budget path of 3 scopes (4 legs: org day+total, team month, key total) with ceilings
           that never refuse, and one API key, both made through the admin routes.
  bare     bench/bare_app.py: one FastAPI route that runs one FCALL of the same reserve function
           with the keys and arguments the service's store builds for the same call (recorded
           from a CeilingService made as the runtime makes it, with the same key), a fresh
           reservation id per request, through the same client factory. No key check, no
           pricing, no body parsing; a small JSON answer.

wrk (C, one thread, CONNECTIONS keep-alive HTTP/1.1 connections, its own process) sends the
load, so the Python under test is the only Python in the path; its own CPU is printed to show it
is not the bottleneck. Both servers get the same request bytes (path, Authorization header, JSON
body); the bare route ignores them. Three loads, interleaved over rounds (the machine is shared
and noisy), medians reported:

  reserve  POST /v1/reservations to the service: requests/s and its latency.
  bare     the same request to the bare endpoint: requests/s. Target: reserve >= 1.0 x bare,
           the median of the ratios of the two loads of each round.
  cycle    reserve, then settle the returned id (a Lua script in wrk reads each answer):
           cycles/s, for context against bare.

Latency is also taken with one connection, no queue in front: a reserve and a bare request by
wrk, and in the cycle load each reserve, each settle and each pair, timed in Lua. The server's
own CPU per request (from /proc) is printed beside every rate: it moves less than throughput
when other processes take the cores, and bare/service CPU is the ratio a server with a core to
itself would approach. The ledger's counters are checked at the end against what wrk counted,
so a loop that only collected errors cannot pass for a fast one.

Then the cold start, in fresh processes, wall time and CPU: `python -c "import api.index"` (what
a serverless instance imports before its first request; target within 1.15x of `import fastapi`
alone in the same run, interpreter start included), an empty interpreter for context,
`-X importtime` for where the time goes, and spawn to the first 200 of /health/live for
`ceiling serve` and for `uvicorn api.index:app` (the platform way: Vercel and Lambda serve the
ASGI app as it is).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO

import httpx

from bench.bare_app import CALL_ENV, call_to_json
from bench.ledger import LIMITS_BY_SCOPE, Call, Recorder
from core.budgets import BudgetId
from core.config import load
from core.errors import InvariantBroken, ensure
from core.ledger import Role
from core.prices import PriceTable, Usage
from core.service import CallSpec, CeilingService, SettleSpec
from core.stores import keys
from core.stores.redis import RedisTransport, redis_client
from core.stores.scripted import ScriptedStore
from infra.figures import median, ms, percentile, table
from infra.processes import Child, free_port
from infra.processes import stop as stop_process
from infra.redis_server import RedisServer
from infra.service import ServiceProcess

REPO_ROOT = Path(__file__).resolve().parents[1]

# The reserve route serves at least the bare endpoint's rate: what the service does beyond its
# one script call (the key check, pricing, its HTTP layer) costs no more than the naive route's
# framework and client overhead it avoids.
TARGET_RATIO = 1.0
# Below this share of a core under load, a server was mostly waiting for the machine, and its
# rate says more about the machine's other work than about the server.
CORE_SHARE_BOUND = 0.9
# The app is a FastAPI app (the design fixes it): `import fastapi` is the yardstick for its
# import, which stays within this share of it. The hot routes import no FastAPI (api/app.py
# builds it on the first request that needs it), so a serverless instance that serves only
# them starts below the yardstick.
IMPORT_RATIO_MAX = 1.15
# Enough concurrent requests to keep one uvicorn worker busy through every await on Redis,
# few enough that latency under load is mostly service time, not queue.
CONNECTIONS = 32
# Many short rounds rather than a few long ones: on a shared machine the load changes within
# seconds, and the median of pairs run side by side is what survives it. wrk takes whole
# seconds. Six rounds put each load first, second and third twice.
ROUNDS = 6
PHASE_S = 2
WARMUP_S = 1
SEQUENTIAL_S = 2
IMPORT_RUNS = 4
# -X importtime's own overhead makes it a profile, not the figure judged: fewer runs suffice.
IMPORTTIME_RUNS = 2
COLD_START_RUNS = 3
# A request still unanswered after this is counted by wrk as a timeout, which fails the run.
REQUEST_TIMEOUT_S = 10
# wrk stops itself after its duration; one still running this long after is stuck.
WRK_MARGIN_S = 30.0
# An import or a cold start that takes this long is broken, not slow.
SPAWN_TIMEOUT_S = 60.0
# Time-to-first-answer is polled this often: finer than ServiceProcess' 50 ms, which would be a
# sixth of the target.
POLL_S = 0.005

# Made per run: the admin routes of a server on a free port are closed to anything else.
ADMIN_TOKEN = secrets.token_hex(16)
BUDGET_PATH = "org:benchhttp/team:search/key:k1"
# A small chat call, priced by the service from the bundled prices; settled below its estimate.
MODEL = "gpt-4o-mini"
INPUT_TOKENS = 500
OUTPUT_TOKENS_MAX = 1_000
OUTPUT_TOKENS = 200
RESERVE_BODY = json.dumps(
    {"model": MODEL, "input_tokens": INPUT_TOKENS, "max_output_tokens": OUTPUT_TOKENS_MAX},
    separators=(",", ":"),
)
SETTLE_BODY = json.dumps(
    {"input_tokens": INPUT_TOKENS, "output_tokens": OUTPUT_TOKENS}, separators=(",", ":")
)
RESERVE_PATH = "/v1/reservations"

# -- wrk scripts ----------------------------------------------------------------------------------

# Every load sends the same request bytes. done() runs in wrk's main Lua state and reads each
# thread's globals from that thread's own state; it prints one line this file parses.
WRK_COMMON = """
wrk.method = "POST"
wrk.path = "@PATH@"
wrk.body = [[@RESERVE_BODY@]]
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer @API_KEY@"

reserves, settles, others = 0, 0, 0
reserve_us, settle_us, cycle_us = {}, {}, {}
local threads = {}

function setup(thread)
  table.insert(threads, thread)
end

local function joined(name)
  local parts = {}
  for _, t in ipairs(threads) do
    local xs = t:get(name)
    if #xs > 0 then table.insert(parts, table.concat(xs, ",")) end
  end
  return "[" .. table.concat(parts, ",") .. "]"
end

function done(summary, latency, requests)
  local r, s, o = 0, 0, 0
  for _, t in ipairs(threads) do
    r = r + t:get("reserves")
    s = s + t:get("settles")
    o = o + t:get("others")
  end
  local e = summary.errors
  io.write(string.format(
    '\\nBENCH {"requests": %d, "duration_us": %d, "socket_errors": %d, "status_errors": %d, ' ..
    '"timeouts": %d, "p50_us": %d, "p99_us": %d, "reserves": %d, "settles": %d, "others": %d, ',
    summary.requests, summary.duration, e.connect + e.read + e.write, e.status, e.timeout,
    math.floor(latency:percentile(50)), math.floor(latency:percentile(99)), r, s, o))
  io.write('"reserve_us": ' .. joined("reserve_us") .. ', "settle_us": ' .. joined("settle_us") ..
           ', "cycle_us": ' .. joined("cycle_us") .. '}\\n')
end
"""

# The cycle: a settle for every reservation answered, sent on whichever connection is free
# next (wrk has no per-connection state in Lua), before any new reserve, so ids never pile up.
# With one connection (`-- timed`), requests and answers alternate, so each answer can be timed
# against the request before it: wrk's own histogram mixes reserves and settles.
WRK_CYCLE = """
local ffi = require("ffi")
ffi.cdef[[
typedef struct { long tv_sec; long tv_nsec; } bench_timespec;
int clock_gettime(int clock_id, bench_timespec *tp);
]]
local CLOCK_MONOTONIC = 1
local clock = ffi.new("bench_timespec")
local function now_us()
  ffi.C.clock_gettime(CLOCK_MONOTONIC, clock)
  return tonumber(clock.tv_sec) * 1000000 + tonumber(clock.tv_nsec) / 1000
end

local pending = {}
local reserve_request
local timed = false
local sent_us, reserve_sent_us = 0, 0

function init(args)
  reserve_request = wrk.format()
  timed = args[1] == "timed"
end

function request()
  local id = table.remove(pending)
  if timed then sent_us = now_us() end
  if id then
    return wrk.format(nil, "@PATH@/" .. id .. "/settle", nil, [[@SETTLE_BODY@]])
  end
  reserve_sent_us = sent_us
  return reserve_request
end

function response(status, headers, body)
  local took_us = timed and now_us() - sent_us
  if status == 201 then
    reserves = reserves + 1
    table.insert(pending, string.match(body, '"reservation_id":"([^"]+)"'))
    if timed then table.insert(reserve_us, took_us) end
  elseif status == 200 then
    settles = settles + 1
    if timed then
      table.insert(settle_us, took_us)
      table.insert(cycle_us, sent_us + took_us - reserve_sent_us)
    end
  else
    others = others + 1
  end
end
"""


def wrk_script(directory: Path, name: str, api_key: str, *, cycle: bool) -> Path:
    text = WRK_COMMON + (WRK_CYCLE if cycle else "")
    for hole, value in (("@PATH@", RESERVE_PATH), ("@RESERVE_BODY@", RESERVE_BODY),
                        ("@SETTLE_BODY@", SETTLE_BODY), ("@API_KEY@", api_key)):
        text = text.replace(hole, value)
    path = directory / f"{name}.lua"
    path.write_text(text)
    return path


# -- processes ------------------------------------------------------------------------------------


def server_cpu_s(pid: int) -> float:
    """User + system CPU a process has used, from /proc (utime and stime, in clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    """User + system CPU of every child this process has waited for, so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def pid_of(process: Child | None) -> int:
    if process is None:
        raise InvariantBroken("the server under test runs")
    return process.pid


def answers_live(port: int) -> bool:
    # A raw socket rather than httpx: polled every 5 ms, the poll itself must cost next to nothing.
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
            s.sendall(b"GET /health/live HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            return s.recv(16).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


@dataclass
class Spawned:
    """A server process of ours: started from argv, ready at its first /health/live 200, stopped
    by pid. ServiceProcess runs only `ceiling serve` or the platform app, and polls every 50 ms."""

    argv_head: list[str]
    env: dict[str, str]
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    ready_s: float = 0.0
    # A file, not a pipe: a pipe nobody reads blocks a server that logs a burst of errors.
    _stderr: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Spawned:
        argv = [*self.argv_head, "--host", "127.0.0.1", "--port", str(self.port)]
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed in stop())
        started_s = time.perf_counter()
        self.process = subprocess.Popen(
            argv, env={**os.environ, **self.env}, cwd=REPO_ROOT,
            stdout=subprocess.DEVNULL, stderr=self._stderr,
        )
        try:
            while time.perf_counter() - started_s < SPAWN_TIMEOUT_S:
                if self.process.poll() is not None:
                    self._stderr.seek(0)
                    err = self._stderr.read().decode(errors="replace")
                    raise RuntimeError(f"{' '.join(argv)} exited: {err[-2000:]}")
                if answers_live(self.port):
                    self.ready_s = time.perf_counter() - started_s
                    return self
                time.sleep(POLL_S)
            raise RuntimeError(f"{' '.join(argv)} did not answer within {SPAWN_TIMEOUT_S} s")
        except BaseException:
            # __exit__ does not run when __enter__ fails: an interrupted start stops its own.
            self.stop()
            raise

    def stop(self) -> None:
        stop_process(self.process)
        self.process = None
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def __enter__(self) -> Spawned:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def serve_argv() -> list[str]:
    return [sys.executable, "-m", "api.cli", "serve"]


def platform_argv() -> list[str]:
    return [sys.executable, "-m", "uvicorn", "api.index:app", "--log-level", "warning"]


def bare_argv() -> list[str]:
    return [sys.executable, "-m", "bench.bare_app"]


# -- setting up the budget, the key and the recorded call -----------------------------------------


@dataclass(frozen=True)
class Setup:
    api_key: str
    reserve: Call
    amount_micros: int  # what every reserve holds
    charged_micros: int  # what every settle commits
    reserves: int  # reserves made while setting up, for the final check
    settles: int


def admin_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def service_env(redis_url: str) -> dict[str, str]:
    """What `ceiling serve` is started with: its ledger and the run's admin token."""
    return {"REDIS_URL": redis_url, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN}


def bare_env(redis_url: str, setup: Setup) -> dict[str, str]:
    """What the bare app is started with: the same ledger and the service's recorded reserve."""
    return {"REDIS_URL": redis_url, CALL_ENV: call_to_json(setup.reserve)}


def reserve_headers(api_key: str) -> dict[str, str]:
    """The headers of every reserve, to the service and the bare endpoint alike."""
    return {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}


def create_budget_and_key(client: httpx.Client) -> str:
    """The budget path and one API key, through the admin routes as an operator makes them."""
    for budget_id, limits in zip(BudgetId.parse(BUDGET_PATH).lineage, LIMITS_BY_SCOPE,
                                 strict=True):
        r = client.put(f"/v1/admin/budgets/{budget_id.path}", headers=admin_headers(), json={
            "limits": [{"period": x.period.value, "ceiling_micros": x.ceiling_micros}
                       for x in limits]})
        ensure(r.status_code == 200, f"PUT budget {budget_id.path}: {r.status_code} {r.text}")
    r = client.post("/v1/admin/keys", headers=admin_headers(),
                    json={"budget_id": BUDGET_PATH, "roles": ["sidecar"]})
    ensure(r.status_code == 201, f"POST key: {r.status_code} {r.text}")
    return str(r.json()["api_key"])


async def record_reserve(env: dict[str, str], api_key: str) -> tuple[Call, int]:
    """The reserve the service sends for RESERVE_BODY with this key, recorded, and its amount.

    The service is made as api.runtime makes it from the same environment (prices, lease, expire
    policy), only with a recording transport, and reserves (then settles) once; the bare app
    then sends those very words. A change to what the store sends cannot leave it behind.
    """
    config = load(env)
    ensure(config.redis_url is not None, "REDIS_URL is set")
    recorder = Recorder(RedisTransport(redis_client(str(config.redis_url))))
    service = CeilingService(
        ScriptedStore(recorder), PriceTable.from_file(config.prices_file),
        lease_ttl_ms=config.lease_ttl_ms, expire_policy=config.expire_policy,
    )
    try:
        caller = await service.authenticate(api_key, role=Role.SIDECAR)  # as the route does
        reservation = await service.reserve(caller, CallSpec(
            model=MODEL, input_tokens=INPUT_TOKENS, output_tokens_max=OUTPUT_TOKENS_MAX))
        recorded = recorder.calls[-1]
        await service.settle(caller, reservation.reservation_id,
                             SettleSpec(Usage(INPUT_TOKENS, OUTPUT_TOKENS)))
    finally:
        await service.store.close()
    ensure(recorded[0].name == "reserve", "the recorded call is the reserve")
    return Call.recorded(recorded, reservation.reservation_id), reservation.reserved_micros


def http_reserve_and_settle(client: httpx.Client, api_key: str) -> tuple[int, int]:
    """One reserve and settle through the service: the answers wrk's Lua relies on."""
    headers = reserve_headers(api_key)
    r = client.post(RESERVE_PATH, headers=headers, content=RESERVE_BODY)
    ensure(r.status_code == 201, f"reserve: {r.status_code} {r.text}")
    reserved = r.json()
    ensure(len(reserved["budgets"]) == len([x for xs in LIMITS_BY_SCOPE for x in xs]),
           "every leg of the path is held")
    ensure(f'"reservation_id":"{reserved["reservation_id"]}"' in r.text,
           "the id is where wrk's Lua pattern looks for it")
    s = client.post(f"{RESERVE_PATH}/{reserved['reservation_id']}/settle", headers=headers,
                    content=SETTLE_BODY)
    ensure(s.status_code == 200, f"settle: {s.status_code} {s.text}")
    return int(reserved["reserved_micros"]), int(s.json()["charged_micros"])


def set_up(service_url: str, env: dict[str, str], *,
           timeout_s: float = REQUEST_TIMEOUT_S) -> Setup:
    with httpx.Client(base_url=service_url, timeout=timeout_s) as client:
        api_key = create_budget_and_key(client)
        reserve, recorded_micros = asyncio.run(record_reserve(env, api_key))
        amount_micros, charged_micros = http_reserve_and_settle(client, api_key)
    ensure(amount_micros == recorded_micros,
           "the recorded call holds what the service holds for the same request")
    return Setup(api_key, reserve, amount_micros, charged_micros, reserves=2, settles=2)


def ensure_held(r: httpx.Response, setup: Setup, what: str) -> None:
    """A reserve answered with a hold of what the service holds: a refusal or an error must not
    pass for a fast answer."""
    ensure(r.status_code == 201, f"{what}: {r.status_code} {r.text}")
    ensure(int(r.json()["reserved_micros"]) == setup.amount_micros,
           f"{what} holds what the service holds")


def check_bare(bare_url: str, setup: Setup, *, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
    r = httpx.post(f"{bare_url}{RESERVE_PATH}", content=RESERVE_BODY, timeout=timeout_s)
    ensure_held(r, setup, "the bare endpoint")


# -- wrk runs -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WrkRun:
    """What one wrk run counted, and the CPU the server under test spent meanwhile."""

    connections: int
    requests: int
    elapsed_s: float
    p50_s: float
    p99_s: float
    reserves: int  # reserves answered, all 2xx (the cycle load counts them itself)
    settles: int
    server_cpu_s: float
    wrk_cpu_s: float  # the load generator's own CPU: it must stay far below the server's
    # Timed in Lua, one connection's cycle load only: each request alone, and reserve to settled.
    reserve_s: tuple[float, ...] = ()
    settle_s: tuple[float, ...] = ()
    cycle_s: tuple[float, ...] = ()

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.elapsed_s

    @property
    def cycles_per_s(self) -> float:
        return self.settles / self.elapsed_s

    @property
    def core_share(self) -> float:
        """The server's CPU over the run's wall time: 1.0 is one core busy throughout."""
        return self.server_cpu_s / self.elapsed_s

    @property
    def cpu_us_per_request(self) -> float:
        return self.server_cpu_s / self.requests * 1e6

    @property
    def cpu_us_per_cycle(self) -> float:
        return self.server_cpu_s / self.settles * 1e6


def run_wrk(script: Path, url: str, pid: int, connections: int, duration_s: int, *,
            cycle: bool) -> WrkRun:
    binary = shutil.which("wrk")
    if binary is None:
        raise RuntimeError("wrk is not installed (apt-get install wrk)")
    argv = [binary, "-t1", f"-c{connections}", f"-d{duration_s}s",
            f"--timeout={REQUEST_TIMEOUT_S}s", "-s", str(script), f"{url}{RESERVE_PATH}"]
    if cycle and connections == 1:
        argv += ["--", "timed"]
    cpu_before_s = server_cpu_s(pid)
    # Only wrk is reaped between the two readings, so the difference is its own CPU.
    wrk_before_s = children_cpu_s()
    # run() kills wrk if this process is interrupted while waiting for it.
    done = subprocess.run(argv, capture_output=True, timeout=duration_s + WRK_MARGIN_S,
                          check=False)
    cpu_s = server_cpu_s(pid) - cpu_before_s
    wrk_cpu_s = children_cpu_s() - wrk_before_s
    out = done.stdout.decode()
    lines = [line for line in out.splitlines() if line.startswith("BENCH ")]
    if done.returncode != 0 or len(lines) != 1:
        raise RuntimeError(f"wrk exited with {done.returncode}: {out}{done.stderr.decode()}")
    got = json.loads(lines[0].removeprefix("BENCH "))
    failed = got["socket_errors"] + got["status_errors"] + got["timeouts"] + got["others"]
    ensure(failed == 0, f"{script.stem}: every request answered 2xx: {got}")

    def seconds(name: str) -> tuple[float, ...]:
        return tuple(us / 1e6 for us in got[name])

    return WrkRun(
        connections, got["requests"], got["duration_us"] / 1e6, got["p50_us"] / 1e6,
        got["p99_us"] / 1e6, got["reserves"] if cycle else got["requests"], got["settles"],
        cpu_s, wrk_cpu_s, seconds("reserve_us"), seconds("settle_us"), seconds("cycle_us"),
    )


@dataclass(frozen=True)
class Round:
    reserve: WrkRun
    bare: WrkRun
    cycle: WrkRun

    @property
    def runs(self) -> tuple[WrkRun, WrkRun, WrkRun]:
        return self.reserve, self.bare, self.cycle

    @property
    def ratio(self) -> float:
        return self.reserve.requests_per_s / self.bare.requests_per_s

    @property
    def cycle_ratio(self) -> float:
        return self.cycle.cycles_per_s / self.bare.requests_per_s


@dataclass(frozen=True)
class Throughput:
    rounds: tuple[Round, ...]
    reserve_alone: WrkRun
    bare_alone: WrkRun
    cycle_alone: WrkRun
    checked: str  # what the ledger's counters said against every run, warm-up included


def quota_cleared(redis_url: str) -> None:
    """Forget the bench key's state quota (core/limits.py RECORDS_PER_KEY_PER_S_MAX): one key
    at wrk's thousands of reserves a second is past what an honest key makes, which this bench
    does not measure; each run starts the key's window anew."""
    import redis as redis_sync

    tag = BudgetId.parse(BUDGET_PATH).tag
    with redis_sync.Redis.from_url(redis_url) as client:
        quotas = list(client.scan_iter(match=keys.quota(tag, "*"), count=1_000))
        if quotas:
            client.delete(*quotas)


def measure_throughput(
    service: ServiceProcess, bare: Spawned, setup: Setup, options: argparse.Namespace,
    redis_url: str,
) -> Throughput:
    runs: list[WrkRun] = []
    with tempfile.TemporaryDirectory(prefix="sc-wrk-") as tmp:
        static = wrk_script(Path(tmp), "reserve", setup.api_key, cycle=False)
        cycle = wrk_script(Path(tmp), "cycle", setup.api_key, cycle=True)
        loads = {
            "reserve": (static, service.url, pid_of(service.process), False),
            "bare": (static, bare.url, pid_of(bare.process), False),
            "cycle": (cycle, service.url, pid_of(service.process), True),
        }

        def go(name: str, connections: int, seconds: int) -> WrkRun:
            script, url, pid, is_cycle = loads[name]
            quota_cleared(redis_url)
            run = run_wrk(script, url, pid, connections, seconds, cycle=is_cycle)
            runs.append(run)
            return run

        # Warm-up: connection pools filled, every code path run once, caches warm.
        for name in loads:
            go(name, options.connections, options.warmup_seconds)
        reserve_alone = go("reserve", 1, options.sequential_seconds)
        bare_alone = go("bare", 1, options.sequential_seconds)
        cycle_alone = go("cycle", 1, options.sequential_seconds)
        rounds: list[Round] = []
        names = list(loads)
        for i in range(options.rounds):
            # Each load goes first, second and third in turn, so a trend in the machine's load
            # favours none of them.
            order = names[i % 3:] + names[: i % 3]
            got = {name: go(name, options.connections, options.seconds) for name in order}
            rounds.append(Round(got["reserve"], got["bare"], got["cycle"]))
    checked = check_ledger(service, setup, runs)
    return Throughput(tuple(rounds), reserve_alone, bare_alone, cycle_alone, checked)


def check_ledger(service: ServiceProcess, setup: Setup, runs: Sequence[WrkRun]) -> str:
    """The key's total leg against what was counted: every counted answer is in the ledger.

    A reserve that wrk sent but had not seen answered when its run ended may still have been
    made, so the ledger may hold up to one request per connection per run more than counted.
    """
    r = httpx.get(f"{service.url}/v1/admin/budgets/{BUDGET_PATH}", headers=admin_headers(),
                  timeout=REQUEST_TIMEOUT_S)
    ensure(r.status_code == 200, f"GET budget: {r.status_code} {r.text}")
    total = next(p for p in r.json()["periods"] if p["period_key"] == "total")
    committed, held = int(total["committed_micros"]), int(total["reserved_micros"])
    ensure(committed % setup.charged_micros == 0, "the ledger committed whole settles")
    settles = committed // setup.charged_micros
    ensure(held % setup.amount_micros == 0, "the ledger holds whole reservations")
    reserves = held // setup.amount_micros + settles
    # The bare endpoint was checked with one reserve of its own.
    reserves_counted = setup.reserves + 1 + sum(x.reserves for x in runs)
    settles_counted = setup.settles + sum(x.settles for x in runs)
    in_flight_max = sum(x.connections for x in runs)
    ensure(reserves_counted <= reserves <= reserves_counted + in_flight_max,
           f"reserves in the ledger {reserves}, counted {reserves_counted} (+{in_flight_max})")
    ensure(settles_counted <= settles <= settles_counted + in_flight_max,
           f"settles in the ledger {settles}, counted {settles_counted} (+{in_flight_max})")
    return (f"the ledger holds {reserves:,} reserves and {settles:,} settles; wrk and set-up "
            f"counted {reserves_counted:,} and {settles_counted:,} answered (up to "
            f"{in_flight_max} more may be made by requests in flight when a run stopped)")


# -- cold start -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImportNode:
    name: str
    self_us: int
    cumulative_us: int
    children: tuple[ImportNode, ...]

    def walk(self) -> list[ImportNode]:
        return [self, *(n for c in self.children for n in c.walk())]


def parse_importtime(stderr: str) -> list[ImportNode]:
    """The import tree from `-X importtime`, which prints each module after its children, two
    spaces deeper per level."""
    pending: dict[int, list[ImportNode]] = {}
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, cumulative_us, name = line.removeprefix("import time:").split("|", 2)
        name = name[1:]  # the one space after the bar
        depth = (len(name) - len(name.lstrip(" "))) // 2
        node = ImportNode(name.strip(), int(self_us), int(cumulative_us),
                          tuple(pending.pop(depth + 1, [])))
        pending.setdefault(depth, []).append(node)
    return pending.get(0, [])


@dataclass(frozen=True)
class Probe:
    """One fresh process: wall time from spawn to exit, and the CPU it used (user + system).
    CPU time moves less than wall time when other processes compete for the cores."""

    wall_s: float
    cpu_s: float
    stderr: str


@dataclass(frozen=True)
class ColdStart:
    interpreter: tuple[Probe, ...]  # python -c pass
    fastapi: tuple[Probe, ...]
    index: tuple[Probe, ...]  # python -c "import api.index"
    index_in_process_s: tuple[float, ...]  # -X importtime's cumulative for api.index
    profile: ImportNode  # the -X importtime tree of the median run
    serve_ready_s: tuple[float, ...]
    platform_ready_s: tuple[float, ...]


def probe(argv: list[str]) -> Probe:
    # Only this child is reaped between the two readings, so the difference is its own CPU.
    cpu_before_s = children_cpu_s()
    started_s = time.perf_counter()
    done = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, timeout=SPAWN_TIMEOUT_S,
                          check=False)
    elapsed_s = time.perf_counter() - started_s
    cpu_s = children_cpu_s() - cpu_before_s
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited with {done.returncode}: "
                           f"{done.stderr.decode()[-2000:]}")
    return Probe(elapsed_s, cpu_s, done.stderr.decode())


def measure_cold_start(env: dict[str, str], options: argparse.Namespace) -> ColdStart:
    py = sys.executable
    # Compile the sources to .pyc first, as pip does for fastapi when it installs it, even where
    # the caller's environment says not to (PYTHONDONTWRITEBYTECODE): otherwise every probe of
    # api.index would compile its sources and `import fastapi` would not, an unequal comparison.
    subprocess.run([py, "-m", "compileall", "-q", "api", "core"], cwd=REPO_ROOT, check=True,
                   timeout=SPAWN_TIMEOUT_S)
    interpreter: list[Probe] = []
    fastapi: list[Probe] = []
    index: list[Probe] = []
    in_process: list[float] = []
    trees: list[ImportNode] = []
    serve: list[float] = []
    platform: list[float] = []
    # Interleaved, so the machine's load at any moment hits every figure alike.
    for _ in range(options.import_runs):
        interpreter.append(probe([py, "-c", "pass"]))
        fastapi.append(probe([py, "-c", "import fastapi"]))
        index.append(probe([py, "-c", "import api.index"]))
        if len(trees) < IMPORTTIME_RUNS:
            profiled = probe([py, "-X", "importtime", "-c", "import api.index"])
            tree = next(n for n in parse_importtime(profiled.stderr) if n.name == "api.index")
            in_process.append(tree.cumulative_us / 1e6)
            trees.append(tree)
    for _ in range(options.cold_start_runs):
        for argv, ready in ((serve_argv(), serve), (platform_argv(), platform)):
            with Spawned(argv, env) as spawned:
                ready.append(spawned.ready_s)
    profile = sorted(trees, key=lambda t: t.cumulative_us)[len(trees) // 2]
    return ColdStart(tuple(interpreter), tuple(fastapi), tuple(index), tuple(in_process), profile,
                     tuple(serve), tuple(platform))


# -- the report -----------------------------------------------------------------------------------


def throughput_report(t: Throughput, options: argparse.Namespace) -> list[str]:
    rounds = t.rounds
    ratio = median([r.ratio for r in rounds])
    verdict = "PASS" if ratio >= TARGET_RATIO else "FAIL"
    reserve_cpu_us = median([r.reserve.cpu_us_per_request for r in rounds])
    bare_cpu_us = median([r.bare.cpu_us_per_request for r in rounds])
    cycle_cpu_us = median([r.cycle.cpu_us_per_cycle for r in rounds])

    def row(label: str, rs: Sequence[Round]) -> list[str]:
        return [
            label,
            f"{median([r.reserve.requests_per_s for r in rs]):,.0f}",
            f"{median([r.bare.requests_per_s for r in rs]):,.0f}",
            f"{median([r.ratio for r in rs]):.3f}",
            f"{median([r.cycle.cycles_per_s for r in rs]):,.0f}",
            f"{median([r.cycle_ratio for r in rs]):.3f}",
            f"{median([r.reserve.cpu_us_per_request for r in rs]):,.0f}",
            f"{median([r.bare.cpu_us_per_request for r in rs]):,.0f}",
            f"{median([r.cycle.cpu_us_per_cycle for r in rs]):,.0f}",
        ]

    per_round = table(
        ["round", "reserve req/s", "bare req/s", "reserve/bare", "cycles/s", "cycles/bare",
         "reserve CPU us/req", "bare CPU us/req", "CPU us/cycle"],
        [row(str(i + 1), [r]) for i, r in enumerate(rounds)] + [row("median", rounds)],
    )
    ratios = [r.ratio for r in rounds]
    ratio_table = table(
        ["ratio", "value", "target", "check"],
        [
            ["service reserve req/s / bare req/s (median of rounds; min-max "
             f"{min(ratios):.3f}-{max(ratios):.3f})",
             f"{ratio:.3f}", f">= {TARGET_RATIO}", verdict],
            ["service reserve+settle cycles/s / bare req/s (median of rounds)",
             f"{median([r.cycle_ratio for r in rounds]):.3f}", "context", ""],
            ["bare CPU / service CPU per reserve (medians; server processes only)",
             f"{bare_cpu_us / reserve_cpu_us:.3f}", "context", ""],
            ["bare CPU per reserve / service CPU per cycle (medians)",
             f"{bare_cpu_us / cycle_cpu_us:.3f}", "context", ""],
        ],
    )
    c = options.connections

    def timed_row(label: str, values_s: Sequence[float]) -> list[str]:
        return [label, ms(percentile(values_s, 50)), ms(percentile(values_s, 99)),
                f"{len(values_s):,}"]

    latency = table(
        ["latency", "p50 ms", "p99 ms", "samples"],
        [
            ["service reserve, 1 connection (wrk)", ms(t.reserve_alone.p50_s),
             ms(t.reserve_alone.p99_s), f"{t.reserve_alone.requests:,}"],
            ["bare FCALL, 1 connection (wrk)", ms(t.bare_alone.p50_s), ms(t.bare_alone.p99_s),
             f"{t.bare_alone.requests:,}"],
            timed_row("service reserve, 1 connection, cycle load (Lua)", t.cycle_alone.reserve_s),
            timed_row("service settle, 1 connection, cycle load (Lua)", t.cycle_alone.settle_s),
            timed_row("service reserve + settle, 1 connection (Lua)", t.cycle_alone.cycle_s),
            [f"service reserve, {c} connections (median of rounds)",
             ms(median([r.reserve.p50_s for r in rounds])),
             ms(median([r.reserve.p99_s for r in rounds])),
             f"{sum(r.reserve.requests for r in rounds):,}"],
            [f"bare FCALL, {c} connections (median of rounds)",
             ms(median([r.bare.p50_s for r in rounds])),
             ms(median([r.bare.p99_s for r in rounds])),
             f"{sum(r.bare.requests for r in rounds):,}"],
            [f"cycle load, reserve and settle mixed, {c} connections",
             ms(median([r.cycle.p50_s for r in rounds])),
             ms(median([r.cycle.p99_s for r in rounds])),
             f"{sum(r.cycle.requests for r in rounds):,}"],
        ],
    )
    bare_share = median([r.bare.core_share for r in rounds])
    share = (f"server CPU over wall time under load (1.00 = one core busy throughout; less means "
             f"the server waited, with {c} requests queued, mostly for a core): reserve "
             f"{median([r.reserve.core_share for r in rounds]):.2f}, bare {bare_share:.2f}, "
             f"cycle {median([r.cycle.core_share for r in rounds]):.2f} (medians); wrk itself "
             f"{median([x.wrk_cpu_s / x.elapsed_s for r in rounds for x in r.runs]):.2f}")
    lines = [per_round, share, "", ratio_table]
    if bare_share < CORE_SHARE_BOUND:
        # Then requests/s is set by how soon the server, Redis and wrk each get a core back, not
        # by the work a request costs, and the ratio of rates flatters the costlier server.
        lines.append(
            f"note: the bare server used {bare_share:.2f} of a core, below "
            f"{CORE_SHARE_BOUND:.2f}: the rates were bounded in part by waiting for cores, not by "
            "the servers' own work. With a core to itself, a server's rate is bounded by its CPU "
            f"per request: bare/service CPU, {bare_cpu_us / reserve_cpu_us:.3f}, is the ratio "
            "that setting would approach.")
    return [*lines, "", latency, "", f"checked: {t.checked}",
            f"target: service reserve >= {TARGET_RATIO} x bare: {verdict} ({ratio:.3f})"]


def package_self_ms(tree: ImportNode) -> list[tuple[str, float]]:
    """Self time summed by top-level package: the parts add up to the whole import."""
    by_package: dict[str, int] = {}
    for node in tree.walk():
        top = node.name.split(".")[0]
        by_package[top] = by_package.get(top, 0) + node.self_us
    return sorted(((k, v / 1000) for k, v in by_package.items()), key=lambda kv: -kv[1])


def tree_lines(node: ImportNode, floor_us: float, depth: int, depth_max: int) -> list[str]:
    lines = [f"{node.cumulative_us / 1000:9.1f}  {'  ' * depth}{node.name}"]
    if depth < depth_max:
        for child in sorted(node.children, key=lambda c: -c.cumulative_us):
            if child.cumulative_us >= floor_us:
                lines += tree_lines(child, floor_us, depth + 1, depth_max)
    return lines


def cold_start_report(c: ColdStart) -> list[str]:
    index_ms = median([x.wall_s for x in c.index]) * 1000
    fastapi_ms = median([x.wall_s for x in c.fastapi]) * 1000
    import_ratio = index_ms / fastapi_ms
    verdict = "PASS" if import_ratio <= IMPORT_RATIO_MAX else "FAIL"

    def row(label: str, values_s: Sequence[float], cpu_s: Sequence[float] = ()) -> list[str]:
        return [label, ms(median(values_s)), ms(min(values_s)), ms(max(values_s)),
                ms(median(cpu_s)) if cpu_s else "", str(len(values_s))]

    def probes(label: str, xs: Sequence[Probe]) -> list[str]:
        return row(label, [x.wall_s for x in xs], [x.cpu_s for x in xs])

    times = table(
        ["fresh process", "median ms", "min ms", "max ms", "CPU ms", "runs"],
        [
            probes('python -c "import api.index" (interpreter included)', c.index),
            row("  api.index alone, in process (-X importtime cumulative)", c.index_in_process_s),
            probes('python -c "import fastapi"', c.fastapi),
            probes('python -c "pass" (the interpreter alone)', c.interpreter),
            row("ceiling serve: spawn to first /health/live 200", c.serve_ready_s),
            row("uvicorn api.index:app: spawn to first /health/live 200", c.platform_ready_s),
        ],
    )
    total_ms = c.profile.cumulative_us / 1000
    packages = table(
        ["package (self time, -X importtime)", "ms", "share"],
        [[name, f"{v:.1f}", f"{v / total_ms:.0%}"]
         for name, v in package_self_ms(c.profile)[:12]],
    )
    floor_us = 0.04 * c.profile.cumulative_us
    tree = "\n".join(tree_lines(c.profile, floor_us, 0, 4))
    return [
        times, "",
        f"where the median -X importtime run of api.index spent its {total_ms:.0f} ms:", "",
        packages, "",
        "import tree, cumulative ms, modules of at least 4% of api.index, 4 levels:", tree, "",
        f"target: import api.index in a fresh process <= {IMPORT_RATIO_MAX}x import fastapi: "
        f"{import_ratio:.2f}x, {verdict} ({index_ms:.0f} ms wall vs {fastapi_ms:.0f} ms, "
        f"{median([x.cpu_s for x in c.index]) * 1000:.0f} ms CPU; the "
        f"interpreter alone {median([x.wall_s for x in c.interpreter]) * 1000:.0f} ms wall)",
    ]


def report(t: Throughput, c: ColdStart, server: RedisServer, options: argparse.Namespace,
           load_before: float, elapsed_s: float) -> str:
    load_after = os.getloadavg()[0]
    return "\n".join([
        f"spend-ceiling HTTP benchmark: {os.cpu_count()} cores, 1-minute load {load_before:.2f} "
        f"before and {load_after:.2f} after; redis-server on 127.0.0.1:{server.port}, AOF "
        f"{'everysec (production)' if options.durable else 'off'}",
        f"load: wrk, 1 thread, {options.connections} keep-alive connections, {options.rounds} "
        f"rounds of reserve / bare / cycle ({options.seconds} s each, order rotated)",
        "service = `ceiling serve`, POST /v1/reservations (key check, pricing, reserve script) "
        f"with {RESERVE_BODY}; cycle = that, then POST .../settle with {SETTLE_BODY}",
        "bare = bench/bare_app.py, the same request bytes, one FCALL of the same reserve "
        "script with the service's recorded arguments; both one uvicorn worker, gc.freeze()",
        "",
        *throughput_report(t, options),
        "",
        *cold_start_report(c),
        "",
        f"ran in {elapsed_s:.0f} s",
    ])


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.http", description=__doc__.split("\n")[0])
    p.add_argument("--connections", type=int, default=CONNECTIONS,
                   help="wrk's concurrent connections (default %(default)s)")
    p.add_argument("--rounds", type=int, default=ROUNDS,
                   help="rounds of reserve / bare / cycle (default %(default)s)")
    p.add_argument("--seconds", type=int, default=PHASE_S,
                   help="whole seconds of each load in a round (default %(default)s)")
    p.add_argument("--warmup-seconds", type=int, default=WARMUP_S, help="default %(default)s")
    p.add_argument("--sequential-seconds", type=int, default=SEQUENTIAL_S,
                   help="the 1-connection latency loads (default %(default)s)")
    p.add_argument("--import-runs", type=int, default=IMPORT_RUNS,
                   help="fresh processes per import figure (default %(default)s)")
    p.add_argument("--cold-start-runs", type=int, default=COLD_START_RUNS,
                   help="spawns per time-to-first-answer figure (default %(default)s)")
    p.add_argument("--durable", action=argparse.BooleanOptionalAction, default=True,
                   help="redis-server with AOF everysec, as in production (default on)")
    options = p.parse_args(argv)
    if min(options.connections, options.rounds, options.seconds, options.warmup_seconds,
           options.sequential_seconds, options.import_runs, options.cold_start_runs) < 1:
        p.error("counts and durations must be at least 1")
    return options


def main(argv: Sequence[str] | None = None) -> int:
    options = parse(argv)
    if shutil.which("wrk") is None:
        print("bench.http needs wrk: apt-get install wrk", file=sys.stderr)
        return 1
    started_s = time.perf_counter()
    load_before = os.getloadavg()[0]
    # SIGTERM unwinds like Ctrl-C, through the same clean-up.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        with contextlib.ExitStack() as stack:
            # Every server is stopped by pid on the way out, whether the run ends, fails or is
            # interrupted, even while it starts (a context manager's __exit__ would not run if
            # its start were interrupted); wrk and the probes are children subprocess.run() reaps.
            server = RedisServer(durable=options.durable)
            stack.callback(server.__exit__, None, None, None)
            server.start()
            env = service_env(server.url)
            if not options.durable:  # --no-durable: measured without persistence, accepted
                env["CEILING_ACCEPT_NOT_DURABLE"] = "1"
            # Started as `ceiling serve` is, not forked: its CPU and heap are what is measured.
            service = ServiceProcess(env, forked=False)
            stack.callback(service.stop)
            service.start()
            setup = set_up(service.url, env)
            bare = Spawned(bare_argv(), bare_env(server.url, setup))
            stack.callback(bare.stop)
            bare.start()
            check_bare(bare.url, setup)
            throughput = measure_throughput(service, bare, setup, options, server.url)
            # The cold start is measured with neither server running, so it competes only with
            # the machine, not with this benchmark's own processes.
            bare.stop()
            service.stop()
            cold = measure_cold_start(env, options)
            print(report(throughput, cold, server, options, load_before,
                         time.perf_counter() - started_s))
    except KeyboardInterrupt:
        print("interrupted; every server stopped", file=sys.stderr)
        return 130  # the shell's code for a run ended by SIGINT
    return 0


if __name__ == "__main__":
    sys.exit(main())
