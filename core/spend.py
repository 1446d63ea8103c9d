"""Where the money goes: the reads behind GET /dashboard and GET /v1/usage/me.

Framework-free: the routes render what these return. Everything here reads the ledger (status,
the hourly spend buckets, the alert log, open leases and the runs they hold in, the keys bound
to a budget, a budget's end users, the probe) and writes nothing but what a probe writes; none
of it is on a call's path, and every list is bounded by a named constant below, the rest
counted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from core.alerts import AlertEvent
from core.budgets import ALL_MODELS, MODEL_SCOPE_KIND, BudgetDef, BudgetId, Period
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
    UserSpend,
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
# End users listed per budget with per_user limits, by committed spend: a page, not the users
# list (GET /v1/admin/budgets/{id}/users pages through all of them).
TOP_USERS_MAX = 10
# End users whose spend the page reads, per budget and on the whole page: each is a status read
# of its own, and a budget may count far more users (its users_max) while the ledger keeps no
# index of them by spend. The page ranks the first of them by id, and counts the rest.
USERS_EXAMINED_PER_BUDGET_MAX = 1_000
USERS_EXAMINED_PAGE_MAX = 2_000
# The period end users are ranked by: the shortest their budget's per_user limits have (its
# current window: who spends now), the first of these that they have.
USERS_RANKED_BY = (Period.DAY, Period.WEEK, Period.MONTH, Period.TOTAL)


@dataclass(frozen=True)
class SpendPoint:
    hour_start_ms: int
    committed_micros: int


@dataclass(frozen=True)
class ModelSpend:
    """A budget's calls of one model of its per_model limits: the legs of
    '<budget>/model:<model>' (BudgetId.model) in its current windows. A call of the model is
    charged to both, so each figure here is also in its budget's."""

    model: str
    legs: tuple[LegStatus, ...]


@dataclass(frozen=True)
class BudgetReport:
    budget_id: str
    definition: BudgetDef | None
    legs: tuple[LegStatus, ...]
    series: tuple[SpendPoint, ...]
    # Its per_model limits' legs, by model in the definition's order: read in the same status
    # read as `legs`, so the figures are of one instant.
    models: tuple[ModelSpend, ...] = ()

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
class BudgetUsers:
    """The end users of one budget with per_user limits who committed the most in the current
    window of `period`, TOP_USERS_MAX at most, among the `examined` first by id of the
    `users_count` it counts (None: not read, the page's reads of users were spent). Each user's
    spend is also its budget's: a call of a user is charged to both."""

    budget_id: str
    period: Period
    top: tuple[UserSpend, ...]
    users_count: int | None
    examined: int


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
    users: tuple[BudgetUsers, ...] = ()

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
    """What the spend page reads of a store: budgets and their windows, their end users, the
    hourly spend and the alert log, open leases, and the probe."""


def committed_in(user: UserSpend, period: Period) -> int:
    """A user's committed spend in the current window of `period` (0 without such a leg)."""
    return next((leg.committed_micros for leg in user.legs if leg.period is period), 0)


async def top_users(store: BudgetCatalogue, budgets: Sequence[BudgetReport]
                    ) -> tuple[BudgetUsers, ...]:
    """The top end users of each of `budgets` that has per_user limits, in their order: the
    first USERS_EXAMINED_PER_BUDGET_MAX users of each by id read, USERS_EXAMINED_PAGE_MAX in
    all, and of those read the TOP_USERS_MAX with the most committed spend in the budget's
    ranking period (USERS_RANKED_BY); a user with none in it is not listed."""
    out = []
    left = USERS_EXAMINED_PAGE_MAX
    for b in budgets:
        per_user = b.definition.per_user if b.definition else None
        if per_user is None:
            continue
        limited = {lim.period for lim in per_user.limits}
        period = next(p for p in USERS_RANKED_BY if p in limited)
        count = min(USERS_EXAMINED_PER_BUDGET_MAX, left)
        if count == 0:
            out.append(BudgetUsers(b.budget_id, period, (), None, 0))
            continue
        page = await store.users_of(BudgetId(b.budget_id), None, count)
        left -= len(page.users)
        ranked = sorted((u for u in page.users if committed_in(u, period) > 0),
                        key=lambda u: (-committed_in(u, period), u.user))
        out.append(BudgetUsers(b.budget_id, period, tuple(ranked[:TOP_USERS_MAX]),
                               page.users_count, len(page.users)))
    return tuple(out)


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


def by_model(budget_id: str, legs: Sequence[LegStatus]
             ) -> tuple[tuple[LegStatus, ...], tuple[ModelSpend, ...]]:
    """A status read of ALL_MODELS split in two: the legs of every budget but the models'
    (in their order), and each model's legs of `budget_id` ('<budget_id>/model:<model>'), in
    the order the read gave them (its definition's, which sorts them)."""
    marker = f"{budget_id}/{MODEL_SCOPE_KIND}:"
    own: list[LegStatus] = []
    models: dict[str, list[LegStatus]] = {}
    for leg in legs:
        if leg.budget_id.startswith(marker):
            models.setdefault(leg.budget_id.removeprefix(marker), []).append(leg)
        else:
            own.append(leg)
    return tuple(own), tuple(ModelSpend(m, tuple(x)) for m, x in models.items())


async def budget_now(store: Ledger, budget_id: BudgetId, definition: BudgetDef,
                     run: RunLimit | None = None
                     ) -> tuple[tuple[LegStatus, ...], tuple[ModelSpend, ...]]:
    """A budget's legs in its current windows and those of each model its per_model limits
    name, in one status read (so that a model's committed spend is within its budget's)."""
    if not definition.per_model:
        return await store.status((budget_id,), run), ()
    return by_model(budget_id.path, await store.status((budget_id,), run, model=ALL_MODELS))


class BudgetReads(Ledger, BudgetCatalogue, Protocol):
    """What a budget's reading reads: its definition and its windows."""


BudgetReading = tuple[BudgetDef, tuple[LegStatus, ...], tuple[ModelSpend, ...]]


async def budget_reading(store: BudgetReads, budget_id: BudgetId) -> BudgetReading | None:
    """What GET /v1/admin/budgets/{id} and `ceiling budgets show` show of a budget: its
    definition, its legs and its models' (budget_now); None for no such budget."""
    definition = await store.get_budget(budget_id)
    if definition is None:
        return None
    return (definition, *await budget_now(store, budget_id, definition))


async def budget_report(store: SpendReads, budget_id: BudgetId, now_ms: int, hours: int,
                        run: RunLimit | None = None) -> BudgetReport:
    definition = await store.get_budget(budget_id)
    legs: tuple[LegStatus, ...] = ()
    models: tuple[ModelSpend, ...] = ()
    if definition is not None:
        legs, models = await budget_now(store, budget_id, definition, run)
    elif run is not None:
        legs = await store.status((budget_id,), run)
    return BudgetReport(budget_id.path, definition, legs,
                        await _series(store, budget_id, now_ms, hours), models)


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
    spenders (from `catalogue`, where the ledger keeps one), the top end users of the budgets
    with per_user limits, and the ledger's health with the instances it has seen."""
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
    users = await top_users(store, reports)
    return Overview(now_ms, hours, tuple(reports), tuple(await alert_log(store)),
                    tuple(leases), await store.probe(instance_id), keys, users)
