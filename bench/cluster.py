"""Cluster scaling: reserve+settle cycles per second on a 3-master Redis Cluster against one Redis.

    .venv/bin/python -m bench.cluster            # about 40 s; --help for load and durations

One run starts both ledgers on free loopback ports and stops them by pid on the way out: one
redis-server, and a cluster of 3 masters with one replica each, every node with AOF everysec as
in production. The same client load drives each in turn, interleaved over rounds because the
machine is shared and noisy: `processes` OS processes, each with `tasks` asyncio tasks running
RedisStore / RedisClusterStore reserve then settle, turn by turn over `orgs` orgs. Each org is a
tag of its own, so on the cluster their calls spread over the three masters.

Printed: cycles/s of each, the scaling ratio cluster / single of this run, and the CPU every
party spent per cycle (client processes, masters, replicas), which is what bounds the ratio on a
machine with few cores. The ledgers' counters are checked at the end: every cycle committed
exactly its actual cost, and nothing is left reserved.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial
from multiprocessing import get_context

from bench.common import Phase, run_phase
from bench.ledger import ACTUAL_MICROS, put_budgets, reserve_request
from core.budgets import BudgetId
from core.errors import InvariantBroken, ensure
from core.ledger import LedgerStore
from core.stores.redis import RedisStore
from core.stores.redis_cluster import RedisClusterStore
from infra.figures import median, ms, percentile, table
from infra.redis_cluster import LocalCluster
from infra.redis_server import RedisServer

# One client process per core: together they can keep the machine busy without the servers.
PROCESSES = 2
TASKS = 16
ORGS = 120
ROUNDS = 3
PHASE_S = 3.0
WARMUP_S = 1.0
# The client processes start a phase together, this long after the parent hands it out: enough
# to connect; the first phase also pays for spawning the processes and importing the code.
START_DELAY_S = 0.5
FIRST_START_DELAY_S = 5.0
# A phase that has not reported back after this long beyond its own length is stuck.
PHASE_GRACE_S = 30.0
CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")

StoreBuilder = Callable[[], LedgerStore]


def org_path(i: int) -> str:
    return f"org:bench{i}/team:search/key:k1"


# -- one client process ------------------------------------------------------------------------


def client_phase(
    build: StoreBuilder, orgs: int, tasks: int, seconds: float, start_at: float
) -> Phase:
    """One client process's share of a phase (run in a process of the pool)."""
    return asyncio.run(_client_phase(build, orgs, tasks, seconds, start_at))


async def _client_phase(
    build: StoreBuilder, orgs: int, tasks: int, seconds: float, start_at: float
) -> Phase:
    store = build()
    await store.open()
    lineages = [BudgetId(org_path(i)).lineage for i in range(orgs)]
    # Each process starts at another org, so processes do not walk the orgs in step.
    turn = itertools.count(os.getpid())

    async def cycle() -> float:
        budget_ids = lineages[next(turn) % orgs]
        request = reserve_request(budget_ids[0].tag, budget_ids)
        started_s = time.perf_counter()
        await store.reserve(request)
        latency_s = time.perf_counter() - started_s
        await store.settle(request.ref, ACTUAL_MICROS)
        return latency_s

    try:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        return await run_phase(cycle, tasks, seconds)
    finally:
        await store.close()


# -- the ledgers -------------------------------------------------------------------------------


def server_cpu_s(pids: Sequence[int]) -> float:
    """User + system CPU the processes have used so far, from /proc."""
    total_ticks = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            # The command name (field 2) is in parentheses and may hold spaces: split after it.
            fields = f.read().rsplit(")", 1)[1].split()
        total_ticks += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15
    return total_ticks / CLOCK_TICKS_PER_S


def pid_of(node: RedisServer) -> int:
    if node.process is None:
        raise InvariantBroken(f"the server on port {node.port} is not running")
    return node.process.pid


@dataclass(frozen=True)
class Ledger:
    name: str
    build: StoreBuilder
    # Server processes whose CPU is reported, by role ("master", "replica").
    pids_by_role: dict[str, tuple[int, ...]]


