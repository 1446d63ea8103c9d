"""Where the gateway's p99 comes from under bench/gateway.py's load: the evidence for each suspect.

    .venv/bin/python -m bench.gateway_tail             # ~3.5 min; --help
    .venv/bin/python -m bench.gateway_tail --quick     # a smoke run of ~35 s

The rig of bench/gateway.py without the floors: the stub, hardcap (the same run's reference
p99), and two instances of ours run by bench/serve_variant.py with its probes on (`ceiling
serve` itself, as installed unless --loop/--http name uvicorn's loop and parser): `ours` as it
is, `ours+freeze` with the candidate fix for long collections (httpx imported and uvicorn's
configuration loaded before `ceiling serve` freezes its start-up objects), `ours+aiohttp` with
the provider's calls sent through httpx-aiohttp's transport instead of httpcore's pool (when
it is installed). wrk loads them and hardcap in interleaved rounds (CONNECTIONS connections);
one more round of ours sends a new Idempotency-Key with every call, so the reply store's work
(claimed before the call, kept after the answer is sent) is in the path. Then ours are stopped,
which writes what their probes measured; per round it prints wrk's latencies beside the
suspects inside that round, and per instance the suspects over its whole run:

  time in the app      each request's time from the ASGI call to its last byte, against wrk's
                       latency: what is missing from it waited before the app was called
  collector pauses     every gc collection (gc.callbacks), by generation: count, total, longest
  loop blocking        callbacks that held the event loop over 5 ms (collections taken out),
                       and how late a 1 ms timer fired (every iteration's wait)
  pool waits           waits for a connection from httpcore's pool and from redis-py's, and the
                       connections each pool made (per round: new connections to the provider)
  TCP                  the machine's counters per round: connections opened, segments resent
                       (a lost SYN waits a second), accept-queue overflows, delayed ACKs
  behind the answer    tasks the gateway spawned (output-length observations)
  CPU contention       how long the gateway and each Redis waited on a run queue for a core
                       (/proc/<pid>/schedstat) and how often they were preempted
                       (nonvoluntary_ctxt_switches): on a shared 2-core machine a process that
                       waits for a core stalls every call in it at once

The slowest requests are then set against what overlapped them: the collections, slow callbacks
and the loop's lateness inside each one's span. The 1-minute load average is beside each round.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.gateway import (
    CONNECTIONS,
    WRK_SCRIPT,
    Load,
    Rig,
    Target,
    chat_body,
    load_average,
    rig,
    run_wrk,
)
from core.errors import ensure
from infra.figures import ms, percentile, table

ROUND_S = 10
ROUNDS = 3  # of ours, each followed by one of hardcap
WARMUP_S = 2
QUICK = {"seconds": 2, "rounds": 1, "warmup_seconds": 1}
SLOWEST_SHOWN = 10
# The requests whose overlap with stalls is summed: the slowest 1%, the p99's tail.
TAIL_FRACTION = 0.01
CALLBACKS_SHOWN = 8
# The instances of ours the rounds compare, each with its probes: as installed; with the
# candidate fix for long collections (bench/serve_variant.py --import-before-freeze); and with
# the provider's calls sent through aiohttp's pool instead of httpcore's (--transport aiohttp,
# when httpx-aiohttp is installed): a suspect is convicted by what its removal changes.
INSTANCES: dict[str, tuple[str, list[str]]] = {
    "ours": ("ceiling serve", []),
    "ours+freeze": ("ceiling serve, imports before the freeze", ["--import-before-freeze"]),
    "ours+aiohttp": ("ceiling serve, aiohttp transport", ["--transport", "aiohttp"]),
}

# Every call a key of its own: wrk's Lua numbers them per thread.
IDEMPOTENT = """
local n = 0
function request()
  n = n + 1
  wrk.headers["Idempotency-Key"] = "bench-" .. tostring(math.random(1, 2^30)) .. "-" .. n
  return wrk.format()
