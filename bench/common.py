"""What every benchmark in bench/ shares: phases of concurrent tasks (the figures they print are
infra/figures.py's).

A benchmark is not a test: it prints what it measured and a PASS/FAIL against its target, and
exits 0 either way unless something errored.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

Cycle = Callable[[], Awaitable[float]]
"""One unit of work; returns the latency in seconds of the part the benchmark reports on."""


@dataclass(frozen=True)
class Phase:
    """What one fixed-duration run of concurrent tasks did."""

    cycles: int
    elapsed_s: float
    # CPU this process spent (servers and other processes excluded): less noisy than elapsed
    # time on a shared machine, and what a client-side change actually moves.
    cpu_s: float
    latencies_s: tuple[float, ...]

    @property
    def cycles_per_s(self) -> float:
        return self.cycles / self.elapsed_s

    @property
    def cpu_us_per_cycle(self) -> float:
        return self.cpu_s / self.cycles * 1e6


async def run_phase(cycle: Cycle, tasks: int, duration_s: float) -> Phase:
    """Run `cycle` in `tasks` concurrent tasks until `duration_s` has passed.

    Each task finishes the cycle it is in at the deadline, and the elapsed time includes that
    tail, so a phase is never credited with work it did not wait for.
    """
    latencies_s: list[float] = []
    deadline = time.perf_counter() + duration_s

    async def worker() -> int:
        done = 0
        while time.perf_counter() < deadline:
            latencies_s.append(await cycle())
            done += 1
        return done

    started_s, cpu_started_s = time.perf_counter(), time.process_time()
    counts = await asyncio.gather(*(worker() for _ in range(tasks)))
    return Phase(
        sum(counts),
        time.perf_counter() - started_s,
        time.process_time() - cpu_started_s,
        tuple(latencies_s),
    )