@dataclass(frozen=True)
class Run:
    """One phase of the whole client load against one ledger."""

    phases: tuple[Phase, ...]  # one per client process
    server_cpu_s_by_role: dict[str, float]

    @property
    def cycles(self) -> int:
        return sum(p.cycles for p in self.phases)

    @property
    def cycles_per_s(self) -> float:
        return self.cycles / max(p.elapsed_s for p in self.phases)

    def cpu_us_per_cycle(self, role: str) -> float:
        if role == "client":
            return sum(p.cpu_s for p in self.phases) / self.cycles * 1e6
        return self.server_cpu_s_by_role[role] / self.cycles * 1e6

    @property
    def cpu_us_per_cycle_all(self) -> float:
        roles = ("client", *self.server_cpu_s_by_role)
        return sum(self.cpu_us_per_cycle(role) for role in roles)

    @property
    def latencies_s(self) -> list[float]:
        return [s for p in self.phases for s in p.latencies_s]


async def drive(
    pool: ProcessPoolExecutor, ledger: Ledger, options: argparse.Namespace, seconds: float,
    start_delay_s: float,
) -> Run:
    start_at = time.time() + start_delay_s
    before = {role: server_cpu_s(pids) for role, pids in ledger.pids_by_role.items()}
    futures = [
        asyncio.wrap_future(pool.submit(
            client_phase, ledger.build, options.orgs, options.tasks, seconds, start_at
        ))
        for _ in range(options.processes)
    ]
    async with asyncio.timeout(start_delay_s + seconds + PHASE_GRACE_S):
        phases = await asyncio.gather(*futures)
    after = {role: server_cpu_s(pids) for role, pids in ledger.pids_by_role.items()}
    return Run(tuple(phases), {role: after[role] - before[role] for role in before})


async def check_counters(ledger: Ledger, orgs: int, cycles: int) -> None:
    """Every cycle settled: nothing is held, and the orgs committed exactly cycles x actual."""
    store = ledger.build()
    committed_micros = 0
    try:
        for i in range(orgs):
            org = BudgetId(org_path(i)).lineage[0]
            for leg in await store.status((org,)):
                ensure(leg.reserved_micros == 0, f"{ledger.name} {org}: every cycle settled")
                if leg.window_key == "total":
                    committed_micros += leg.committed_micros
    finally:
        await store.close()
    ensure(
        committed_micros == cycles * ACTUAL_MICROS,
        f"{ledger.name}: committed {committed_micros} != {cycles} cycles x {ACTUAL_MICROS}",
    )


@dataclass(frozen=True)
class Round:
    single: Run
    cluster: Run

    @property
    def ratio(self) -> float:
        return self.cluster.cycles_per_s / self.single.cycles_per_s


async def measure(
    server: RedisServer, cluster: LocalCluster, options: argparse.Namespace
) -> tuple[Round, ...]:
    masters = cluster.masters()
    replicas = [r for m in masters for r in cluster.replicas_of(m)]
    ledgers = (
        Ledger("single", partial(RedisStore, server.url), {"master": (pid_of(server),)}),
        Ledger(
            "cluster",
            partial(RedisClusterStore, cluster.url),
            {
                "master": tuple(pid_of(n) for n in masters),
                "replica": tuple(pid_of(n) for n in replicas),
            },
        ),
    )
    for ledger in ledgers:
        store = ledger.build()
        try:
            for i in range(options.orgs):
                await put_budgets(store, org_path(i))
        finally:
            await store.close()

    cycles = {ledger.name: 0 for ledger in ledgers}
    rounds = []
    with ProcessPoolExecutor(options.processes, mp_context=get_context("spawn")) as pool:
        # Warm-up: spawns the processes, fills the connection pools and the interpreters' caches.
        for n, ledger in enumerate(ledgers):
            delay_s = FIRST_START_DELAY_S if n == 0 else START_DELAY_S
            warm = await drive(pool, ledger, options, options.warmup_seconds, delay_s)
            cycles[ledger.name] += warm.cycles
        for i in range(options.rounds):
            # Alternate who goes first, so a trend in the machine's load favours neither.
            runs: dict[str, Run] = {}
            for ledger in ledgers if i % 2 == 0 else ledgers[::-1]:
                runs[ledger.name] = await drive(
                    pool, ledger, options, options.seconds, START_DELAY_S
                )
                cycles[ledger.name] += runs[ledger.name].cycles
            rounds.append(Round(runs["single"], runs["cluster"]))
    for ledger in ledgers:
        await check_counters(ledger, options.orgs, cycles[ledger.name])
    return tuple(rounds)


# -- the report --------------------------------------------------------------------------------