end
"""


@dataclass(frozen=True)
class Waits:
    """What /proc said of a process over one round: its wait for a core, and preemptions."""

    run_queue_s: float
    preempted: int


def schedstat(pid: int) -> tuple[float, int]:
    with open(f"/proc/{pid}/schedstat") as f:
        waited_ns = int(f.read().split()[1])
    with open(f"/proc/{pid}/status") as f:
        preempted = next(int(line.split()[1]) for line in f
                         if line.startswith("nonvoluntary_ctxt_switches"))
    return waited_ns / 1e9, preempted


TCP_COUNTERS = (("Tcp", "ActiveOpens"), ("Tcp", "RetransSegs"), ("TcpExt", "ListenOverflows"),
                ("TcpExt", "DelayedACKs"))


def tcp_counters() -> dict[str, int]:
    """The machine's TCP counters (/proc/net/snmp and netstat): connections opened, segments
    resent (a lost SYN is resent after a second), accept queues overflowed, delayed ACKs. They
    count every process on the machine, so they convict only when they move with the p99."""
    found: dict[str, int] = {}
    for path in ("/proc/net/snmp", "/proc/net/netstat"):
        with open(path) as f:
            lines = f.read().splitlines()
        for names, values in zip(lines[::2], lines[1::2], strict=False):
            kind, _, fields = names.partition(": ")
            found.update({f"{kind}.{k}": int(v) for k, v in
                          zip(fields.split(), values.partition(": ")[2].split(), strict=False)})
    return {f"{k}.{n}": found.get(f"{k}.{n}", 0) for k, n in TCP_COUNTERS}


def run_round(target: Target, stub_pid: int, pids: dict[str, int], connections: int,
              seconds: int) -> tuple[Load, dict[str, Waits], dict[str, int]]:
    before = {name: schedstat(pid) for name, pid in pids.items()}
    tcp_before = tcp_counters()
    load = run_wrk(target, stub_pid, connections, seconds)
    tcp = {k: v - tcp_before[k] for k, v in tcp_counters().items()}
    waits = {}
    for name, pid in pids.items():
        waited_s, preempted = schedstat(pid)
        waits[name] = Waits(waited_s - before[name][0], preempted - before[name][1])
    return load, waits, tcp


def summary(values: Sequence[float]) -> str:
    if not values:
        return "none"
    return (f"p50 {ms(percentile(values, 50))}, p99 {ms(percentile(values, 99))}, "
            f"max {ms(max(values))} ms")


def overlap_s(spans: Sequence[Sequence[Any]], start_s: float, end_s: float) -> float:
    """Time of `spans` ([start_s, took_s, ...]) inside [start_s, end_s]."""
    return float(sum(max(0.0, min(end_s, s + took) - max(start_s, s)) for s, took, *_ in spans))


def report_probes(probes: dict[str, Any]) -> list[str]:
    out = []
    requests = probes["requests"]
    calls = requests["count"]  # every request the app saw while probed: per call is per these
    out.append(f"time in the app ({requests['count']:,} requests): "
               f"{summary(requests['all_s'])}")
    rows = []
    for generation, d in probes["gc"].items():
        rows.append([generation, f"{d['count']:,}", f"{d['count'] / calls:.2f}",
                     ms(d["total_s"]), ms(d["cpu_total_s"]),
                     f"{d['total_s'] / calls * 1e6:.0f}", ms(d["max_s"]),
                     f"{len(d['long']):,}"])
    census = probes["census"]
    packages = Counter(m.split(".")[0] for m in census["modules"])
    out += ["", table(["gc generation", "collections", "per call", "wall ms", "CPU ms",
                       "wall us/call", "longest ms", ">= 1 ms"], rows),
            f"thresholds {probes['gc_thresholds']}, {probes['gc_frozen']:,} objects frozen "
            f"at start-up; at shutdown {census['tracked_not_frozen']:,} tracked objects were "
            "not (what a full collection walks), by type: "
            + ", ".join(f"{t} {n:,}" for t, n in census["by_type"][:8]),
            f"modules imported after the freeze: {len(census['modules'])}, by package: "
            + ", ".join(f"{p} {n}" for p, n in packages.most_common(12))]
    callbacks = probes["callbacks"]
    out += ["", f"callbacks holding the loop >= 5 ms (collections taken out): "
                f"{callbacks['count']:,}, {ms(callbacks['total_s'])} ms of wall time in all, "
                f"of which {ms(callbacks['cpu_total_s'])} ms on a core (the rest: waiting for "
                f"one); longest {ms(callbacks['max_s'])} ms"]
    by_what: dict[str, list[tuple[float, float]]] = {}
    for _, took, what, cpu in callbacks["long"]:
        by_what.setdefault(what.split(" at ")[0][:150], []).append((took, cpu))
    rows = [[f"{len(t):,}", ms(sum(x for x, _ in t)), ms(sum(c for _, c in t)),
             ms(max(x for x, _ in t)), what]
            for what, t in sorted(by_what.items(), key=lambda x: -sum(y for y, _ in x[1]))
            [:CALLBACKS_SHOWN]]
    if rows:
        out.append(table(["count", "wall ms", "CPU ms", "longest ms", "callback"], rows))
    handles = probes["handles_run"] - probes["ticks"]  # less the lag ticker's own
    out.append(f"event-loop callbacks run: {handles:,}, {handles / calls:.1f} per request "
               "(each a turn in the loop's queue behind every other ready callback)")
    lag = probes["loop_lag"]["all_s"]
    out += ["", f"a 1 ms timer fired late by: {summary(lag)}; "
                f"{sum(x >= 0.05 for x in lag):,} times by 50 ms or more"]
    for name in ("httpcore_waits", "redis_waits", "spawned"):
        d = probes[name]
        out.append(f"{name.replace('_', ' ')}: {d['count']:,}, {ms(d['total_s'])} ms in all, "
                   f"longest {ms(d['max_s'])} ms, {len(d['long']):,} of 1 ms or more")
    out.append(f"connections made: {probes['connections_made']}")
    return out


def report_tail(probes: dict[str, Any]) -> list[str]:
    """The slowest requests in the app, and what of the stalls fell inside each one's span."""
    spans = sorted(probes["requests"]["long"], key=lambda x: -x[1])
    gc_spans = [x for d in probes["gc"].values() for x in d["long"]]
    callbacks = probes["callbacks"]["long"]
    lag = probes["loop_lag"]["long"]
    tail = spans[:max(1, int(len(spans) * TAIL_FRACTION))]
    rows = []
    for start_s, took_s, path, _ in tail[:SLOWEST_SHOWN]:
        end_s = start_s + took_s
        rows.append([f"{start_s:.3f}", ms(took_s), ms(overlap_s(gc_spans, start_s, end_s)),
                     ms(overlap_s(callbacks, start_s, end_s)),
                     ms(max((t for s, t, *_ in lag if start_s <= s <= end_s), default=0.0)),
                     path])
    total_s = sum(t for _, t, *_ in tail)
    gc_in_s = sum(overlap_s(gc_spans, s, s + t) for s, t, *_ in tail)
    callbacks_in_s = sum(overlap_s(callbacks, s, s + t) for s, t, *_ in tail)
    return ["", table(["slowest: at s", "in app ms", "gc inside ms", "slow callbacks ms",
                       "worst timer lag ms", "path"], rows),
            f"the slowest {len(tail):,} requests ({100 * TAIL_FRACTION:.0f}%): "
            f"{ms(total_s)} ms in the app, of which collections {ms(gc_in_s)} ms "
            f"({100 * gc_in_s / total_s:.1f}%), slow callbacks {ms(callbacks_in_s)} ms "
            f"({100 * callbacks_in_s / total_s:.1f}%)"]


