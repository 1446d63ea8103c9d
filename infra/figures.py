"""Figures as the harnesses print them: nearest-rank percentiles, medians, aligned tables.

Shared by the benchmarks (bench/), the demo and the reliability tests, which report what they
measured the same way.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


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
