"""What GET /metrics shows of the shared ledger, read when it is scraped.

Serverless instances come and go and are not scraped one by one, so every figure but one is the
ledger's, not the instance's: any instance answers for the whole ledger. Per budget and period,
the ceiling, committed and reserved micro-dollars of its current window, and the same of each
model its per_model limits name (core/budgets.py ModelLimits); the refusals the
ledger's scripts decided, by code; whether the ledger answers. The one figure of this instance
is the latency of its own ledger calls, which the caller keeps (api/routes/metrics.py); this
module times the calls a scrape makes.

Cardinality is bounded: at most `budgets_max` budgets are shown (CEILING_METRICS_BUDGETS_MAX),
those with the largest committed spend in any of their periods, ties by id, each with its
models' windows (at most PER_MODEL_MAX models of four periods each). Ranking them reads
every budget's windows, up to BUDGETS_SCANNED_MAX budgets in id order; a ledger with more
ranks the first of them only.

Framework-free: it returns plain data, which the route renders in Prometheus' format.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from core.budgets import ALL_MODELS, BudgetId
from core.config import ConfigError
from core.errors import CeilingError
from core.ledger import Health, Ledger, LegStatus, Probe, Reconciliation
from core.spend import by_model
from core.text import whole_number

# Budgets a scrape shows unless CEILING_METRICS_BUDGETS_MAX says otherwise: each is a handful
# of series per period, and a thousand budgets is a few thousand series, which a Prometheus
# takes without noticing.
METRICS_BUDGETS_MAX_DEFAULT = 1_000
# Budgets one scrape reads to rank them: each is one ledger call and its reply's parsing on the
# instance's CPU, and past this many a scrape on one core outlasts Prometheus' default scrape
# timeout.
BUDGETS_SCANNED_MAX = 20_000
# The most CEILING_METRICS_BUDGETS_MAX may ask for: no more than a scrape reads.
METRICS_BUDGETS_MAX_LIMIT = BUDGETS_SCANNED_MAX
# Budget ids read from the catalogue's index at a time (core/operations.py PAGE_SIZE_MAX).
INDEX_PAGE_BUDGETS = 1_000
# Status reads a scrape has in flight at once: they share the instance's ledger connection with
# the calls it serves, and a call queued behind a scrape's thousands of reads would wait.
SCRAPE_READS_IN_FLIGHT_MAX = 4


@dataclass(frozen=True)
class MetricsSettings:
    """Who may scrape (CEILING_METRICS_TOKEN, else the admin token) and how many budgets are
    shown."""

    token: str | None
    budgets_max: int = METRICS_BUDGETS_MAX_DEFAULT


def settings_from_env(env: Mapping[str, str]) -> MetricsSettings:
    raw = env.get("CEILING_METRICS_BUDGETS_MAX", "").strip()
    budgets_max = METRICS_BUDGETS_MAX_DEFAULT
    if raw:
        found = whole_number(raw, len(str(METRICS_BUDGETS_MAX_LIMIT)))
        if found is None or not 0 <= found <= METRICS_BUDGETS_MAX_LIMIT:
            raise ConfigError(f"CEILING_METRICS_BUDGETS_MAX must be a whole number from 0 to "
                              f"{METRICS_BUDGETS_MAX_LIMIT}")
        budgets_max = found
    return MetricsSettings(env.get("CEILING_METRICS_TOKEN") or None, budgets_max)


class BudgetIndex(Protocol):
    """The catalogue's index of budget ids (core/operations.py Catalogue)."""

    async def budget_ids(self, prefix: str, after: str | None, count: int) -> list[str]: ...


class LedgerReads(Ledger, Health, Reconciliation, Protocol):
    """What a scrape reads of a store: the probe, budgets' windows, the refusal counters."""


@dataclass(frozen=True)
class BudgetPeriod:
    """One budget's current window of one period; with `model`, that of the budget's calls of
    one model of its per_model limits (a model's spend is also its budget's)."""

    budget_id: str
    period: str
    ceiling_micros: int
    committed_micros: int
    reserved_micros: int
    model: str | None = None