@dataclass(frozen=True)
class Round:
    name: str
    key: str  # the instance it loaded
    load: Load
    waits: dict[str, Waits]
    tcp: dict[str, int]
    started_s: float  # perf_counter: CLOCK_MONOTONIC, the same clock as the probes'
    ended_s: float


def window(probes: dict[str, Any], spans: Sequence[Sequence[Any]], r: Round
           ) -> list[Sequence[Any]]:
    """The spans (probe-relative [start_s, took_s, ...]) that started within a round."""
    start_s, end_s = r.started_s - probes["started_s"], r.ended_s - probes["started_s"]
    return [x for x in spans if start_s <= x[0] <= end_s]


def report_rounds(rounds: Sequence[Round], probes: dict[str, dict[str, Any]]) -> str:
    rows = []
    for r in rounds:
        p = probes.get(r.key)
        cells = ["", "", "", "", "", ""]
        if p is not None:
            in_app = [t for _, t, *_ in window(p, p["requests"]["long"], r)]
            gc_long = [x for g in ("0", "1", "2") for x in window(p, p["gc"][g]["long"], r)]
            full = window(p, p["gc"]["2"]["long"], r)
            slow = window(p, p["callbacks"]["long"], r)
            lag = [t for _, t, *_ in window(p, p["loop_lag"]["long"], r)]
            cells = [ms(percentile(in_app, 99)) if in_app else "",
                     f"{len(gc_long)} / {ms(sum(x[1] for x in gc_long))} / "
                     f"{ms(max((x[1] for x in gc_long), default=0.0))}",
                     f"{len(full)} / {ms(sum(x[1] for x in full))}",
                     f"{len(slow)} / {ms(sum(x[1] for x in slow))} / "
                     f"{ms(sum(x[3] for x in slow))}",
                     ms(max(lag, default=0.0)),
                     str(len(window(p, [(t, 0.0) for t in p["connected_at"]["httpcore"]], r)))]
        rows.append([r.name, f"{r.load.load_average:.2f}", f"{r.load.calls_per_s:,.0f}",
                     ms(r.load.p50_s), ms(r.load.p99_s), ms(r.load.max_s), *cells,
                     *(f"{ms(w.run_queue_s)} / {w.preempted:,}" for w in r.waits.values()),
                     " / ".join(f"{v:,}" for v in r.tcp.values())])
    return table(["round", "load", "calls/s", "p50 ms", "p99 ms", "max ms", "in-app p99 ms",
                  "gc >= 1 ms: n / ms / longest", "full gc: n / ms",
                  "slow callbacks: n / wall / CPU ms", "timer lag max ms",
                  "new upstream conns",
                  *(f"{n}: run-queue ms / preempted" for n in rounds[0].waits),
                  "TCP: opened / resent / overflows / delayed ACKs"], rows)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--connections", type=int, default=CONNECTIONS)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--seconds", type=int, default=ROUND_S)
    parser.add_argument("--warmup-seconds", type=int, default=WARMUP_S)
    parser.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto")
    parser.add_argument("--http", choices=("auto", "h11", "httptools"), default="auto")
    options = parser.parse_args(argv)
    if options.quick:
        parser.set_defaults(**QUICK)
        options = parser.parse_args(argv)
    load_before = load_average()
    instances = {k: v for k, v in INSTANCES.items()
                 if "aiohttp" not in v[1] or importlib.util.find_spec("httpx_aiohttp")}
    with tempfile.TemporaryDirectory(prefix="sc-tail-") as tmp:
        paths = {key: Path(tmp) / f"{key}.json" for key in instances}
        ours = {key: (f"{name} ({options.loop} loop, {options.http} http), probed",
                      [sys.executable, "-m", "bench.serve_variant", "--loop", options.loop,
                       "--http", options.http, "--probes", str(paths[key]), *extra])
                for key, (name, extra) in instances.items()}
        with rig(with_hardcap=True, with_floors=False, ours=ours) as rig_:
            rounds = measure(rig_, options, list(instances))
            for key in instances:
                rig_.ours[key].server.stop()  # its probes write their file as it stops
        probes = {}
        for key, path in paths.items():
            ensure(path.exists(), f"{key}: the probed server wrote what it measured")
            probes[key] = json.loads(path.read_text())
    print(f"load average (1 min): {load_before:.2f} before, {load_average():.2f} after; "
          f"{options.connections} connections\n")
    print(report_rounds(rounds, probes))
    for key in instances:
        loads = [r.load for r in rounds if r.name == key]
        print(f"\n{key}: p99 median of its plain rounds "
              f"{ms(statistics.median(x.p99_s for x in loads))} ms")
    hardcap_loads = [r.load for r in rounds if r.name == "hardcap"]
    print(f"hardcap: p99 median {ms(statistics.median(x.p99_s for x in hardcap_loads))} ms")
    for key, name_extra in instances.items():
        print(f"\n== {key}: {name_extra[0]}, over its whole run")
        print("\n".join([*report_probes(probes[key]), *report_tail(probes[key])]))


