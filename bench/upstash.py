"""The cost of the Upstash REST path: UpstashStore beside RedisStore, and the SDK beside httpx.

    .venv/bin/python -m bench.upstash           # about 40 s; --help for rounds and durations

One redis-server and one Upstash REST bridge in front of it (infra/upstash_bridge.py), both on
free loopback ports and stopped by pid, serve two comparisons, interleaved over rounds because
the machine is shared and noisy:

  stores   RedisStore and UpstashStore, each reserving then settling (one decision) in 1 task
           and in --tasks tasks, on the same Redis: what a decision costs over REST.
  clients  the same EVALSHA of the reserve script (the words ScriptedStore builds, recorded, a
           fresh reservation id per call) sent through the upstash-redis SDK and as a plain
           httpx POST to the bridge: what the SDK itself adds. The plain POST parses the JSON
           and checks the reply but does not base64-decode it; the SDK does.

Against the bridge, not Upstash: loopback has no network latency, and the bridge is one Python
process, so absolute figures say little about Upstash; the ratios measured in one run are the
point. The ledger's counters are checked at the end, so errors cannot pass for speed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
from upstash_redis.asyncio import Redis as UpstashRedis

from bench.common import Cycle, Phase, run_phase
from bench.ledger import (
    ACTUAL_MICROS,
    ESTIMATE_MICROS,
    Call,
    legs_by_window,
    put_budgets,
    record_calls,
    reserve_request,
)
from core.budgets import BudgetId
from core.errors import InvariantBroken, ensure
from core.ledger import LedgerStore
from core.stores.redis import RedisStore
from core.stores.upstash import UpstashStore, upstash_client
from infra.figures import median, ms, percentile, table
from infra.redis_server import RedisServer
from infra.upstash_bridge import UpstashBridge

# Fewer tasks than bench/ledger.py: the bridge is one Python process and saturates early, and
# past that point more tasks only measure its queue.
TASKS = 16
ROUNDS = 2
PHASE_S = 3.0
WARMUP_S = 1.0
SEQUENTIAL_S = 1.5
# A run that takes this much longer than its phases add up to is stuck, not slow.
RUN_SLACK_S = 120.0
# One call's bound here, in place of the production UPSTASH_CALL_TIMEOUT_S: on a shared machine
# the bridge (one Python process) has a tail of seconds that Upstash does not, and a call that
# timed out would leave the ledger's counters, which the run checks, unknown. The tail shows in
# p99 instead.
CALL_TIMEOUT_S = 30.0

REDIS_PATH = "org:benchredis/team:search/key:k1"
UPSTASH_PATH = "org:benchupstash/team:search/key:k1"
# The client comparison only reserves; its open leases pile up in a tag of their own.
CLIENTS_PATH = "org:benchclients/team:search/key:k1"
# base64 of the reserve script's 'ok': a plain POST that reads this was admitted.
OK_BASE64 = "b2s="


def decision_cycle(store: LedgerStore, budget_ids: tuple[BudgetId, ...]) -> Cycle:
    """Reserve then settle; the latency is of both, the two round trips a decision costs."""
    tag = budget_ids[0].tag

    async def cycle() -> float:
        request = reserve_request(tag, budget_ids)
        started_s = time.perf_counter()
        await store.reserve(request)
        await store.settle(request.ref, ACTUAL_MICROS)
        return time.perf_counter() - started_s

    return cycle


def evalsha(reserve: Call) -> list[str]:
    """The recorded reserve, for a reservation id of its own."""
    return ["EVALSHA", reserve.script.sha1, str(reserve.key_count),
            *reserve.words_for(uuid.uuid4().hex)]


def sdk_cycle(client: UpstashRedis, reserve: Call) -> Cycle:
    async def cycle() -> float:
        command = evalsha(reserve)
        started_s = time.perf_counter()
        async with asyncio.timeout(CALL_TIMEOUT_S):
            reply = await client.execute(command)
        latency_s = time.perf_counter() - started_s
        if not isinstance(reply, list) or reply[0] != "ok":
            raise InvariantBroken(f"the SDK loop was refused: {reply!r}")
        return latency_s

    return cycle


def httpx_cycle(bridge: UpstashBridge, reserve: Call, client: httpx.AsyncClient) -> Cycle:
    # The headers the SDK sends, so the bridge does the same work for both.
    headers = {"Authorization": f"Bearer {bridge.token}", "Upstash-Encoding": "base64"}

    async def cycle() -> float:
        command = evalsha(reserve)
        started_s = time.perf_counter()
        try:
            response = await client.post(bridge.url, json=command, headers=headers)
        except httpx.TransportError:
            # A keep-alive connection the bridge closed while idle (uvicorn does after 5 s, as
            # between phases) fails the first request sent on it. The SDK replays after any
            # exception; the plain loop replays once too, or it could not run past a pause.
            response = await client.post(bridge.url, json=command, headers=headers)
        result = response.json()["result"]
        latency_s = time.perf_counter() - started_s
        if result[0] != OK_BASE64:
            raise InvariantBroken(f"the httpx loop was refused: {result[0]}")
        return latency_s

    return cycle


@dataclass(frozen=True)
class Measured:
    """One loop's phases, alone (1 task) and under load (--tasks tasks, one phase per round),
    with the CPU this process spent in each: the client's side, since both servers run apart."""

    alone: Phase
    alone_cpu_s: float
    loaded: tuple[Phase, ...]
    loaded_cpu_s: float

    @property
    def loaded_per_s(self) -> float:
        return median([p.cycles_per_s for p in self.loaded])

    @property
    def loaded_latencies_s(self) -> list[float]:
        return [s for p in self.loaded for s in p.latencies_s]

    @property
    def alone_cpu_us(self) -> float:
        return self.alone_cpu_s / self.alone.cycles * 1e6

    @property
    def loaded_cpu_us(self) -> float:
        return self.loaded_cpu_s / sum(p.cycles for p in self.loaded) * 1e6

    @property
    def cycles(self) -> int:
        return self.alone.cycles + sum(p.cycles for p in self.loaded)