@dataclass(frozen=True)
class LedgerReading:
    """One scrape's read of the ledger. `error`: the read that failed (the ledger went away
    mid-scrape), after which nothing else was read; `budgets_seen`: how many budgets were
    ranked; `call_latencies_s`: each ledger call the scrape made, timed."""

    probe: Probe
    budgets: tuple[BudgetPeriod, ...] = ()
    budgets_seen: int = 0
    refusals: dict[str, int] = field(default_factory=dict)
    call_latencies_s: tuple[float, ...] = ()
    error: str | None = None


def _ranked(legs: tuple[LegStatus, ...]) -> int:
    """A budget's rank: its own legs' (the first's budget id), not its models'."""
    return max((leg.committed_micros for leg in legs if leg.budget_id == legs[0].budget_id),
               default=0)


def _periods(legs: tuple[LegStatus, ...]) -> list[BudgetPeriod]:
    """A budget's windows, then its models' (a status read of ALL_MODELS, split by by_model)."""
    if not legs:
        return []
    own, models = by_model(legs[0].budget_id, legs)
    return [*(BudgetPeriod(leg.budget_id, str(leg.period), leg.ceiling_micros,
                           leg.committed_micros, leg.reserved_micros) for leg in own),
            *(BudgetPeriod(legs[0].budget_id, str(leg.period), leg.ceiling_micros,
                           leg.committed_micros, leg.reserved_micros, m.model)
              for m in models for leg in m.legs)]


async def top_budgets(store: Ledger, index: BudgetIndex, budgets_max: int,
                      timed: Callable[[float], None]) -> tuple[list[tuple[LegStatus, ...]], int]:
    """The windows of the `budgets_max` budgets with the largest committed spend, largest first
    (ties by id), and how many budgets were read."""
    # A min-heap of the largest so far, keyed (committed, -order): the first out is the smallest
    # spend and, among equal ones, the latest id, so ties keep the earlier ids.
    heap: list[tuple[int, int, tuple[LegStatus, ...]]] = []
    in_flight = asyncio.Semaphore(SCRAPE_READS_IN_FLIGHT_MAX)

    async def status(budget_id: str) -> tuple[LegStatus, ...]:
        async with in_flight:
            started = time.perf_counter()
            # Its models' legs too: a budget without per_model reads nothing more for it.
            legs = await store.status((BudgetId(budget_id),), model=ALL_MODELS)
            timed(time.perf_counter() - started)
            return legs

    seen = 0
    after: str | None = None
    while seen < BUDGETS_SCANNED_MAX:
        count = min(INDEX_PAGE_BUDGETS, BUDGETS_SCANNED_MAX - seen)
        started = time.perf_counter()
        ids = await index.budget_ids("", after, count)
        timed(time.perf_counter() - started)
        for legs in await asyncio.gather(*(status(b) for b in ids)):
            seen += 1
            if not legs or not budgets_max:
                continue
            item = (_ranked(legs), -seen, legs)
            if len(heap) < budgets_max:
                heapq.heappush(heap, item)
            elif item[:2] > heap[0][:2]:
                heapq.heapreplace(heap, item)
        if len(ids) < count:
            break
        after = ids[-1]
    return [legs for _, _, legs in sorted(heap, reverse=True)], seen


async def read_ledger(store: LedgerReads, index: BudgetIndex | None, instance_id: str,
                      budgets_max: int) -> LedgerReading:
    """The ledger as a scrape shows it. Never raises for the ledger's sake: a ledger that does
    not answer is a probe that says so and no budgets, which the scrape shows as down."""
    latencies: list[float] = []
    probe = await store.probe(instance_id)
    if probe.latency_ms is not None:
        latencies.append(probe.latency_ms / 1000)
    if not probe.reachable:
        return LedgerReading(probe, call_latencies_s=tuple(latencies))
    try:
        started = time.perf_counter()
        refusals = await store.refusal_counts()
        latencies.append(time.perf_counter() - started)
        tops, seen = ([], 0) if index is None else await top_budgets(
            store, index, budgets_max, latencies.append)
    except CeilingError as exc:
        return LedgerReading(probe, call_latencies_s=tuple(latencies), error=exc.code)
    budgets = tuple(p for legs in tops for p in _periods(legs))
    return LedgerReading(probe, budgets, seen, refusals, tuple(latencies))
