"""What every benchmark in bench/ shares: phases of concurrent tasks, percentiles, one table.

A benchmark is not a test: it prints what it measured and a PASS/FAIL against its target, and
exits 0 either way unless something errored.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
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


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank percentile (q in [0, 100]): always a value that was measured."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.3f}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns aligned on their widest cell; the first column left, the others right."""
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        out = [str(cells[0]).ljust(widths[0])]
        out += [str(c).rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join(out).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(r) for r in rows)])