def report(rounds: Sequence[Round], options: argparse.Namespace) -> str:
    def cpu(run: Run, role: str) -> str:
        return f"{run.cpu_us_per_cycle(role):,.0f}"

    per_round = table(
        ["round", "single cycles/s", "cluster cycles/s", "cluster/single",
         "single CPU us/cycle: client, server", "cluster: client, masters, replicas"],
        [
            [str(i + 1), f"{r.single.cycles_per_s:,.0f}", f"{r.cluster.cycles_per_s:,.0f}",
             f"{r.ratio:.3f}",
             f"{cpu(r.single, 'client')}, {cpu(r.single, 'master')}",
             f"{cpu(r.cluster, 'client')}, {cpu(r.cluster, 'master')}, "
             f"{cpu(r.cluster, 'replica')}"]
            for i, r in enumerate(rounds)
        ],
    )
    ratio = median([r.ratio for r in rounds])
    cores = os.cpu_count() or 1
    # Every cycle needs this much CPU on some core; with all of them busy, no ledger goes faster.
    cpu_rows = []
    for name, runs in (("single", [r.single for r in rounds]),
                       ("cluster", [r.cluster for r in rounds])):
        total_us = median([run.cpu_us_per_cycle_all for run in runs])
        client_us = median([run.cpu_us_per_cycle("client") for run in runs])
        cpu_rows.append([name, f"{total_us:,.0f}", f"{client_us / total_us:.0%}",
                         f"{cores * 1e6 / total_us:,.0f}"])
    cpu_bound = table(
        ["CPU per cycle, all parties (median)", "us", "client share",
         "cycles/s if every core did only this"],
        cpu_rows,
    )
    latency = table(
        ["one reserve under load", "p50 ms", "p99 ms", "samples"],
        [
            [name, ms(percentile(samples, 50)), ms(percentile(samples, 99)), f"{len(samples):,}"]
            for name, samples in (
                ("single", [s for r in rounds for s in r.single.latencies_s]),
                ("cluster", [s for r in rounds for s in r.cluster.latencies_s]),
            )
        ],
    )
    load_1m, _, _ = os.getloadavg()
    return "\n".join([
        "spend-ceiling cluster benchmark: one redis-server against a Redis Cluster of 3 masters "
        "+ 3 replicas, all on 127.0.0.1 with AOF everysec; "
        f"{cores} cores, load {load_1m:.2f}",
        f"client load, the same for both: {options.processes} processes x {options.tasks} "
        f"asyncio tasks, reserve+settle over {options.orgs} orgs (budget path "
        f"{org_path(0)}: 4 legs); {options.rounds} rounds of {options.seconds:g} s each",
        "",
        per_round,
        "",
        cpu_bound,
        "",
        latency,
        "",
        "checked: every cycle on both ledgers committed exactly "
        f"{ACTUAL_MICROS} micros and left nothing reserved",
        f"scaling ratio, cluster / single cycles/s (median of this run): {ratio:.3f}",
    ])


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__.split("\n")[0])
    p.add_argument("--processes", type=int, default=PROCESSES, help="client processes "
                   "(default %(default)s)")
    p.add_argument("--tasks", type=int, default=TASKS, help="asyncio tasks per client process "
                   "(default %(default)s)")
    p.add_argument("--orgs", type=int, default=ORGS, help="default %(default)s")
    p.add_argument("--rounds", type=int, default=ROUNDS, help="default %(default)s")
    p.add_argument("--seconds", type=float, default=PHASE_S,
                   help="duration of each measurement (default %(default)s)")
    p.add_argument("--warmup-seconds", type=float, default=WARMUP_S, help="default %(default)s")
    options = p.parse_args(argv)
    if min(options.processes, options.tasks, options.orgs, options.rounds) < 1 or (
        options.seconds <= 0 or options.warmup_seconds <= 0
    ):
        p.error("--processes, --tasks, --orgs and --rounds must be at least 1, durations above 0")
    return options


def main(argv: Sequence[str] | None = None) -> int:
    options = parse(argv)
    # Every server is stopped by pid on the way out, whether the run ends, fails or is interrupted.
    with RedisServer(durable=True) as server, LocalCluster() as cluster:
        rounds = asyncio.run(measure(server, cluster, options))
        print(report(rounds, options))
    return 0


if __name__ == "__main__":
    sys.exit(main())
