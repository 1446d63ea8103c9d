"""Where the gateway's CPU per call goes, by layer, beside hardcap's, under bench/gateway.py's
load; and what uvloop, httptools and an aiohttp transport under httpx change.

    .venv/bin/python -m bench.gateway_profile             # ~4 min; --help
    .venv/bin/python -m bench.gateway_profile --quick     # a smoke run of ~1 min

The rig of bench/gateway.py without the floors: the stub, hardcap, and our gateway as
`ceiling serve` runs it, once per variant (bench/serve_variant.py: `ceiling serve` with uvicorn's
event loop and HTTP parser named), each gateway with its own Redis. For each of them:

  profile   wrk loads it (CONNECTIONS connections) while py-spy (from the side venv) samples
            the server process (`py-spy record --format raw --nonblocking`: the server is not
            paused to be sampled). Each sample is put in one layer (LAYERS) by its stack: the
            layer of its innermost frame that has one; frames of files no layer names (the
            standard library's plumbing, anyio, the HTTP parsers both sides share) are their
            callers'. A layer's share of the samples times the CPU per call measured over the
            same run (from /proc) is its CPU per call. Then the innermost frames of the largest
            layers, and who calls json.
  syscalls  strace -c on the server for a few seconds of the same load: syscalls per call, by
            name (per call does not depend on how much strace slows the process).
  A/B       the gateways loaded in interleaved rounds with no profiler attached: calls/s,
            p50/p99, CPU per call, each against the first variant.

uvloop and httptools come with the `serve` extra (`pip install -e '.[dev]'` has it); without
them the uvloop variant is left out.
The 1-minute load average is printed beside every figure: the machine may be shared.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench import side_venv
from bench.gateway import CONNECTIONS, Load, Rig, load_average, rig, run_wrk, stub_calls
from core.errors import ensure
from infra.figures import ms, table

PROFILE_S = 15
ROUNDS = 2
ROUND_S = 10
WARMUP_S = 2
# Samples a second: enough for a share of 1% to rest on a few hundred samples per run, few
# enough that the profiler's own reads of the process's memory stay out of the way.
SAMPLE_RATE_HZ = 250
QUICK = {"profile_seconds": 3, "rounds": 2, "seconds": 2, "warmup_seconds": 1}
# py-spy attaches within a fraction of a second; the load starts once it has.
ATTACH_S = 1.0
# Each: uvicorn's loop and parser, and what sends the calls under httpx's API. The first is
# `ceiling serve` as it runs (uvicorn's `auto`: uvloop and httptools with the `serve` extra,
# the gateway's aiohttp transport); the others are what it ran on before, for comparison.
VARIANTS = {"serve": ("auto", "auto", "aiohttp"),
            "uvloop+httpcore": ("uvloop", "httptools", "httpcore"),
            "asyncio+httpcore": ("asyncio", "h11", "httpcore")}
NEEDS = {"uvloop": "uvloop", "httptools": "httptools"}
# Syscalls made less often than this per call are left out of the table (its total has them).
SYSCALLS_SHOWN_MIN = 0.2
LAYERS_DETAILED = 4
FRAMES_PER_LAYER = 6
# strace's count of a process's syscalls over this many seconds of load: it slows the process
# many times over, but what it counts per call does not depend on speed.
STRACE_S = 4

# Layers by source file (py-spy prints paths below their sys.path entry), the first match wins.
# Ours and hardcap's side by side: the same layer is named once for both.
SERVER = "HTTP server: uvicorn (h11 / httptools), aiohttp.web"
ASGI = "ASGI layers: Starlette, FastAPI, api/app.py, api/routing.py"
CLIENT = "upstream client: httpx, aiohttp or httpcore, api/upstream.py + transport.py"
GATEWAY = "gateway logic: core/gateway.py, api/routes/; hardcap/app.py, router, providers"
LEDGER = "ledger: scripts' arguments and replies (core/stores, core/ledger.py; hardcap/ledger.py)"
PRICING = "pricing: core/prices/, core/money.py; hardcap/estimator.py"
OBJECTS = "per-call objects: dataclasses, enums, ids"
REDIS_CLIENT = "Redis client: redis-py; core/stores/redis.py + redis_resp.py (hiredis)"
LAYERS: tuple[tuple[str, str], ...] = (
    ("logging/", "logging"),
    ("json/", "JSON decode and encode (stdlib json)"),
    ("uvicorn/", SERVER),
    ("aiohttp/web", SERVER),
    ("aiohttp/client", CLIENT),
    ("aiohttp/connector.py", CLIENT),
    ("api/transport.py", CLIENT),
    ("starlette/", ASGI),
    ("fastapi/", ASGI),
    ("api/app.py", ASGI),
    ("api/routing.py", ASGI),
    ("api/openai_errors.py", ASGI),
    ("httpx/", CLIENT),
    ("httpcore/", CLIENT),
    ("api/upstream.py", CLIENT),
    ("redis/", REDIS_CLIENT),
    # The scripts' own connections (hiredis over an asyncio protocol) and the transport: what
    # redis-py's client is on hardcap's side.
    ("core/stores/redis.py", REDIS_CLIENT),
    ("core/stores/redis_resp.py", REDIS_CLIENT),
    ("prometheus_client/", "metrics: prometheus_client (hardcap)"),
    ("core/prices/", PRICING),
    ("core/money.py", PRICING),
    ("hardcap/estimator.py", PRICING),
    ("core/stores/", LEDGER),
    ("core/ledger.py", LEDGER),
    ("core/budgets.py", LEDGER),
    ("hardcap/ledger.py", LEDGER),
    ("core/service.py", "service: authenticate, reserve, settle (core/service.py)"),
    ("core/", GATEWAY),
    ("api/routes/", GATEWAY),
    ("hardcap/", GATEWAY),
    ("<string>", OBJECTS),
    ("dataclasses.py", OBJECTS),
    ("enum.py", OBJECTS),
    ("uuid.py", OBJECTS),
    ("copy.py", OBJECTS),
)
EVENT_LOOP = "event loop: scheduling, sockets, tasks (asyncio / uvloop)"
FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^()]*):(?P<line>\d+)\)$")


def frame_file(frame: str) -> str:
    found = FRAME.match(frame)
    return found.group("file") if found else frame


def layer_of(stack: Sequence[str]) -> str:
    """The layer a sample's CPU belongs to: that of its innermost frame that has one. Frames of
    files no layer names are their callers': the standard library's plumbing (asyncio's
    internals, sockets, typing, abc, contextlib), anyio under httpcore, and the parsers both
    sides of a gateway share (h11 is the server's under uvicorn and the client's under
    httpcore; aiohttp's http_parser is aiohttp.web's and its client's)."""
    for frame in reversed(stack):
        path = frame_file(frame)
        for prefix, layer in LAYERS:
            if path.startswith(prefix):
                return layer
    return EVENT_LOOP


@dataclass(frozen=True)
class Profile:
    variant: str
    load: Load
    samples: int
    by_layer: Counter[str]
    by_function: Counter[str]
    by_layer_function: Counter[tuple[str, str]]
    json_callers: Counter[str]

    def cpu_per_call_s(self, layer: str) -> float:
        return self.load.gateway_cpu_s / self.load.requests * self.by_layer[layer] / self.samples


def parse_raw(text: str, variant: str, load: Load) -> Profile:
    by_layer: Counter[str] = Counter()
    by_function: Counter[str] = Counter()
    by_layer_function: Counter[tuple[str, str]] = Counter()
    json_callers: Counter[str] = Counter()
    samples = 0
    for line in text.splitlines():
        stack_text, _, count_text = line.rpartition(" ")
        if not stack_text or not count_text.isdigit():
            continue
        count = int(count_text)
        stack = stack_text.split(";")
        samples += count
        layer = layer_of(stack)
        by_layer[layer] += count
        by_function[stack[-1]] += count
        by_layer_function[layer, stack[-1]] += count
        if layer.startswith("JSON"):
            caller = next((f for f in reversed(stack) if "json/" not in frame_file(f)), "?")
            json_callers[caller] += count
    ensure(samples > 0, f"py-spy took samples of {variant}")
    return Profile(variant, load, samples, by_layer, by_function, by_layer_function,
                   json_callers)


def profile(rig_: Rig, key: str, options: argparse.Namespace, directory: Path) -> Profile:
    target = rig_.targets[key]
    output = directory / f"{key}.txt"
    spy = subprocess.Popen(
        [side_venv.tool("py-spy"), "record", "--pid", str(target.pid), "--rate",
         str(SAMPLE_RATE_HZ), "--format", "raw", "--output", str(output), "--nonblocking"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        time.sleep(ATTACH_S)
        ensure(spy.poll() is None, "py-spy attached (it needs ptrace: root, or "
               "kernel.yama.ptrace_scope=0)")
        load = run_wrk(target, rig_.stub.pid, options.connections, options.profile_seconds)
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes its file when interrupted
        _, err = spy.communicate(timeout=60)
    ensure(output.exists(), f"py-spy wrote its samples: {err.decode()[-500:]}")
    return parse_raw(output.read_text(), key, load)


STRACE_ROW = re.compile(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(?P<calls>\d+)\s+(?:\d+\s+)?(?P<name>\w+)$")


def syscalls(rig_: Rig, key: str, options: argparse.Namespace) -> dict[str, float]:
    """Syscalls per call of one target's server, by name (strace -c over a wrk load)."""
    target = rig_.targets[key]
    before = stub_calls(rig_.stub).get(target.model, 0)
    tracer = subprocess.Popen(["strace", "-c", "-f", "-p", str(target.pid)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        time.sleep(ATTACH_S)
        run_wrk(target, rig_.stub.pid, options.connections, STRACE_S)
    finally:
        tracer.send_signal(signal.SIGINT)  # strace prints its counts when interrupted
        _, err = tracer.communicate(timeout=60)
    # Calls the stub answered while strace counted: wrk's count misses those in flight.
    calls = stub_calls(rig_.stub).get(target.model, 0) - before
    ensure(calls > 0, f"{key} answered calls under strace")
    counts = {}
    for line in err.decode().splitlines():
        found = STRACE_ROW.match(line)
        if found and found.group("name") != "total":
            counts[found.group("name")] = int(found.group("calls")) / calls
    return counts


def report_syscalls(counts: dict[str, dict[str, float]]) -> str:
    names = sorted({n for c in counts.values() for n in c},
                   key=lambda n: -max(c.get(n, 0.0) for c in counts.values()))
    rows = [[n, *(f"{c.get(n, 0.0):.2f}" for c in counts.values())] for n in names
            if max(c.get(n, 0.0) for c in counts.values()) >= SYSCALLS_SHOWN_MIN]
    rows.append(["all", *(f"{sum(c.values()):.1f}" for c in counts.values())])
    return table(["syscalls per call (strace -c)", *counts], rows)


def us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f}"


def report_profiles(profiles: list[Profile]) -> str:
    layers = sorted({x for p in profiles for x in p.by_layer},
                    key=lambda x: -profiles[0].by_layer[x])
    header = ["layer"]
    for p in profiles:
        header += [f"{p.variant} %", f"{p.variant} us/call"]
    rows = []
    for layer in layers:
        row = [layer]
        for p in profiles:
            row += [f"{100 * p.by_layer[layer] / p.samples:.1f}", us(p.cpu_per_call_s(layer))]
        rows.append(row)
    total = ["all (CPU per call from /proc)"]
    for p in profiles:
        total += ["100.0", us(p.load.gateway_cpu_s / p.load.requests)]
    rows.append(total)
    out = [table(header, rows)]
    for p in profiles:
        out.append(f"{p.variant}: {p.samples:,} samples over {p.load.requests:,} calls at "
                   f"{p.load.calls_per_s:,.0f} calls/s, load average {p.load.load_average:.2f}")
    first = profiles[0]
    rows = []
    for layer, _ in first.by_layer.most_common(LAYERS_DETAILED):
        frames = Counter({f: n for (x, f), n in first.by_layer_function.items() if x == layer})
        rows += [[f"{100 * n / first.samples:.1f}", layer.split(":")[0], f]
                 for f, n in frames.most_common(FRAMES_PER_LAYER)]
    out += ["", f"{first.variant}: the innermost frames of its largest layers",
            table(["%", "layer", "innermost frame"], rows)]
    if first.json_callers:
        rows = [[f"{100 * n / first.samples:.1f}", f] for f, n in
                first.json_callers.most_common(8)]
        out += ["", f"{first.variant}: who calls json", table(["%", "caller"], rows)]
    return "\n".join(out)


def report_rounds(rounds: list[tuple[str, Load]], first: str) -> str:
    rows = [[key, f"{x.load_average:.2f}", f"{x.calls_per_s:,.0f}", ms(x.p50_s), ms(x.p99_s),
             us(x.gateway_cpu_s / x.requests)] for key, x in rounds]
    out = [table(["A/B round", "load", "calls/s", "p50 ms", "p99 ms", "CPU us/call"], rows)]
    keys = list(dict.fromkeys(k for k, _ in rounds))
    summary = []
    for key in keys:
        loads = [x for k, x in rounds if k == key]
        cpu = sum(x.gateway_cpu_s for x in loads) / sum(x.requests for x in loads)
        summary.append([key, f"{statistics.median(x.calls_per_s for x in loads):,.0f}",
                        ms(statistics.median(x.p50_s for x in loads)),
                        ms(statistics.median(x.p99_s for x in loads)), us(cpu)])
    base_cpu = float(summary[keys.index(first)][4])
    base_rate = float(summary[keys.index(first)][1].replace(",", ""))
    for row in summary:
        row += [f"{float(row[1].replace(',', '')) / base_rate:.2f}",
                f"{float(row[4]) / base_cpu:.2f}"]
    out += ["", table(["medians", "calls/s", "p50 ms", "p99 ms", "CPU us/call",
                       f"calls/s / {first}", f"CPU / {first}"], summary)]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--connections", type=int, default=CONNECTIONS)
    parser.add_argument("--profile-seconds", type=int, default=PROFILE_S)
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="A/B rounds per variant")
    parser.add_argument("--seconds", type=int, default=ROUND_S, help="per A/B round")
    parser.add_argument("--warmup-seconds", type=int, default=WARMUP_S)
    options = parser.parse_args(argv)
    if options.quick:
        parser.set_defaults(**QUICK)
        options = parser.parse_args(argv)
    variants = {k: v for k, v in VARIANTS.items()
                if all(importlib.util.find_spec(NEEDS[m]) for m in v if m in NEEDS)}
    if len(variants) < len(VARIANTS):
        print(f"measured: {', '.join(variants)}; the others need uvloop and httptools "
              "installed", file=sys.stderr)
    ours = {key: (f"ceiling serve ({loop} + {http} + {transport})",
                  [sys.executable, "-m", "bench.serve_variant", "--loop", loop, "--http", http,
                   "--transport", transport])
            for key, (loop, http, transport) in variants.items()}
    load_before = load_average()
    with rig(with_hardcap=True, with_floors=False, ours=ours) as rig_, \
            tempfile.TemporaryDirectory(prefix="sc-profile-") as tmp:
        keys = [*variants, "hardcap"]
        for key in keys:
            run_wrk(rig_.targets[key], rig_.stub.pid, options.connections,
                    options.warmup_seconds)
        profiles = [profile(rig_, key, options, Path(tmp)) for key in keys]
        counts = {}
        if shutil.which("strace"):
            counts = {key: syscalls(rig_, key, options) for key in keys}
        rounds = []
        for i in range(options.rounds):
            for key in keys[i % len(keys):] + keys[:i % len(keys)]:
                rounds.append((key, run_wrk(rig_.targets[key], rig_.stub.pid,
                                            options.connections, options.seconds)))
    print(f"load average (1 min): {load_before:.2f} before, {load_average():.2f} after; "
          f"{options.connections} connections\n")
    print(report_profiles(profiles))
    if counts:
        print()
        print(report_syscalls(counts))
    else:
        print("\nstrace is not installed: no syscall counts (apt-get install strace)")
    print()
    print(report_rounds(rounds, keys[0]))

if __name__ == "__main__":
    main()
