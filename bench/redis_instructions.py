"""Redis's work per gateway call, counted in instructions: ours beside hardcap 0.1.0, noise-free.

    .venv/bin/python -m bench.redis_instructions          # ~1 min; needs valgrind
                                                          # (apt-get install valgrind)

bench.gateway judges Redis's CPU per call under wrk, from INFO cpu: the figure that counts, but
on a shared or virtual machine it moves with everything else the machine runs (the same code
has read 1.3x to 1.6x hardcap's there). This counts what does not move: the instructions a
redis-server executes (valgrind's callgrind) for the two script calls of one gateway call.

It starts bench.gateway's rig (the stub, `ceiling serve` and hardcap, each with its own Redis),
sends one call through each gateway and records, with MONITOR, the two script calls (reserve and
settle; admit and settle) that call made. Then, per gateway, a redis-server under callgrind is
given a copy of that gateway's Redis (DUMP/RESTORE of every key, and its functions or scripts)
and replays the two script calls CALLS times in sequence, one connection, each pair under a
fresh reservation id, as a gateway would send them one call at a time. The count covers
everything the server does for them: reading the requests, the scripts, the commands they call,
the replies. It is not the time: a sequential replay has warm caches, and the server under wrk
interleaves sixteen connections' calls.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import redis

from bench import side_venv
from bench.gateway import Rig, Target, rig
from core.errors import ensure
from infra.figures import table
from infra.processes import free_port, stop

CALLS = 1000
WARMUP_CALLS = 50
# Under callgrind a server answers ~50x slower than natively.
START_TIMEOUT_S = 60.0
MONITOR_TIMEOUT_S = 10.0
SCRIPT_COMMANDS = ("FCALL", "EVALSHA")


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


def capture(target: Target) -> Captured:
    """The script calls one call through `target` makes: MONITOR while it is sent."""
    redis_url = target.redis_url
    assert redis_url is not None
    seen: list[str] = []
    done = threading.Event()

    def monitor() -> None:
        with redis.Redis.from_url(redis_url, decode_responses=True) as client, \
                client.monitor() as m:
            done.set()
            for entry in m.listen():
                seen.append(entry["command"])
                if sum(line.startswith(SCRIPT_COMMANDS) for line in seen) >= 2:
                    return

    thread = threading.Thread(target=monitor, daemon=True)
    thread.start()
    ensure(done.wait(MONITOR_TIMEOUT_S), "MONITOR did not start")
    time.sleep(0.2)  # MONITOR is registered once the server has read it
    answer = httpx.post(target.url, content=target.body(), headers=target.headers())
    ensure(answer.status_code == 200, f"{target.name}: {answer.status_code}")
    thread.join(MONITOR_TIMEOUT_S)
    commands = tuple(tuple(line.split(" ")) for line in seen if line.startswith(SCRIPT_COMMANDS))
    ensure(len(commands) == 2, f"{target.name}: script calls seen: {commands}")
    # The reservation id: the one argument of the first call that the second repeats and that
    # is random (hex or our '<hex>_<hex>'), not a key name or a number.
    ids = [part.rsplit(":", 1)[-1] for part in commands[0][3:]]
    rid = next(i for i in ids if re.fullmatch(r"[0-9a-f]{16,}(_[0-9a-f]{16,})?", i)
               and any(i in part for part in commands[1]))
    return Captured(commands, rid)


def hardcap_scripts() -> list[str]:
    """hardcap's Lua sources, from the side venv that runs it."""
    where = subprocess.run(
        [side_venv.python(), "-c",
         "from importlib.resources import files; print(files('hardcap') / 'lua')"],
        capture_output=True, text=True, check=True).stdout.strip()
    return [p.read_text() for p in sorted(Path(where).glob("*.lua"))]


@contextlib.contextmanager
def counted_server(directory: Path, name: str) -> Iterator[tuple[redis.Redis, Callable[[], int]]]:
    """A redis-server under callgrind; yields a client and `count`, which zeroes the counters on
    its first call and returns the instructions since then on its second."""
    port = free_port()
    out = directory / f"callgrind-{name}.out"
    process = subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "redis-server",
         "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
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

        def control(flag: str) -> None:
            subprocess.run(["callgrind_control", flag, str(process.pid)], check=True,
                           capture_output=True)

        zeroed = False

        def count() -> int:
            nonlocal zeroed
            if not zeroed:
                control("-z")
                zeroed = True
                return 0
            control("-d")
            dumps = sorted(directory.glob(f"callgrind-{name}.out.*"))
            ensure(bool(dumps), "callgrind wrote no dump")
            found = re.search(r"^summary: (\d+)", dumps[-1].read_text(), re.MULTILINE)
            ensure(found is not None, "callgrind's dump has no summary")
            assert found is not None
            return int(found.group(1))

        yield client, count
    finally:
        stop(process)


def copy_state(source_url: str, dest: redis.Redis, scripts: Sequence[str]) -> None:
    """Every key of the source, with its time to live; its function library, or `scripts`."""
    with redis.Redis.from_url(source_url) as source:
        for key in source.scan_iter(count=1000):
            dumped = source.dump(key)
            if dumped is not None:
                ttl_ms = source.pttl(key)
                dest.restore(key, max(ttl_ms, 0), dumped, replace=True)
        library = source.function_dump()
    if scripts:
        for text in scripts:
            dest.script_load(text)
    else:
        dest.function_restore(library)


def instructions_per_call(rig_: Rig, key: str, calls: int, directory: Path) -> float:
    target = rig_.targets[key]
    captured = capture(target)
    scripts = hardcap_scripts() if key == "hardcap" else []
    with counted_server(directory, key) as (client, count):
        assert target.redis_url is not None
        copy_state(target.redis_url, client, scripts)

        def one_call() -> None:
            for command in captured.replay():
                client.execute_command(*command)  # type: ignore[no-untyped-call]

        for _ in range(WARMUP_CALLS):
            one_call()
        count()
        for _ in range(calls):
            one_call()
        return count() / calls


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--calls", type=int, default=CALLS)
    options = parser.parse_args(argv)
    for tool in ("valgrind", "callgrind_control"):
        ensure(shutil.which(tool) is not None,
               f"{tool} is not installed (apt-get install valgrind)")
    with rig(with_floors=False) as rig_:
        per_call = {key: instructions_per_call(rig_, key, options.calls, rig_.directory)
                    for key in ("ours", "hardcap")}
    print(f"Redis instructions per gateway call (callgrind), {options.calls:,} calls replayed "
          "in sequence, one connection\n")
    print(table(["gateway", "instructions/call"],
                [["spend-ceiling", f"{per_call['ours']:,.0f}"],
                 ["hardcap 0.1.0", f"{per_call['hardcap']:,.0f}"],
                 ["ours / hardcap", f"{per_call['ours'] / per_call['hardcap']:.2f}"]]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
