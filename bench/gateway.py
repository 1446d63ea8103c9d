"""Gateway overhead: the latency the gateway adds over calling the provider directly, and calls/s.

    .venv/bin/python -m bench.gateway            # about 45 s; --help for rounds and durations

One redis-server, the stub provider (its own process, answering at once) and one gateway
instance (ServiceProcess), all on loopback, started here and stopped by pid. Interleaved over
rounds, because the machine is shared and noisy:

  direct    POST /v1/chat/completions to the stub, one call at a time.
  relay     the same request through bench/relay_app.py, one call at a time: a bare FastAPI
            relay that forwards the body through httpx's pool and returns the answer (no key,
            no price, no ledger). What it adds is the floor under any gateway on this machine.
  gateway   the same request through the gateway, one call at a time: authenticate, price,
            reserve, forward, settle from the usage, answer with the x-ceiling-* headers.

Added latency is gateway (and relay) minus direct at p50 and p99 (of all rounds' calls, and the
median of the rounds' own differences beside it). Target: p50 under 2 ms; when the bare relay
alone adds more than that, the verdict says BLOCKED with its figure. Then calls per second through
the gateway from TASKS concurrent tasks, non-streaming and streaming, with the direct figure
beside them. The CPU the gateway process spent per call (from /proc, while it served one call at
a time) is printed too: on a shared machine it moves far less than any latency. Beside it, for
scale, the CPU of a direct call's two ends: the stub's server side and this process's client
side. A gateway is both a server and a client, so their sum is about what relaying costs before
any ledger work. At the end the ledger must hold exactly what the stub billed, and nothing open:
a loop that collected error answers cannot pass for a fast one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

from bench.common import Cycle, Phase, median, ms, percentile, run_phase, table
from core.errors import ensure
from infra.processes import stop, wait_ready
from infra.redis_server import RedisServer, free_port
from infra.service import ServiceProcess
from infra.stub_provider import fetch_bill

TARGET_ADDED_P50_S = 0.002
ROUNDS = 6
PHASE_S = 2.0
THROUGHPUT_S = 4.0
WARMUP_S = 1.0
TASKS = 16
# Gateway calls and direct calls name different models, so the stub bills them apart and the
# ledger can be checked against the gateway's part of the bill to the micro-dollar.
GATEWAY_MODEL = "gpt-4o-mini"
DIRECT_MODEL = "gpt-4.1-mini"
# Short answers: the benchmark measures the gateway, not the bytes of a long answer.
OUTPUT_TOKENS_MEAN = 20
BODY = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 64}
ADMIN_TOKEN = secrets.token_hex(16)
CEILING_MICROS = 10**12
START_TIMEOUT_S = 30.0


@contextlib.contextmanager
def served(argv: list[str], port: int, name: str) -> Iterator[tuple[str, int]]:
    """A server of this benchmark's, as a process of its own (so it does not share this one's
    interpreter), ready once /health/live answers: its URL and pid. Stopped by pid."""
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def live() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{url}/health/live", timeout=1.0).status_code == 200
        return False

    try:
        wait_ready(process, live, timeout_s=START_TIMEOUT_S, what=name)
        yield url, process.pid
    finally:
        stop(process)


def stub_process() -> contextlib.AbstractContextManager[tuple[str, int]]:
    port = free_port()
    return served(
        [sys.executable, "-m", "infra.stub_provider", "--port", str(port), "--seed", "1",
         "--latency-ms-min", "0", "--latency-ms-max", "0",
         "--output-tokens-mean", str(OUTPUT_TOKENS_MEAN)],
        port, "stub provider")


def relay_process(stub_url: str) -> contextlib.AbstractContextManager[tuple[str, int]]:
    port = free_port()
    return served([sys.executable, "-m", "bench.relay_app", "--port", str(port),
                   "--upstream", f"{stub_url}/v1"], port, "bare relay")


def chat_cycle(client: httpx.AsyncClient, url: str, headers: dict[str, str], model: str,
               stream: bool = False) -> Cycle:
    body = {**BODY, "model": model, "stream": stream}

    async def cycle() -> float:
        started_s = time.perf_counter()
        async with client.stream("POST", url, json=body, headers=headers) as response:
            await response.aread()
        ensure(response.status_code == 200, f"{url}: {response.status_code}")
        return time.perf_counter() - started_s

    return cycle


def process_cpu_s(pid: int) -> float:
    """User plus system CPU a process has used, from /proc/<pid>/stat (Linux)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Results:
    direct: tuple[Phase, ...]
    relayed: tuple[Phase, ...]
    through: tuple[Phase, ...]
    throughput: dict[str, Phase]
    gateway_cpu_s_per_call: float
    stub_cpu_s_per_call: float
    client_cpu_s_per_call: float

    @staticmethod
    def latencies(phases: tuple[Phase, ...]) -> tuple[float, ...]:
        return tuple(s for p in phases for s in p.latencies_s)

    def added_s(self, phases: tuple[Phase, ...], q: float) -> float:
        return percentile(self.latencies(phases), q) - percentile(self.latencies(self.direct), q)

    def added_by_round_s(self, phases: tuple[Phase, ...], q: float) -> float:
        return median([percentile(g.latencies_s, q) - percentile(d.latencies_s, q)
                       for d, g in zip(self.direct, phases, strict=True)])


