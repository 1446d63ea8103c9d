"""Reconciliation with the providers' cost reports (core/reconcile.py): the admin route, and the
HTTP request that reads a report, which `ceiling reconcile` and the schedules use too.

    GET /v1/admin/reconcile?provider=<name>&from=YYYY-MM-DD&to=YYYY-MM-DD[&tolerance_pct=P]
        [&book_into=<budget_id>]

(`provider`: a name in core/reconcile.py COST_REPORTS, openai or anthropic) answers
`{"provider", "tolerance_pct", "days": [...], "within"}` with 200 whether or not every day is
within the tolerance (the answer says which are not; each such day has put one
`ledger.drift` alert event in the outbox). A report that cannot be read is an error answer.
With `book_into`, each day's spend beyond what the ledger saw is booked into that budget
(core/reconcile.py says how much), and the answer adds `book_into`, `booked_now_micros` and, per
day, `booked_micros` (so far) and `booked_now_micros` (by this run).

`GET /v1/admin/reconcile` with no parameter at all is the daily schedule's run (vercel.json's
cron, which calls a path with GET): every provider with an admin key set, over the default
range, one provider's failure apart from the other's, booking into CEILING_RECONCILE_BOOK_INTO if
it is set, answered as `{"providers": {name:
{"within", "days_beyond"} or {"error"}}, "within"}`. One cron for every provider: Vercel's Hobby
plan allows two, and alert delivery has the other.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse

from api.auth import admin
from api.routing import HotRoute, Query, query_of
from api.runtime import runtime
from core.budgets import BudgetId
from core.config import ConfigError
from core.errors import BudgetNotFound, CeilingError
from core.ledger import Upstream
from core.reconcile import (
    COST_REPORTS,
    REPORT_PAGE_BYTES_MAX,
    REPORT_TIMEOUT_S,
    Booking,
    Fetch,
    Reconciled,
    ReportSource,
    book_into_of,
    configured,
    failed,
    provider_of,
    reconcile,
    scheduled_book_into,
    tolerance_of,
)

PROVIDER, FIRST, LAST, TOLERANCE = Query("provider"), Query("from"), Query("to"), Query(
    "tolerance_pct")
BOOK_INTO = Query("book_into")
# Who the scheduled run's bookings are audited as when no operator called it (Lambda's schedule).
SCHEDULE_OPERATOR = "schedule"
LOG = logging.getLogger(__name__)


def http_fetch(client: httpx.AsyncClient, provider: Upstream) -> Fetch:
    """GET a page of `provider`'s report with `client`; no answer at all, or one larger than a
    report can be, is CostReportFailed."""

    async def fetch(url: str, params: Sequence[tuple[str, str]],
                    headers: Mapping[str, str]) -> tuple[int, bytes]:
        try:
            # No redirects: the admin key goes to the URL configured, nowhere else.
            async with client.stream("GET", url, params=list(params), headers=dict(headers),
                                     follow_redirects=False) as answer:
                body = bytearray()
                async for chunk in answer.aiter_bytes():
                    body += chunk
                    if len(body) > REPORT_PAGE_BYTES_MAX:
                        raise failed(provider, "malformed",
                                     f"a page larger than {REPORT_PAGE_BYTES_MAX} bytes")
                return answer.status_code, bytes(body)
        except httpx.HTTPError as exc:
            raise failed(provider, "unreachable", f"{type(exc).__name__}: {exc}") from exc

    return fetch


async def run_reconcile(provider: Upstream, first: str | None, last: str | None,
                        tolerance_pct: Decimal, env: Mapping[str, str] | None = None,
                        book_into: BudgetId | None = None, by: str = SCHEDULE_OPERATOR
                        ) -> Reconciled:
    """One reconciliation against the shared ledger: the route's, the CLI's, the schedule's;
    with `book_into`, booking unseen spend there, audited as made `by`."""
    source = ReportSource.from_env(provider, os.environ if env is None else env)
    booking = None if book_into is None else Booking(book_into, by)
    async with httpx.AsyncClient(timeout=REPORT_TIMEOUT_S) as client:
        return await reconcile(runtime().store(), source, first, last, tolerance_pct,
                               http_fetch(client, provider), booking)


async def reconcile_configured(env: Mapping[str, str] | None = None,
                               by: str = SCHEDULE_OPERATOR) -> dict[str, Any]:
    """A scheduled run: the default range for every provider with an admin key set, each
    provider's outcome (or its error) apart, so that one provider's failure leaves the other's
    run; unseen spend booked into CEILING_RECONCILE_BOOK_INTO when it is set. What a schedule
    without HTTP (Lambda's) calls."""
    env = os.environ if env is None else env
    outcomes: dict[str, Any] = {}
    # A setting that names no budget an operator can book into fails the booking, never the
    # drift check: each provider is compared (and its drift alerted) first.
    book_into: BudgetId | None = None
    setting_error: CeilingError | None = None
    try:
        book_into = scheduled_book_into(env)
    except ConfigError as exc:
        setting_error = exc
    for provider in COST_REPORTS:
        if not configured(provider, env):
            continue
        booking_error = setting_error
        try:
            try:
                done = await run_reconcile(provider, None, None, tolerance_of(None), env,
                                           book_into, by)
            except BudgetNotFound as exc:
                if book_into is None:
                    raise
                # The budget went since the setting named it: refused before the report was
                # read, so the comparison runs alone.
                booking_error = exc
                done = await run_reconcile(provider, None, None, tolerance_of(None), env,
                                           None, by)
            outcomes[provider] = {"within": done.within,
                                  "days_beyond": [d.day.isoformat() for d in done.beyond]}
            if done.book_into is not None:
                outcomes[provider].update(book_into=done.book_into,
                                          booked_now_micros=done.booked_now_micros)
            if done.booking_held:
                outcomes[provider]["booking_held"] = True
        except CeilingError as exc:
            outcomes[provider] = {"error": {"code": exc.code, "message": exc.message}}
            continue
        if booking_error is not None:
            LOG.error("reconcile %s: unseen spend was not booked: %s", provider,
                      booking_error.message)
            outcomes[provider]["booking_error"] = {"code": booking_error.code,
                                                   "message": booking_error.message}
    return outcomes


async def reconcile_route(request: Request) -> JSONResponse:
    """The ledger's gateway spend per UTC day against `provider`'s cost report; by default the
    week up to yesterday, at a tolerance of 1%. Without `provider`, the schedule's run
    (reconcile_configured): every provider with an admin key, over the default range."""
    by = admin(request)
    runtime().enforcing()  # the ledger is required, as on every admin route
    provider, first, last, tolerance_pct, book_into = (
        query_of(request, q) for q in (PROVIDER, FIRST, LAST, TOLERANCE, BOOK_INTO))
    if (provider is None and first is None and last is None and tolerance_pct is None
            and book_into is None):
        outcomes = await reconcile_configured(by=by)
        answer: dict[str, Any] = {"providers": outcomes, "within": all(
            o.get("within") is True for o in outcomes.values())}
        if any("booking_error" in o for o in outcomes.values()):
            answer["booking_failed"] = True
        return JSONResponse(answer)
    done = await run_reconcile(provider_of(provider), first, last, tolerance_of(tolerance_pct),
                               book_into=book_into_of(book_into), by=by)
    return JSONResponse(done.json())


ROUTES = (HotRoute("/v1/admin/reconcile", reconcile_route, ("GET",), admin=True,
                   query=(PROVIDER, FIRST, LAST, TOLERANCE, BOOK_INTO)),)