async def phase_and_cpu(cycle: Cycle, tasks: int, seconds: float) -> tuple[Phase, float]:
    started_cpu_s = time.process_time()
    phase = await run_phase(cycle, tasks, seconds)
    return phase, time.process_time() - started_cpu_s


async def measure_loops(
    loops: dict[str, Cycle], options: argparse.Namespace
) -> tuple[dict[str, Measured], dict[str, int]]:
    """Warm-up, then 1 task each, then rounds of --tasks tasks, who goes first alternating so
    that a trend in the machine's load favours none. Returns the phases and every cycle run."""
    names = list(loops)
    warmup = {
        name: (await run_phase(loops[name], options.tasks, options.warmup_seconds)).cycles
        for name in names
    }
    alone = {
        name: await phase_and_cpu(loops[name], 1, options.sequential_seconds) for name in names
    }
    loaded: dict[str, list[Phase]] = {name: [] for name in names}
    loaded_cpu_s = dict.fromkeys(names, 0.0)
    for i in range(options.rounds):
        for name in names if i % 2 == 0 else reversed(names):
            phase, cpu_s = await phase_and_cpu(loops[name], options.tasks, options.seconds)
            loaded[name].append(phase)
            loaded_cpu_s[name] += cpu_s
    measured = {
        name: Measured(*alone[name], tuple(loaded[name]), loaded_cpu_s[name]) for name in names
    }
    return measured, {name: warmup[name] + measured[name].cycles for name in names}


async def check_settled(store: LedgerStore, budget_ids: tuple[BudgetId, ...], cycles: int) -> None:
    for (budget_id, window_key), (committed, reserved) in (
        await legs_by_window(store, budget_ids)
    ).items():
        if window_key == "total":
            ensure(reserved == 0, f"{budget_id}: every reservation was settled")
            ensure(committed == cycles * ACTUAL_MICROS,
                   f"{budget_id}: committed {committed} != {cycles} cycles x actual")


