"""Where the money goes: the reads behind GET /dashboard and GET /v1/usage/me.

Framework-free: the routes render what these return. Everything here reads the ledger (status,
the hourly spend buckets, the alert log, open leases and the runs they hold in, the keys bound
to a budget, the probe) and writes nothing but what a probe writes; none of it is on a call's
path, and every list is bounded by a named constant below, the rest counted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from core.alerts import AlertEvent
from core.budgets import BudgetDef, BudgetId
from core.errors import InvalidRequest
from core.ledger import (
    AlertOutbox,
    BudgetCatalogue,
    Health,
    KeyInfo,
    KeyListing,
    Ledger,
    LegStatus,
    OpenLeases,
    Probe,
    RunLimit,
    RunSpend,
)
from core.limits import SPEND_BUCKET_MS, SPEND_BUCKET_RETENTION_MS
from core.text import whole_number

# The chart's span by default, and the longest a caller may ask for: the buckets' retention.
SERIES_HOURS_DEFAULT = 48
SERIES_HOURS_MAX = SPEND_BUCKET_RETENTION_MS // SPEND_BUCKET_MS
# Alert events the page and GET /v1/admin/alerts show per tag, newest first.
ALERT_LOG_LIMIT = 200
# Budgets the page lists: a page that renders, not an export (GET /v1/admin/budgets pages).
PAGE_BUDGETS_MAX = 500
# Budgets the page reads at once. Each read is a few ledger calls on the instance's connections,
# which the calls it serves need too; and a call queued behind hundreds of the page's reads would
# wait out its own time bound and fail the page.
PAGE_READS_IN_FLIGHT_MAX = 4
# Budgets ranked by the chart span's spend under "top spenders".
TOP_SPENDERS_MAX = 10
# Open reservations listed per organisation (tag) of each kind, past their lease and within it,
# the earliest lease end first: the ones an operator acts on; the rest are counted.
RESERVATIONS_LISTED_MAX = 20
# Open reservations per organisation whose runs are read, those with the latest lease ends (the
# most recent calls, for calls of one lease length): a run with a call in flight is among them
# unless hundreds of calls are open at once. The read is one
# script (lua/open_listing.lua), which holds the ledger while it reads each of them, so this
# bounds how long a page load can make a reserve wait.
RUNS_EXAMINED_MAX = 200
# Live runs listed, by committed spend.
TOP_RUNS_MAX = 10
# Keys listed per top-spending budget (the rest counted): a page, not the key list
# (GET /v1/admin/keys?budget_id= pages through all of them).
KEYS_LISTED_MAX = 10


@dataclass(frozen=True)
class SpendPoint:
    hour_start_ms: int
    committed_micros: int


@dataclass(frozen=True)
class BudgetReport:
    budget_id: str
    definition: BudgetDef | None
    legs: tuple[LegStatus, ...]
    series: tuple[SpendPoint, ...]

    @property
    def series_micros(self) -> int:
        return sum(p.committed_micros for p in self.series)


@dataclass(frozen=True)
class BudgetKeys:
    """The API keys bound to one budget (never a secret or its hash): a key spends its budget's
    money and its ancestors', and is not charged apart from them. `more`: keys beyond those
    listed."""

    budget_id: str
    keys: tuple[KeyInfo, ...]
    more: bool


@dataclass(frozen=True)
class Overview:
    """`keys` is None where the ledger keeps no key catalogue (the in-memory ledger)."""

    now_ms: int
    hours: int
    budgets: tuple[BudgetReport, ...]
    alerts: tuple[AlertEvent, ...]
    leases: tuple[OpenLeases, ...]
    probe: Probe
    keys: tuple[BudgetKeys, ...] | None = None

    @property
    def top_spenders(self) -> tuple[BudgetReport, ...]:
        return top_spenders(self.budgets)

    @property
    def top_runs(self) -> tuple[RunSpend, ...]:
        """The live runs (a call of theirs open now) with the most committed spend."""
        runs = [r for t in self.leases for r in t.runs]
        ranked = sorted(runs, key=lambda r: (-r.committed_micros, r.budget_id))
        return tuple(ranked[:TOP_RUNS_MAX])


def top_spenders(budgets: Sequence[BudgetReport]) -> tuple[BudgetReport, ...]:
    ranked = sorted((b for b in budgets if b.series_micros > 0),
                    key=lambda b: (-b.series_micros, b.budget_id))
    return tuple(ranked[:TOP_SPENDERS_MAX])



class SpendReads(Ledger, BudgetCatalogue, AlertOutbox, Health, Protocol):
    """What the spend page reads of a store: budgets and their windows, the hourly spend and the
    alert log, open leases, and the probe."""

def check_hours(raw: object) -> int:
    if raw is None:
        return SERIES_HOURS_DEFAULT
    hours = whole_number(raw, len(str(SERIES_HOURS_MAX))) if isinstance(raw, str) else None
    if hours is None or not 1 <= hours <= SERIES_HOURS_MAX:
        raise InvalidRequest(f"hours must be a whole number from 1 to {SERIES_HOURS_MAX}",
                             field="hours")
    return hours


async def _series(store: AlertOutbox, budget_id: BudgetId, now_ms: int, hours: int
                  ) -> tuple[SpendPoint, ...]:
    to_hour = now_ms // SPEND_BUCKET_MS
    found = await store.spend_series(budget_id, to_hour - hours + 1, to_hour)
    return tuple(SpendPoint(h * SPEND_BUCKET_MS, m) for h, m in found)


async def budget_report(store: SpendReads, budget_id: BudgetId, now_ms: int, hours: int,
                        run: RunLimit | None = None) -> BudgetReport:
    definition = await store.get_budget(budget_id)
    legs = await store.status((budget_id,), run) if definition or run else ()
    return BudgetReport(budget_id.path, definition, legs,
                        await _series(store, budget_id, now_ms, hours))


async def usage(store: SpendReads, budget_id: BudgetId, hours: int) -> list[BudgetReport]:
    """A key holder's own budgets (its budget and the scopes above it that have one, as
    GET /v1/budgets/me shows them), with their spend series: nothing the key is not charged
    against."""
    now_ms = await store.ledger_time_ms()
    reports = [await budget_report(store, b, now_ms, hours) for b in budget_id.lineage]
    return [r for r in reports if r.definition is not None]


async def alert_log(store: AlertOutbox, limit: int = ALERT_LOG_LIMIT) -> list[AlertEvent]:
    """Every tag's events, newest first."""
    events: list[AlertEvent] = []
    for tag in await store.alert_tags():
        events += await store.alert_log(tag, limit)
    return sorted(events, key=lambda e: (e.at_ms, e.event_id), reverse=True)[:limit]


