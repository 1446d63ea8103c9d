"""A gateway call's work in instructions, ours beside hardcap 0.1.0: the figures that do not move.

    .venv/bin/python -m bench.instructions     # ~4 min; needs valgrind (apt-get install valgrind)
    .venv/bin/python -m bench.instructions --gateway-at-once 16 --gateway-calls 480
    .venv/bin/python -m bench.instructions --sidecar [--sidecar-source DIR]

bench.gateway judges CPU per call under wrk: the figures that count, but on a shared or virtual
machine they move with everything else it runs (docs/measured.md has the spread on this
project's machine). This counts what does not move: the user-space instructions a process
executes (valgrind's callgrind), per gateway call.

  gateway  bench.gateway's rig (the stub, `ceiling serve` and hardcap, each with its own Redis)
           with both gateways started under callgrind; GATEWAY_CALLS chat calls sent one at a
           time on one keep-alive connection after a warm-up, the counters zeroed before them
           (with --gateway-at-once N: in rounds of N sent together on N connections, as a
           server meets them under wrk's sixteen).
           The server's whole process: HTTP, authentication, pricing, the ledger client, the
           upstream client, its event loop. The kernel's share (the syscalls' own work) is not
           counted.
  Redis    one call through each gateway is watched with MONITOR for its two script calls
           (reserve and settle; admit and settle). A redis-server under callgrind gets a copy of
           that gateway's Redis (DUMP/RESTORE of every key, its functions or scripts) and
           replays the two calls REDIS_CALLS times in sequence, each pair under a fresh
           reservation id, as a gateway sends them one call at a time: reading the requests, the
           scripts, the commands they call, the replies. Its cron and active expiry are held
           still (counted_redis says why); a resolved record's later expiry is not counted.

  sidecar  with --sidecar (or --sidecar-source DIR): bench/http.py's two servers, each
           under callgrind, against one real redis-server set up by bench/http.py's own
           functions (the same budget path, API key, request body and recorded reserve call):
           `ceiling serve`, run from this checkout or from the source tree DIR (an older
           commit's worktree), and the bare endpoint (bench/bare_app.py, always this
           checkout's: the yardstick). Each gets SIDECAR_CALLS `POST /v1/reservations` one at
           a time, each checked to be a 201 with the hold the service makes. Printed: the
           instructions per request of each, and bare / reserve, the "work ratio", judged
           against bench/http.py's TARGET_RATIO: at or above it, the reserve route does at most
           1 / TARGET_RATIO of the bare endpoint's work per request. This is issue 14's
           "reserve >= 0.9x bare" by a judge the machine does not move, but it is not
           throughput: it counts the user-space instructions of each server process only. The
           kernel's share (the syscalls' own work) is not in it, nor is Redis's (it runs the
           same function for both), nor time spent waiting.

Sequential calls run with warm caches and no batching; under wrk sixteen connections interleave
(--gateway-at-once comes closer to that). Under callgrind a process runs many times slower, so a
cache that trusts by the clock (an API key is trusted for a second, core/service.py) is
refreshed many times more often per call than at native speed, and with N calls in flight it is
refreshed by each of them: docs/measured.md says what that adds.
The counts say how much work each side does per call, not how long it takes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis

from bench import http as bench_http
from bench import side_venv
from bench.gateway import Target, rig
from core.errors import ensure
from infra.figures import table
from infra.processes import free_port, stop, wait_ready
from infra.redis_server import RedisServer

GATEWAY_CALLS = 300
SIDECAR_CALLS = 300
REDIS_CALLS = 1000
# The counted Redis's cron rate: its lowest, so that its timed work stays out of the count.
REDIS_COUNTED_HZ = 1
WARMUP_CALLS = 30
# Under callgrind a process runs many times slower than natively: timeouts with room for it.
CALL_TIMEOUT_S = 120.0
START_TIMEOUT_S = 120.0
MONITOR_TIMEOUT_S = 10.0
SCRIPT_COMMANDS = ("FCALL", "EVALSHA")
TARGETS = {"ours": "spend-ceiling", "hardcap": "hardcap 0.1.0"}


def callgrind(out: Path) -> list[str]:
    """The command a process runs under to be counted; its counts go to `out`.<pid>.<dump>."""
    return ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}.%p"]


def counted_since_zero(pid: int, out: Path) -> int:
    """Dump the counters of the process `pid` (zeroed by `zero`) and read their total."""
    subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True)
    dumps = sorted(out.parent.glob(f"{out.name}.{pid}.*"))
    ensure(bool(dumps), f"callgrind wrote no dump for {pid}")
    found = re.search(r"^summary: (\d+)", dumps[-1].read_text(), re.MULTILINE)
    ensure(found is not None, "callgrind's dump has no summary")
    assert found is not None
    return int(found.group(1))


def zero(pid: int) -> None:
    subprocess.run(["callgrind_control", "-z", str(pid)], check=True, capture_output=True)


def per_call(pid: int, out: Path, calls: int, one_call: Callable[[], object]) -> float:
    """Instructions the process `pid` runs per `one_call()`: after WARMUP_CALLS uncounted,
    `calls` counted, one at a time."""
    for _ in range(WARMUP_CALLS):
        one_call()
    zero(pid)
    for _ in range(calls):
        one_call()
    return counted_since_zero(pid, out) / calls


def gateway_per_call(target: Target, out: Path, calls: int, at_once: int = 1) -> float:
    """Instructions the gateway process runs per chat call: one call at a time, or rounds of
    `at_once` calls sent together on as many keep-alive connections (what a server does per
    call with others in flight: its event loop's turns, its pools, its collector)."""
    if at_once == 1:
        with httpx.Client(timeout=CALL_TIMEOUT_S) as client:
            def one_call() -> None:
                answer = client.post(target.url, content=target.body(), headers=target.headers())
                ensure(answer.status_code == 200, f"{target.name}: {answer.status_code}")

            return per_call(target.pid, out, calls, one_call)
    with asyncio.Runner() as runner:
        many = httpx.AsyncClient(timeout=CALL_TIMEOUT_S,
                                 limits=httpx.Limits(max_connections=at_once))

        async def together() -> None:
            answers = await asyncio.gather(*(
                many.post(target.url, content=target.body(), headers=target.headers())
                for _ in range(at_once)))
            for answer in answers:
                ensure(answer.status_code == 200, f"{target.name}: {answer.status_code}")

        try:
            return per_call(target.pid, out, max(1, calls // at_once),
                            lambda: runner.run(together())) / at_once
        finally:
            runner.run(many.aclose())


@dataclass(frozen=True)
class Captured:
    """One gateway call's two script calls, as its Redis received them, and the reservation id
    in them (replaced by a fresh one for each replay)."""

    commands: tuple[tuple[str, ...], ...]
    reservation_id: str

    def replay(self) -> Iterator[tuple[str, ...]]:
        fresh = secrets.token_hex(len(self.reservation_id) // 2)
        for command in self.commands:
            yield tuple(part.replace(self.reservation_id, fresh) for part in command)


# One argument of a MONITOR line: Redis quotes each and escapes what is inside (sdscatrepr).
MONITOR_ARG = re.compile(r'"((?:[^"\\]|\\.)*)"')


def monitor_args(line: str) -> tuple[str, ...]:
    """The arguments of one MONITOR line, as the client sent them: spaces, tabs and all."""
    quoted = line.split("] ", 1)[1] if "] " in line else ""
    return tuple(arg.encode("latin-1").decode("unicode_escape")
                 for arg in MONITOR_ARG.findall(quoted))


def capture(target: Target) -> Captured:
    """The script calls one call through `target` makes: MONITOR while it is sent, read line by
    line (redis-py's parsed MONITOR joins the arguments with spaces and keeps escapes)."""
    redis_url = target.redis_url
    assert redis_url is not None
    commands: list[tuple[str, ...]] = []
    listening = threading.Event()

    def monitor() -> None:
        with redis.Redis.from_url(redis_url, decode_responses=True) as client, \
                client.monitor() as m:
            listening.set()
            while len(commands) < 2:
                args = monitor_args(str(m.connection.read_response()))
                # A key check (a key not read for KEY_TRUST_MS: callgrind slows the rig past
                # it) is not the call's own work: the reserve and the settle are.
                if args and args[0].upper() in SCRIPT_COMMANDS and not (
                        len(args) > 1 and args[1].endswith("_key_check")):
                    commands.append(args)

    thread = threading.Thread(target=monitor, daemon=True)
    thread.start()
    ensure(listening.wait(MONITOR_TIMEOUT_S), "MONITOR did not start")
    time.sleep(0.2)  # MONITOR is registered once the server has read it
    answer = httpx.post(target.url, content=target.body(), headers=target.headers(),
                        timeout=CALL_TIMEOUT_S)
    ensure(answer.status_code == 200, f"{target.name}: {answer.status_code}")
    thread.join(MONITOR_TIMEOUT_S)
    ensure(len(commands) == 2, f"{target.name}: script calls seen: {commands}")
    # The reservation id: the random one (hex, or ours' '<hex>_<hex>') at the end of a key or
    # argument of the first call that the second call names too.
    ids = [part.rsplit(":", 1)[-1] for part in commands[0][3:]]
    rid = next(i for i in ids if re.fullmatch(r"[0-9a-f]{16,}(_[0-9a-f]{16,})?", i)
               and any(i in part for part in commands[1]))
    return Captured(tuple(commands), rid)


def hardcap_scripts() -> list[str]:
    """hardcap's Lua sources, from the side venv that runs it."""
    where = subprocess.run(
        [side_venv.python(), "-c",
         "from importlib.resources import files; print(files('hardcap') / 'lua')"],
        capture_output=True, text=True, check=True).stdout.strip()
    return [p.read_text() for p in sorted(Path(where).glob("*.lua"))]


@contextlib.contextmanager
def counted_redis(out: Path) -> Iterator[tuple[redis.Redis, int]]:
    """A redis-server under callgrind, started here and stopped by pid: a client and its pid.

    Its timed background work is held still (REDIS_COUNTED_HZ, active expiry off): under
    callgrind a call takes many times its native wall time, so the server's cron and its expiry
    of the records resolved before would run per call as often as the machine is slow, and the
    count would move with it from run to run. What is counted is the calls' own work."""
    port = free_port()
    process = subprocess.Popen(
        [*callgrind(out), "redis-server", "--port", str(port), "--bind", "127.0.0.1",
         "--save", "", "--appendonly", "no", "--hz", str(REDIS_COUNTED_HZ),
         "--enable-debug-command", "local"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port, socket_timeout=START_TIMEOUT_S)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                ensure(time.monotonic() < deadline and process.poll() is None,
                       "redis-server under callgrind did not start")
                time.sleep(0.2)
        client.execute_command(  # type: ignore[no-untyped-call]
            "DEBUG", "SET-ACTIVE-EXPIRE", "0")
        yield client, process.pid
    finally:
        stop(process)


def copy_state(source_url: str, dest: redis.Redis, scripts: Sequence[str]) -> None:
    """Every key of the source, with its time to live; its function library, or `scripts`."""
    with redis.Redis.from_url(source_url) as source:
        for key in source.scan_iter(count=1000):
            dumped = source.dump(key)
            if dumped is not None:
                dest.restore(key, max(source.pttl(key), 0), dumped, replace=True)
        library = source.function_dump()
    if scripts:
        for text in scripts:
            dest.script_load(text)
    else:
        dest.function_restore(library)


def head(reply: Any) -> Any:
    return reply[0] if isinstance(reply, list) and reply else reply


def answered_as_a_call(key: str, replies: list[Any]) -> bool:
    """The replayed pair was a hold and its settle, not refusals, which would be counted as a
    cheaper path than a gateway call's: ours answers 'ok' to both, hardcap's admit 1 first."""
    if key == "ours":
        return [head(reply) for reply in replies] == [b"ok", b"ok"]
    return bool(head(replies[0]) == 1)


def redis_per_call(key: str, target: Target, out: Path, calls: int) -> float:
    """Instructions a Redis runs per gateway call for the two script calls `target` makes."""
    captured = capture(target)
    assert target.redis_url is not None
    with counted_redis(out) as (client, pid):
        copy_state(target.redis_url, client, hardcap_scripts() if key == "hardcap" else [])

        def one_call() -> list[Any]:
            return [client.execute_command(*command)  # type: ignore[no-untyped-call]
                    for command in captured.replay()]

        first = one_call()
        ensure(answered_as_a_call(key, first), f"{key}: replayed calls answered {first}")
        counted = per_call(pid, out, calls, one_call)
        last = one_call()
        ensure(answered_as_a_call(key, last), f"{key}: replayed calls answered {last}")
        return counted


@contextlib.contextmanager
def counted_server(argv_head: Sequence[str], env: dict[str, str], cwd: Path,
                   out: Path) -> Iterator[tuple[str, int]]:
    """A server of bench/http.py (`argv_head`, run from `cwd`) under callgrind on a free port,
    ready at its first /health/live 200, stopped by pid: its URL and pid."""
    port = free_port()
    process = subprocess.Popen(
        [*callgrind(out), *argv_head, "--host", "127.0.0.1", "--port", str(port)],
        cwd=cwd, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=CALL_TIMEOUT_S) as client:
            def live() -> bool:
                with contextlib.suppress(httpx.HTTPError):
                    return client.get(f"{url}/health/live").status_code == 200
                return False

            wait_ready(process, live, timeout_s=START_TIMEOUT_S, what=" ".join(argv_head))
        yield url, process.pid
    finally:
        stop(process)


def reserve_per_call(url: str, pid: int, setup: bench_http.Setup, what: str, out: Path,
                     calls: int) -> float:
    """Instructions the server `pid` runs per bench/http.py reserve request, each answered with
    the hold the service makes."""
    headers = bench_http.reserve_headers(setup.api_key)
    with httpx.Client(base_url=url, timeout=CALL_TIMEOUT_S) as client:
        def one_call() -> None:
            answer = client.post(bench_http.RESERVE_PATH, headers=headers,
                                 content=bench_http.RESERVE_BODY)
            bench_http.ensure_held(answer, setup, what)

        return per_call(pid, out, calls, one_call)


@dataclass(frozen=True)
class SidecarWork:
    """Instructions per reserve request of each of bench/http.py's two servers."""

    reserve: float  # `ceiling serve`, POST /v1/reservations
    bare: float  # bench/bare_app.py, one FCALL of the same function

    @property
    def work_ratio(self) -> float:
        """bare / reserve: at TARGET_RATIO or above, the route does at most 1 / TARGET_RATIO of
        the bare endpoint's work per request."""
        return self.bare / self.reserve


def sidecar_work(source: Path, calls: int, where: Path) -> SidecarWork:
    """`ceiling serve`, run from the source tree `source`, and the bare endpoint, counted per
    reserve request against one Redis set up as bench/http.py sets it up."""
    with RedisServer(durable=True) as ledger:
        env = bench_http.service_env(ledger.url)
        with counted_server(bench_http.serve_argv(), {**env, "PYTHONPATH": str(source)},
                            source, where / "service") as (service_url, service_pid):
            setup = bench_http.set_up(service_url, env, timeout_s=CALL_TIMEOUT_S)
            with counted_server(bench_http.bare_argv(), bench_http.bare_env(ledger.url, setup),
                                bench_http.REPO_ROOT, where / "bare") as (bare_url, bare_pid):
                bench_http.check_bare(bare_url, setup, timeout_s=CALL_TIMEOUT_S)
                return SidecarWork(
                    reserve=reserve_per_call(service_url, service_pid, setup, "the service",
                                             where / "service", calls),
                    bare=reserve_per_call(bare_url, bare_pid, setup, "the bare endpoint",
                                          where / "bare", calls),
                )


def sidecar_report(work: SidecarWork, source: Path, calls: int) -> str:
    ratio = work.work_ratio
    verdict = "PASS" if ratio >= bench_http.TARGET_RATIO else "FAIL"
    rows = [
        [f"reserve: `ceiling serve` from {source}", f"{work.reserve:,.0f}"],
        ["bare: bench/bare_app.py, one FCALL", f"{work.bare:,.0f}"],
        ["work ratio, bare / reserve", f"{ratio:.3f}"],
    ]
    return "\n".join([
        f"Instructions per POST {bench_http.RESERVE_PATH} (callgrind): user-space instructions of "
        f"each server process, not throughput; {calls:,} requests one at a time after "
        f"{WARMUP_CALLS} uncounted, bench/http.py's budget, key and request; the kernel's share "
        "and Redis's (the same function for both) are not counted",
        "",
        table(["server", "instructions per request"], rows),
        "",
        f"target: work ratio >= {bench_http.TARGET_RATIO} (the reserve route does at most "
        f"{1 / bench_http.TARGET_RATIO:.2f}x the bare endpoint's work per request): "
        f"{ratio:.3f}, {verdict}",
    ])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--gateway-calls", type=int, default=GATEWAY_CALLS)
    parser.add_argument("--gateway-at-once", type=int, default=1,
                        help="send the gateway calls in rounds of this many together (wrk's "
                        "load is 16 connections): the gateway process's work per call with "
                        "others in flight")
    parser.add_argument("--redis-calls", type=int, default=REDIS_CALLS)
    parser.add_argument("--sidecar", action="store_true",
                        help="count `ceiling serve`'s reserve route and bench/http.py's bare "
                        "endpoint instead of the gateways")
    parser.add_argument("--sidecar-source", type=Path, default=None,
                        help="--sidecar, with `ceiling serve` run from this source tree "
                        "(default: this checkout)")
    parser.add_argument("--sidecar-calls", type=int, default=SIDECAR_CALLS)
    options = parser.parse_args(argv)
    for tool in ("valgrind", "callgrind_control"):
        ensure(shutil.which(tool) is not None,
               f"{tool} is not installed (apt-get install valgrind)")
    if options.sidecar or options.sidecar_source is not None:
        source = (options.sidecar_source or bench_http.REPO_ROOT).resolve()
        with tempfile.TemporaryDirectory(prefix="sc-callgrind-") as where:
            work = sidecar_work(source, options.sidecar_calls, Path(where))
        print(sidecar_report(work, source, options.sidecar_calls))
        return 0
    counts = {}
    with tempfile.TemporaryDirectory(prefix="sc-callgrind-") as where:
        out = Path(where) / "gateway"
        with rig(with_floors=False, under=callgrind(out)) as rig_:
            for key in TARGETS:
                target = rig_.targets[key]
                counts[key] = (gateway_per_call(target, out, options.gateway_calls,
                                                options.gateway_at_once),
                               redis_per_call(key, target, Path(where) / f"redis-{key}",
                                              options.redis_calls))
    rows = [[name, f"{counts[key][0]:,.0f}", f"{counts[key][1]:,.0f}"]
            for key, name in TARGETS.items()]
    ours, theirs = counts["ours"], counts["hardcap"]
    rows.append(["ours / hardcap", f"{ours[0] / theirs[0]:.2f}", f"{ours[1] / theirs[1]:.2f}"])
    at_once = options.gateway_at_once
    sent = "one at a time" if at_once == 1 else f"in rounds of {at_once} together"
    print(f"Instructions per gateway call (callgrind): the gateway process over "
          f"{options.gateway_calls:,} chat calls sent {sent}, its Redis over "
          f"{options.redis_calls:,} replays of the call's two script calls, one at a time\n")
    print(table(["gateway", "gateway process", "its Redis"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