async def measure(stub_url: str, stub_pid: int, relay_url: str, gateway: ServiceProcess,
                  gateway_pid: int, key: str, options: argparse.Namespace) -> Results:
    limits = httpx.Limits(max_connections=options.tasks, max_keepalive_connections=options.tasks)
    async with httpx.AsyncClient(timeout=30.0, limits=limits) as client:
        direct = chat_cycle(client, f"{stub_url}/v1/chat/completions", {}, DIRECT_MODEL)
        relayed = chat_cycle(client, f"{relay_url}/v1/chat/completions", {}, DIRECT_MODEL)
        auth = {"Authorization": f"Bearer {key}"}
        url = f"{gateway.url}/v1/chat/completions"
        through = chat_cycle(client, url, auth, GATEWAY_MODEL)
        through_stream = chat_cycle(client, url, auth, GATEWAY_MODEL, stream=True)
        for cycle in (direct, relayed, through, through_stream):
            await run_phase(cycle, options.tasks, options.warmup_seconds)
        phases: dict[Cycle, list[Phase]] = {direct: [], relayed: [], through: []}
        gateway_cpu_s = stub_cpu_s = client_cpu_s = 0.0
        for i in range(options.rounds):
            # Rotate who goes first, so a trend in the machine's load favours none of them.
            order = list(phases)[i % 3:] + list(phases)[:i % 3]
            for cycle in order:
                cpu_started_s = process_cpu_s(gateway_pid)
                stub_started_s, client_started_s = process_cpu_s(stub_pid), time.process_time()
                phase = await run_phase(cycle, 1, options.seconds)
                phases[cycle].append(phase)
                if cycle is direct:
                    stub_cpu_s += process_cpu_s(stub_pid) - stub_started_s
                    client_cpu_s += time.process_time() - client_started_s
                elif cycle is through:
                    gateway_cpu_s += process_cpu_s(gateway_pid) - cpu_started_s
        throughput = {
            "direct": await run_phase(direct, options.tasks, options.throughput_seconds),
            "gateway": await run_phase(through, options.tasks, options.throughput_seconds),
            "gateway, streaming": await run_phase(
                through_stream, options.tasks, options.throughput_seconds),
        }
    calls = sum(p.cycles for p in phases[through])
    direct_calls = sum(p.cycles for p in phases[direct])
    return Results(tuple(phases[direct]), tuple(phases[relayed]), tuple(phases[through]),
                   throughput, gateway_cpu_s / calls, stub_cpu_s / direct_calls,
                   client_cpu_s / direct_calls)


