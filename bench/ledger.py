"""Ledger throughput: reserve+settle cycles per second through RedisStore, against its ceilings.

    .venv/bin/python -m bench.ledger            # about 50 s; --help for rounds and durations

One redis-server, started here on a free loopback port and stopped by pid, serves three
measurements, interleaved over rounds because the machine is shared and noisy (the target is
the median of the store/bare ratios of adjacent pairs; CPU per cycle of this process is printed
beside it, as the figure least moved by other processes):

  store            RedisStore.reserve then .settle, in 50 asyncio tasks: the production path
                   (ledger time from Redis TIME, no injected clock).
  bare             the same two lua/ scripts by redis-py `fcall`, in 50 tasks, with the keys and
                   arguments ScriptedStore itself built once (recorded, not copied), only the
                   reservation id swapped per call: the ceiling the store's Python overhead is
                   measured against. Target: store >= 0.8 x bare.
  redis-benchmark  the reserve script alone from 50 C clients: what the server does with no
                   Python in the way. A cycle is two scripts, so store cycles/s against it is
                   context, not a target.

Every call reserves in 4 legs (org: day and total, team: month, key: total) with ceilings that
never refuse, and settles below its estimate. The ledger's counters are checked at the end, so
a loop that only collected error replies cannot pass for a fast one.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio.client import Redis

from bench.common import Cycle, Phase, run_phase
from core.budgets import BudgetDef, BudgetId, Limit, Period
from core.errors import InvariantBroken, ensure
from core.ledger import LedgerStore, ReservationRef, ReserveRequest
from core.limits import CEILING_MICROS_MAX, RESERVATION_TTL_MS_DEFAULT
from core.stores.durability import Durability
from core.stores.redis import RedisStore, RedisTransport, redis_client
from core.stores.scripted import ScriptedStore, Transport
from core.stores.scripts import Script
from infra.figures import median, ms, percentile, table
from infra.redis_server import RedisServer

TARGET_RATIO = 0.8
TASKS = 50
# Many short store/bare pairs rather than a few long ones: on a shared machine the load changes
# within seconds, and the median of many adjacent pairs is what survives it.
ROUNDS = 8
PHASE_S = 2.0
REDIS_BENCHMARK_RUNS = 3
REDIS_BENCHMARK_S = 2.0
WARMUP_S = 1.0
# One task at a time: the latency of a reserve with no queue in front of it.
SEQUENTIAL_S = 1.5

# A small chat call's worst case, settled at what it really cost: below the estimate, as most are.
ESTIMATE_MICROS = 2_500
ACTUAL_MICROS = 1_800
# The largest ceiling a limit may have: 4 * 10**11 estimates, so no run of this script refuses.
CEILING_MICROS = CEILING_MICROS_MAX
LIMITS_BY_SCOPE = (
    (Limit(Period.DAY, CEILING_MICROS), Limit(Period.TOTAL, CEILING_MICROS)),
    (Limit(Period.MONTH, CEILING_MICROS),),
    (Limit(Period.TOTAL, CEILING_MICROS),),
)
OWNER = "key_k1"
MODEL = "gpt-4o-mini"
PRICE_VERSION = "genai-prices-bench"
FINGERPRINT = "f" * 32  # the service's fingerprint is 32 hex characters of a sha256
# The store and bare loops settle what they reserve; redis-benchmark only reserves, so its open
# leases pile up in a tag of their own and never slow down the other two.
STORE_PATH = "org:bench/team:search/key:k1"
REDIS_BENCHMARK_PATH = "org:benchrb/team:search/key:k1"

# redis-benchmark replaces each '__rand_int__' with 12 random digits (each occurrence on its own,
# so the reservation key and the id in ARGV differ, which the reserve script never compares).
RAND_INT = "__rand_int__"
# ~1e9 ids: a few replays in a million calls at most, and a replay costs what a reserve does.
RAND_KEYSPACE = 1_000_000_000
# A short first run measures how many requests fill one phase on this machine.
REDIS_BENCHMARK_CALIBRATION_REQUESTS = 5_000
REDIS_BENCHMARK_REQUESTS_MIN = 5_000
REDIS_BENCHMARK_REQUESTS_MAX = 2_000_000
# A run aims at a few seconds; one still going after this is stuck, and the benchmark fails.
REDIS_BENCHMARK_TIMEOUT_S = 60.0
# A few reserves may replay an earlier random id; fewer admitted than this means errors.
REDIS_BENCHMARK_ADMITTED_SHARE_MIN = 0.99


# -- calls as the store builds them ------------------------------------------------------------


class Recorder:
    """A Transport that passes everything on and keeps every script call the store made."""

    def __init__(self, inner: Transport) -> None:
        self.backend = inner.backend
        self._inner = inner
        self.calls: list[tuple[Script, tuple[str, ...], tuple[str, ...]]] = []

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[str]) -> Any:
        self.calls.append((script, tuple(keys), tuple(args)))
        return await self._inner.run(script, keys, args)

    async def execute(self, *args: str) -> Any:
        return await self._inner.execute(*args)

    async def durability(self) -> Durability:
        return await self._inner.durability()

    async def close(self) -> None:
        await self._inner.close()


@dataclass(frozen=True)
class Call:
    """One script call exactly as ScriptedStore built it, with its reservation id as a hole."""

    script: Script
    key_count: int
    words: tuple[str, ...]  # KEYS then ARGV
    holes: tuple[tuple[int, str, str], ...]  # (index in words, text before the id, text after)

    @classmethod
    def recorded(
        cls, call: tuple[Script, tuple[str, ...], tuple[str, ...]], reservation_id: str
    ) -> Call:
        script, keys, args = call
        words = (*keys, *args)
        holes = []
        for i, word in enumerate(words):
            if reservation_id in word:
                before, after = word.split(reservation_id)
                holes.append((i, before, after))
        ensure(len(holes) == 1, "the id is in the reservation key, once")
        return cls(script, len(keys), words, tuple(holes))

    def words_for(self, reservation_id: str) -> list[str]:
        out = list(self.words)
        for i, before, after in self.holes:
            out[i] = before + reservation_id + after
        return out


def reserve_request(tag: str, budget_ids: tuple[BudgetId, ...]) -> ReserveRequest:
    return ReserveRequest(
        ref=ReservationRef(tag, uuid.uuid4().hex, OWNER),
        budget_ids=budget_ids,
        amount_micros=ESTIMATE_MICROS,
        ttl_ms=RESERVATION_TTL_MS_DEFAULT,
        fingerprint=FINGERPRINT,
        price_version=PRICE_VERSION,
        model=MODEL,
    )


async def put_budgets(store: LedgerStore, path: str) -> tuple[BudgetId, ...]:
    lineage = BudgetId.parse(path).lineage
    for budget_id, limits in zip(lineage, LIMITS_BY_SCOPE, strict=True):
        await store.put_budget(BudgetDef(budget_id, limits))
    return lineage


async def record_calls(url: str, budget_ids: tuple[BudgetId, ...]) -> tuple[Call, Call]:
    """Reserve and settle once through ScriptedStore, and keep the two calls it sent.

    The bare loop then sends the very words the store builds, so the two differ only in the
    Python each runs per call, and a change to the store's arguments cannot leave it behind.
    """
    recorder = Recorder(RedisTransport(redis_client(url)))
    store = ScriptedStore(recorder)
    try:
        request = reserve_request(budget_ids[0].tag, budget_ids)
        await store.reserve(request)
        reserve = recorder.calls[-1]
        await store.settle(request.ref, ACTUAL_MICROS)
        settle = recorder.calls[-1]
    finally:
        await store.close()
    ensure(reserve[0].name == "reserve" and settle[0].name == "settle", "recorded both calls")
    rid = request.ref.reservation_id
    return Call.recorded(reserve, rid), Call.recorded(settle, rid)


# -- the three loops ---------------------------------------------------------------------------


def store_cycle(store: RedisStore, budget_ids: tuple[BudgetId, ...]) -> Cycle:
    tag = budget_ids[0].tag

    async def cycle() -> float:
        request = reserve_request(tag, budget_ids)
        started_s = time.perf_counter()
        await store.reserve(request)
        latency_s = time.perf_counter() - started_s
        await store.settle(request.ref, ACTUAL_MICROS)
        return latency_s

    return cycle


def bare_cycle(client: Redis, reserve: Call, settle: Call) -> Cycle:
    async def cycle() -> float:
        rid = uuid.uuid4().hex
        started_s = time.perf_counter()
        # The library's functions, as the store calls them (core/stores/scripts.py).
        assert reserve.script.function is not None
        assert settle.script.function is not None
        reserved = await client.fcall(
            reserve.script.function, reserve.key_count, *reserve.words_for(rid)
        )
        latency_s = time.perf_counter() - started_s
        settled = await client.fcall(
            settle.script.function, settle.key_count, *settle.words_for(rid))
        if reserved[0] != "ok" or settled[0] != "ok":
            raise InvariantBroken(f"the bare loop was refused: {reserved[0]}, {settled[0]}")
        return latency_s

    return cycle


@dataclass(frozen=True)
class RedisBenchmark:
    requests: int
    requests_per_s: float
    p50_ms: float
    p99_ms: float


def redis_benchmark_argv(port: int, tasks: int, requests: int, reserve: Call) -> list[str]:
    binary = shutil.which("redis-benchmark")
    if binary is None:
        raise RuntimeError("redis-benchmark is not installed (apt-get install redis-tools)")
    # Same length as a uuid4 hex id, so the keys and arguments are the size the store sends.
    rid = uuid.uuid4().hex[: 32 - len(RAND_INT)] + RAND_INT
    return [
        binary, "-h", "127.0.0.1", "-p", str(port), "-c", str(tasks), "-n", str(requests),
        "-r", str(RAND_KEYSPACE), "--csv",
        "FCALL", str(reserve.script.function), str(reserve.key_count),
        *reserve.words_for(rid),
    ]


async def run_redis_benchmark(argv: list[str], timeout_s: float) -> RedisBenchmark:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        async with asyncio.timeout(timeout_s):
            out, err = await proc.communicate()
    finally:
        if proc.returncode is None:  # timed out or interrupted: it is ours to stop
            proc.kill()
            await proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"redis-benchmark exited with {proc.returncode}: {err.decode()}")
    rows = list(csv.DictReader(out.decode().splitlines()))
    ensure(len(rows) == 1, f"redis-benchmark prints one csv row: {out.decode()!r}")
    row = rows[0]
    return RedisBenchmark(
        int(argv[argv.index("-n") + 1]),
        float(row["rps"]),
        float(row["p50_latency_ms"]),
        float(row["p99_latency_ms"]),
    )


async def legs_by_window(store: LedgerStore, budget_ids: tuple[BudgetId, ...]) -> dict[
    tuple[str, str], tuple[int, int]
]:
    return {
        (leg.budget_id, leg.window_key): (leg.committed_micros, leg.reserved_micros)
        for leg in await store.status(budget_ids)
    }


# -- the run -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Round:
    """One store phase and one bare phase, back to back: the pair a ratio is taken from."""

    store: Phase
    bare: Phase

    @property
    def ratio(self) -> float:
        return self.store.cycles_per_s / self.bare.cycles_per_s


@dataclass(frozen=True)
class Results:
    rounds: tuple[Round, ...]
    redis_benchmarks: tuple[RedisBenchmark, ...]
    store_alone: Phase
    bare_alone: Phase
    redis_benchmark_argv: list[str]
    cycles_checked: int
    redis_benchmark_admitted: int


def spread(count: int, among: int) -> set[int]:
    """`count` indices spread evenly over range(among): after which rounds redis-benchmark runs."""
    return {(2 * k + 1) * among // (2 * count) for k in range(min(count, among))}


async def measure(server: RedisServer, options: argparse.Namespace) -> Results:
    setup = RedisStore(server.url)
    store = RedisStore(server.url)
    # The bare loop gets a client built exactly like the store's: same pool, same decoding.
    client = redis_client(server.url)
    try:
        budget_ids = await put_budgets(setup, STORE_PATH)
        rb_budget_ids = await put_budgets(setup, REDIS_BENCHMARK_PATH)
        reserve, settle = await record_calls(server.url, budget_ids)
        rb_reserve, _ = await record_calls(server.url, rb_budget_ids)
        for call in (reserve, settle):
            loaded = await client.script_load(call.script.source)
            ensure(loaded == call.script.sha1, "the server hashes the script as the store does")
        cycles_total = 1  # the recorded one

        run_store = store_cycle(store, budget_ids)
        run_bare = bare_cycle(client, reserve, settle)
        # Warm-up fills both connection pools and redis-py's and the interpreter's caches.
        for cycle in (run_store, run_bare):
            cycles_total += (await run_phase(cycle, options.tasks, options.warmup_seconds)).cycles
        calibration = await run_redis_benchmark(
            redis_benchmark_argv(
                server.port, options.tasks, REDIS_BENCHMARK_CALIBRATION_REQUESTS, rb_reserve
            ),
            REDIS_BENCHMARK_TIMEOUT_S,
        )
        rb_requests = min(
            REDIS_BENCHMARK_REQUESTS_MAX,
            max(
                REDIS_BENCHMARK_REQUESTS_MIN,
                int(calibration.requests_per_s * options.redis_benchmark_seconds),
            ),
        )
        rb_argv = redis_benchmark_argv(server.port, options.tasks, rb_requests, rb_reserve)
        rb_before = await legs_by_window(setup, rb_budget_ids)

        store_alone = await run_phase(run_store, 1, options.sequential_seconds)
        bare_alone = await run_phase(run_bare, 1, options.sequential_seconds)
        cycles_total += store_alone.cycles + bare_alone.cycles

        rounds: list[Round] = []
        benchmarks: list[RedisBenchmark] = []
        rb_after_rounds = spread(options.redis_benchmark_runs, options.rounds)
        for i in range(options.rounds):
            # Alternate who goes first, so a trend in the machine's load favours neither.
            phases: dict[str, Phase] = {}
            for name in ("store", "bare") if i % 2 == 0 else ("bare", "store"):
                cycle = run_store if name == "store" else run_bare
                phases[name] = await run_phase(cycle, options.tasks, options.seconds)
                cycles_total += phases[name].cycles
            rounds.append(Round(phases["store"], phases["bare"]))
            if i in rb_after_rounds:
                benchmarks.append(await run_redis_benchmark(rb_argv, REDIS_BENCHMARK_TIMEOUT_S))

        # Every cycle settled: nothing is held, and each one committed exactly its actual.
        for (budget_id, window_key), (committed, reserved) in (
            await legs_by_window(setup, budget_ids)
        ).items():
            if window_key == "total":
                ensure(reserved == 0, f"{budget_id}: every reservation was settled")
                ensure(
                    committed == cycles_total * ACTUAL_MICROS,
                    f"{budget_id}: committed {committed} != {cycles_total} cycles x actual",
                )
        rb_after = await legs_by_window(setup, rb_budget_ids)
        key_total = (rb_budget_ids[-1].path, "total")
        admitted = (rb_after[key_total][1] - rb_before[key_total][1]) // ESTIMATE_MICROS
        rb_sent = sum(b.requests for b in benchmarks)
        ensure(
            admitted >= REDIS_BENCHMARK_ADMITTED_SHARE_MIN * rb_sent,
            f"redis-benchmark: only {admitted} of {rb_sent} reserves were admitted",
        )
    finally:
        await store.close()
        await setup.close()
        await client.aclose()
    return Results(
        tuple(rounds), tuple(benchmarks), store_alone, bare_alone, rb_argv, cycles_total, admitted
    )


# -- the report --------------------------------------------------------------------------------


def _quote(word: str) -> str:
    return f"'{word}'" if not word or any(c in word for c in "{}|") else word


def report(results: Results, server: RedisServer, options: argparse.Namespace) -> str:
    rounds, benchmarks = results.rounds, results.redis_benchmarks
    store_rate = median([r.store.cycles_per_s for r in rounds])
    bare_rate = median([r.bare.cycles_per_s for r in rounds])
    rb_rate = median([b.requests_per_s for b in benchmarks])
    ratios = [r.ratio for r in rounds]
    ratio = median(ratios)
    store_cpu_us = median([r.store.cpu_us_per_cycle for r in rounds])
    bare_cpu_us = median([r.bare.cpu_us_per_cycle for r in rounds])
    verdict = "PASS" if ratio >= TARGET_RATIO else "FAIL"

    per_round = table(
        ["round", "store cycles/s", "bare cycles/s", "store/bare", "store CPU us/cycle",
         "bare CPU us/cycle"],
        [
            [str(i + 1), f"{r.store.cycles_per_s:,.0f}", f"{r.bare.cycles_per_s:,.0f}",
             f"{r.ratio:.3f}", f"{r.store.cpu_us_per_cycle:,.0f}",
             f"{r.bare.cpu_us_per_cycle:,.0f}"]
            for i, r in enumerate(rounds)
        ]
        + [["median", f"{store_rate:,.0f}", f"{bare_rate:,.0f}", f"{ratio:.3f}",
            f"{store_cpu_us:,.0f}", f"{bare_cpu_us:,.0f}"]],
    )
    rb_table = table(
        ["redis-benchmark run", "reserves", "reserves/s", "p50 ms", "p99 ms"],
        [
            [str(i + 1), f"{b.requests:,}", f"{b.requests_per_s:,.0f}", f"{b.p50_ms:.3f}",
             f"{b.p99_ms:.3f}"]
            for i, b in enumerate(benchmarks)
        ]
        + [["median", "", f"{rb_rate:,.0f}", f"{median([b.p50_ms for b in benchmarks]):.3f}",
            f"{median([b.p99_ms for b in benchmarks]):.3f}"]],
    )
    ratio_table = table(
        ["ratio", "value", "target", "check"],
        [
            ["store cycles/s / bare cycles/s (median of rounds; min-max "
             f"{min(ratios):.3f}-{max(ratios):.3f})", f"{ratio:.3f}", f">= {TARGET_RATIO}",
             verdict],
            ["bare CPU / store CPU per cycle, this process only",
             f"{bare_cpu_us / store_cpu_us:.3f}", "context", ""],
            ["store cycles/s / redis-benchmark reserves/s (2 scripts vs 1)",
             f"{store_rate / rb_rate:.3f}", "context", ""],
            ["bare cycles/s / redis-benchmark reserves/s (2 scripts vs 1)",
             f"{bare_rate / rb_rate:.3f}", "context", ""],
        ],
    )
    store_loaded = [s for r in rounds for s in r.store.latencies_s]
    bare_loaded = [s for r in rounds for s in r.bare.latencies_s]

    def latency_row(label: str, latencies_s: Sequence[float]) -> list[str]:
        return [label, ms(percentile(latencies_s, 50)), ms(percentile(latencies_s, 99)),
                f"{len(latencies_s):,}"]

    latency = table(
        ["one reserve", "p50 ms", "p99 ms", "samples"],
        [
            latency_row("store, 1 task (one round trip)", results.store_alone.latencies_s),
            latency_row("bare fcall, 1 task", results.bare_alone.latencies_s),
            latency_row(f"store, {options.tasks} tasks (queueing included)", store_loaded),
            latency_row(f"bare fcall, {options.tasks} tasks", bare_loaded),
        ],
    )
    rb_shown = ["redis-benchmark", *(_quote(w) for w in results.redis_benchmark_argv[1:])]
    load_1m, _, _ = os.getloadavg()
    persistence = "AOF everysec (production)" if options.durable else "no persistence"
    return "\n".join([
        f"spend-ceiling ledger benchmark: redis-server on 127.0.0.1:{server.port}, {persistence}; "
        f"{os.cpu_count()} cores, 1-minute load {load_1m:.2f} at the end",
        f"{options.tasks} tasks; {options.rounds} rounds of store then bare (alternating order), "
        f"{options.seconds:g} s each; budget path {STORE_PATH}: 4 legs (org day+total, team "
        f"month, key total); reserve {ESTIMATE_MICROS} micros, settle {ACTUAL_MICROS}",
        "store = RedisStore.reserve + settle; bare = the same 2 scripts by redis-py evalsha with "
        "the store's own arguments; redis-benchmark = the reserve script alone",
        "",
        per_round,
        "",
        rb_table,
        "",
        ratio_table,
        "",
        latency,
        "",
        f"checked: {results.cycles_checked:,} store and bare cycles committed exactly "
        f"{ACTUAL_MICROS} micros each and hold nothing; {results.redis_benchmark_admitted:,} "
        "redis-benchmark reserves admitted",
        f"redis-benchmark command: {' '.join(rb_shown)}",
        f"target: store >= {TARGET_RATIO} x bare: {verdict} ({ratio:.3f})",
    ])


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.ledger", description=__doc__.split("\n")[0])
    p.add_argument("--tasks", type=int, default=TASKS, help="concurrent asyncio tasks and "
                   "redis-benchmark clients (default %(default)s)")
    p.add_argument("--rounds", type=int, default=ROUNDS,
                   help="store/bare pairs (default %(default)s)")
    p.add_argument("--seconds", type=float, default=PHASE_S,
                   help="duration of each store and each bare phase (default %(default)s)")
    p.add_argument("--redis-benchmark-runs", type=int, default=REDIS_BENCHMARK_RUNS,
                   help="spread over the rounds (default %(default)s)")
    p.add_argument("--redis-benchmark-seconds", type=float, default=REDIS_BENCHMARK_S,
                   help="each run's target duration (default %(default)s)")
    p.add_argument("--warmup-seconds", type=float, default=WARMUP_S, help="default %(default)s")
    p.add_argument("--sequential-seconds", type=float, default=SEQUENTIAL_S,
                   help="the one-task latency phases (default %(default)s)")
    p.add_argument("--durable", action=argparse.BooleanOptionalAction, default=True,
                   help="redis-server with AOF everysec, as in production (default on)")
    options = p.parse_args(argv)
    if min(options.tasks, options.rounds, options.redis_benchmark_runs) < 1:
        p.error("--tasks, --rounds and --redis-benchmark-runs must be at least 1")
    if min(options.seconds, options.redis_benchmark_seconds, options.warmup_seconds,
           options.sequential_seconds) <= 0:
        p.error("durations must be above 0")
    return options


def main(argv: Sequence[str] | None = None) -> int:
    options = parse(argv)
    try:
        # The server (and any redis-benchmark, in measure) is stopped by pid on the way out,
        # whether the run ends, fails or is interrupted.
        with RedisServer(durable=options.durable) as server:
            results = asyncio.run(measure(server, options))
            print(report(results, server, options))
    except KeyboardInterrupt:
        print("interrupted; redis-server stopped", file=sys.stderr)
        return 130  # the shell's code for a run ended by SIGINT
    return 0


if __name__ == "__main__":
    sys.exit(main())