def measure(rig_: Rig, options: argparse.Namespace, instances: list[str]) -> list[Round]:
    ours, hardcap = rig_.targets["ours"], rig_.targets["hardcap"]
    idempotent = Target(ours.name, ours.url, ours.pid, ours.model, ours.api_key,
                        ours.script.with_name("ours-idempotent.lua"), ours.redis_url)
    auth = f'wrk.headers["Authorization"] = "Bearer {ours.api_key}"'
    idempotent.script.write_text(WRK_SCRIPT.replace("@BODY@", chat_body(ours.model))
                                 .replace("@AUTH@", auth) + IDEMPOTENT)
    targets = [(key, rig_.targets[key]) for key in instances] + [("hardcap", hardcap)]
    for _, target in targets:
        run_wrk(target, rig_.stub.pid, options.connections, options.warmup_seconds)
    rounds = []

    def go(name: str, key: str, target: Target) -> None:
        started_s = time.perf_counter()
        pids = {"gateway": target.pid, "its redis": pid_of(rig_, key)}
        load, waits, tcp = run_round(target, rig_.stub.pid, pids, options.connections,
                                     options.seconds)
        rounds.append(Round(name, key, load, waits, tcp, started_s, time.perf_counter()))

    for i in range(options.rounds):
        for key, target in targets[i % len(targets):] + targets[:i % len(targets)]:
            go(key, key, target)
    go("ours, Idempotency-Key", "ours", idempotent)
    return rounds


def pid_of(rig_: Rig, key: str) -> int:
    process = rig_.redis_by_target[key].process
    ensure(process is not None, f"{key}'s Redis runs")
    assert process is not None
    return process.pid


if __name__ == "__main__":
    main()