@dataclass(frozen=True)
class Results:
    stores: dict[str, Measured]
    clients: dict[str, Measured]
    decisions_checked: int
    reserves_checked: int


async def measure(
    server: RedisServer, bridge: UpstashBridge, options: argparse.Namespace
) -> Results:
    redis_store = RedisStore(server.url)
    upstash_store = UpstashStore(bridge.url, bridge.token, call_timeout_s=CALL_TIMEOUT_S)
    # Built as UpstashStore builds its own: same retries, same headers.
    sdk = upstash_client(bridge.url, bridge.token)
    plain = httpx.AsyncClient(timeout=CALL_TIMEOUT_S)
    try:
        redis_ids = await put_budgets(redis_store, REDIS_PATH)
        upstash_ids = await put_budgets(redis_store, UPSTASH_PATH)
        clients_ids = await put_budgets(redis_store, CLIENTS_PATH)
        # ScriptedStore builds the same words whatever carries them; the recorded reserve (and
        # its settle) count as one more reserve in the clients' tag.
        reserve, _ = await record_calls(server.url, clients_ids)
        stores, store_cycles = await measure_loops(
            {"RedisStore": decision_cycle(redis_store, redis_ids),
             "UpstashStore": decision_cycle(upstash_store, upstash_ids)},
            options,
        )
        clients, client_cycles = await measure_loops(
            {"plain httpx POST": httpx_cycle(bridge, reserve, plain),
             "upstash-redis SDK": sdk_cycle(sdk, reserve)},
            options,
        )
        await check_settled(redis_store, redis_ids, store_cycles["RedisStore"])
        await check_settled(redis_store, upstash_ids, store_cycles["UpstashStore"])
        reserves = sum(client_cycles.values())
        key_total = (clients_ids[-1].path, "total")
        committed, reserved = (await legs_by_window(redis_store, clients_ids))[key_total]
        ensure(
            (committed, reserved) == (ACTUAL_MICROS, reserves * ESTIMATE_MICROS),
            f"the clients' tag holds {reserved} micros for {reserves} reserves",
        )
    finally:
        await redis_store.close()
        await upstash_store.close()
        await sdk.close()
        await plain.aclose()
    return Results(stores, clients, sum(store_cycles.values()), reserves)


def rows(measured: dict[str, Measured], tasks: int) -> list[list[str]]:
    out = []
    for name, m in measured.items():
        out.append([f"{name}, 1 task", f"{m.alone.cycles_per_s:,.0f}",
                    ms(percentile(m.alone.latencies_s, 50)),
                    ms(percentile(m.alone.latencies_s, 99)), f"{m.alone_cpu_us:,.0f}",
                    f"{len(m.alone.latencies_s):,}"])
    for name, m in measured.items():
        out.append([f"{name}, {tasks} tasks", f"{m.loaded_per_s:,.0f}",
                    ms(percentile(m.loaded_latencies_s, 50)),
                    ms(percentile(m.loaded_latencies_s, 99)), f"{m.loaded_cpu_us:,.0f}",
                    f"{len(m.loaded_latencies_s):,}"])
    return out