def report(results: Results, options: argparse.Namespace) -> str:
    rows = []
    for name, phases in (("direct", results.direct), ("bare relay", results.relayed),
                         ("gateway", results.through)):
        latencies = Results.latencies(phases)
        rows.append([name, str(len(latencies)), ms(percentile(latencies, 50)),
                     ms(percentile(latencies, 99))])
    for name, phases in (("bare relay", results.relayed), ("gateway", results.through)):
        rows.append([f"{name} added (all calls)", "", ms(results.added_s(phases, 50)),
                     ms(results.added_s(phases, 99))])
        rows.append([f"{name} added (median of rounds)", "",
                     ms(results.added_by_round_s(phases, 50)),
                     ms(results.added_by_round_s(phases, 99))])
    latency = table(["one call at a time", "calls", "p50 ms", "p99 ms"], rows)
    load = table(
        [f"{options.tasks} tasks", "calls/s", "p50 ms", "p99 ms"],
        [[name, f"{p.cycles_per_s:.0f}", ms(percentile(p.latencies_s, 50)),
          ms(percentile(p.latencies_s, 99))] for name, p in results.throughput.items()],
    )
    added_p50_s = results.added_s(results.through, 50)
    relay_p50_s = results.added_s(results.relayed, 50)
    verdict = "PASS" if added_p50_s < TARGET_ADDED_P50_S else "FAIL"
    if verdict == "FAIL" and relay_p50_s >= TARGET_ADDED_P50_S:
        verdict = (f"BLOCKED (a bare relay alone adds {ms(relay_p50_s)} ms: one more server and "
                   "client in the path cost more than the target on this machine)")
    return (f"{latency}\n\ngateway process CPU per call: {ms(results.gateway_cpu_s_per_call)} ms"
            f"\nfor scale, a direct call's CPU: stub {ms(results.stub_cpu_s_per_call)} ms (its "
            f"server side), this process {ms(results.client_cpu_s_per_call)} ms (its client side)"
            f"\n\n{load}\n\n{verdict}: p50 added latency {ms(added_p50_s)} ms "
            f"(target < {ms(TARGET_ADDED_P50_S)} ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--seconds", type=float, default=PHASE_S, help="per latency phase")
    parser.add_argument("--throughput-seconds", type=float, default=THROUGHPUT_S)
    parser.add_argument("--warmup-seconds", type=float, default=WARMUP_S)
    parser.add_argument("--tasks", type=int, default=TASKS)
    options = parser.parse_args()
    tag = f"org:bench{uuid.uuid4().hex[:8]}"
    with RedisServer(durable=True) as redis, stub_process() as (stub_url, stub_pid), \
            relay_process(stub_url) as (relay_url, _), \
            ServiceProcess({"REDIS_URL": redis.url, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN,
                            "CEILING_UPSTREAM_URL": f"{stub_url}/v1"}) as gateway:
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        httpx.put(f"{gateway.url}/v1/admin/budgets/{tag}", headers=admin, json={
            "limits": [{"period": "total", "ceiling_micros": CEILING_MICROS}]}).raise_for_status()
        created = httpx.post(f"{gateway.url}/v1/admin/keys", headers=admin,
                             json={"budget_id": tag})
        created.raise_for_status()
        assert gateway.process is not None  # started by the with statement
        results = asyncio.run(measure(stub_url, stub_pid, relay_url, gateway,
                                      gateway.process.pid, created.json()["api_key"], options))
        budget = httpx.get(f"{gateway.url}/v1/admin/budgets/{tag}", headers=admin).json()
        period = budget["periods"][0]
        bill = fetch_bill(stub_url).by_model[GATEWAY_MODEL]
        ensure(period["reserved_micros"] == 0, "every gateway call was settled")
        ensure(period["committed_micros"] == bill.cost_micros,
               f"the ledger holds {period['committed_micros']}, the stub billed "
               f"{bill.cost_micros}")
    print(report(results, options))
    print(f"\nledger: {bill.calls} gateway calls, committed {period['committed_micros']} "
          f"micro-dollars = the stub's bill for them; nothing held")


if __name__ == "__main__":
    main()