async def keys_of(catalogue: KeyListing, budgets: Sequence[BudgetReport]
                  ) -> tuple[BudgetKeys, ...]:
    """The keys bound to each of `budgets` (to it, not to a scope below it), KEYS_LISTED_MAX
    each."""
    out = []
    for b in budgets:
        found = await catalogue.keys_of(b.budget_id, None, KEYS_LISTED_MAX + 1)
        out.append(BudgetKeys(b.budget_id, tuple(found[:KEYS_LISTED_MAX]),
                              len(found) > KEYS_LISTED_MAX))
    return tuple(out)


async def overview(store: SpendReads, instance_id: str, hours: int,
                   catalogue: KeyListing | None = None) -> Overview:
    """What the spend page shows: every budget with its periods and spend series, the alert log,
    open and overdue reservations per tag with the live runs they hold in, the keys of the top
    spenders (from `catalogue`, where the ledger keeps one), and the ledger's health with the
    instances it has seen."""
    now_ms = await store.ledger_time_ms()
    tags = await store.alert_tags()
    ids: list[str] = []
    for tag in tags:
        ids += await store.budgets_of(tag)
    in_flight = asyncio.Semaphore(PAGE_READS_IN_FLIGHT_MAX)

    async def report(budget_id: str) -> BudgetReport:
        async with in_flight:
            return await budget_report(store, BudgetId(budget_id), now_ms, hours)

    reports = await asyncio.gather(*(report(b) for b in ids[:PAGE_BUDGETS_MAX]))
    leases = [await store.open_listing(t, RESERVATIONS_LISTED_MAX, RUNS_EXAMINED_MAX)
              for t in tags]
    keys = None if catalogue is None else await keys_of(catalogue, top_spenders(reports))
    return Overview(now_ms, hours, tuple(reports), tuple(await alert_log(store)),
                    tuple(leases), await store.probe(instance_id), keys)