def ratios(measured: dict[str, Measured], tasks: int) -> list[list[str]]:
    """The second loop against the first, the baseline: throughput as first/second and latency
    as second/first, so each reads as how many times the second costs what the first does."""
    (first, a), (second, b) = measured.items()
    faster, slower = f"{first} / {second}", f"{second} / {first}"

    def latency(q: float, a_s: Sequence[float], b_s: Sequence[float]) -> str:
        return f"{percentile(b_s, q) / percentile(a_s, q):.2f}"

    return [
        [f"{faster}, per second, 1 task", f"{a.alone.cycles_per_s / b.alone.cycles_per_s:.2f}"],
        [f"{faster}, per second, {tasks} tasks", f"{a.loaded_per_s / b.loaded_per_s:.2f}"],
        [f"{slower}, p50, 1 task", latency(50, a.alone.latencies_s, b.alone.latencies_s)],
        [f"{slower}, p99, 1 task", latency(99, a.alone.latencies_s, b.alone.latencies_s)],
        [f"{slower}, p50, {tasks} tasks",
         latency(50, a.loaded_latencies_s, b.loaded_latencies_s)],
        [f"{slower}, p99, {tasks} tasks",
         latency(99, a.loaded_latencies_s, b.loaded_latencies_s)],
        [f"{slower}, client CPU per call, 1 task", f"{b.alone_cpu_us / a.alone_cpu_us:.2f}"],
        [f"{slower}, client CPU per call, {tasks} tasks",
         f"{b.loaded_cpu_us / a.loaded_cpu_us:.2f}"],
    ]


def report(results: Results, server: RedisServer, options: argparse.Namespace) -> str:
    load_1m, _, _ = os.getloadavg()
    header = ["", "per second", "p50 ms", "p99 ms", "client CPU us/call", "samples"]
    return "\n".join([
        f"spend-ceiling Upstash benchmark: redis-server on 127.0.0.1:{server.port}, the Upstash "
        f"REST bridge in front of it; {os.cpu_count()} cores, load {load_1m:.2f}",
        f"{options.tasks} tasks, {options.rounds} rounds of {options.seconds:g} s per loop, "
        f"1 task for {options.sequential_seconds:g} s; reserve {ESTIMATE_MICROS} micros in 4 "
        f"legs, settle {ACTUAL_MICROS}",
        "",
        "decisions (reserve + settle) through the store, same Redis behind both",
        table(header, rows(results.stores, options.tasks)),
        "",
        table(["ratio, this run", "value"], ratios(results.stores, options.tasks)),
        "",
        "one EVALSHA of the reserve script to the bridge",
        table(header, rows(results.clients, options.tasks)),
        "",
        table(["ratio, this run", "value"], ratios(results.clients, options.tasks)),
        "",
        f"checked: {results.decisions_checked:,} decisions committed exactly {ACTUAL_MICROS} "
        f"micros each; {results.reserves_checked:,} client reserves held exactly "
        f"{ESTIMATE_MICROS} each",
    ])


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.upstash", description=__doc__.split("\n")[0])
    p.add_argument("--tasks", type=int, default=TASKS, help="default %(default)s")
    p.add_argument("--rounds", type=int, default=ROUNDS, help="default %(default)s")
    p.add_argument("--seconds", type=float, default=PHASE_S,
                   help="each loaded phase (default %(default)s)")
    p.add_argument("--warmup-seconds", type=float, default=WARMUP_S, help="default %(default)s")
    p.add_argument("--sequential-seconds", type=float, default=SEQUENTIAL_S,
                   help="the one-task latency phases (default %(default)s)")
    options = p.parse_args(argv)
    if options.tasks < 1 or options.rounds < 1 or options.seconds <= 0:
        p.error("--tasks and --rounds must be at least 1, --seconds above 0")
    return options


async def bounded(
    server: RedisServer, bridge: UpstashBridge, options: argparse.Namespace
) -> Results:
    phases_s = 2 * 2 * (
        options.warmup_seconds + options.sequential_seconds + options.rounds * options.seconds
    )
    async with asyncio.timeout(phases_s + RUN_SLACK_S):
        return await measure(server, bridge, options)


def main(argv: Sequence[str] | None = None) -> int:
    options = parse(argv)
    # Both servers are stopped by pid on the way out, whether the run ends, fails or is
    # interrupted.
    with RedisServer() as server, UpstashBridge(server.url) as bridge:
        results = asyncio.run(bounded(server, bridge, options))
        print(report(results, server, options))
    return 0


if __name__ == "__main__":
    sys.exit(main())
