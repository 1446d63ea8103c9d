"""Reconciliation with the providers' cost reports (core/reconcile.py): the admin route, and the
HTTP request that reads a report, which `ceiling reconcile` and the schedules use too.

    GET /v1/admin/reconcile?provider=<name>&from=YYYY-MM-DD&to=YYYY-MM-DD[&tolerance_pct=P]

(`provider`: a name in core/reconcile.py COST_REPORTS, openai or anthropic) answers
`{"provider", "tolerance_pct", "days": [...], "within"}` with 200 whether or not every day is
within the tolerance (the answer says which are not; each such day has put one
`ledger.drift` alert event in the outbox). A report that cannot be read is an error answer.

`GET /v1/admin/reconcile` with no parameter at all is the daily schedule's run (vercel.json's
cron, which calls a path with GET): every provider with an admin key set, over the default
range, one provider's failure apart from the other's, answered as `{"providers": {name:
{"within", "days_beyond"} or {"error"}}, "within"}`. One cron for every provider: Vercel's Hobby
plan allows two, and alert delivery has the other.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Annotated, Any

import httpx
from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from api.routes.admin import Admin, Service
from api.runtime import runtime
from core.errors import CeilingError
from core.ledger import Upstream
from core.reconcile import (
    COST_REPORTS,
    REPORT_PAGE_BYTES_MAX,
    REPORT_TIMEOUT_S,
    Fetch,
    Reconciled,
    ReportSource,
    configured,
    failed,
    provider_of,
    reconcile,
    tolerance_of,
)

router = APIRouter()


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
                        tolerance_pct: Decimal, env: Mapping[str, str] | None = None
                        ) -> Reconciled:
    """One reconciliation against the shared ledger: the route's, the CLI's, the schedule's."""
    source = ReportSource.from_env(provider, os.environ if env is None else env)
    async with httpx.AsyncClient(timeout=REPORT_TIMEOUT_S) as client:
        return await reconcile(runtime().store(), source, first, last, tolerance_pct,
                               http_fetch(client, provider))


async def reconcile_configured(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A scheduled run: the default range for every provider with an admin key set, each
    provider's outcome (or its error) apart, so that one provider's failure leaves the other's
    run. What a schedule without HTTP (Lambda's) calls."""
    env = os.environ if env is None else env
    outcomes: dict[str, Any] = {}
    for provider in COST_REPORTS:
        if not configured(provider, env):
            continue
        try:
            done = await run_reconcile(provider, None, None, tolerance_of(None), env)
            outcomes[provider] = {"within": done.within,
                                  "days_beyond": [d.day.isoformat() for d in done.beyond]}
        except CeilingError as exc:
            outcomes[provider] = {"error": {"code": exc.code, "message": exc.message}}
    return outcomes


@router.get("/v1/admin/reconcile")
async def reconcile_route(
    _: Admin, svc: Service, provider: str | None = None,
    first: Annotated[str | None, Query(alias="from")] = None,
    last: Annotated[str | None, Query(alias="to")] = None,
    tolerance_pct: str | None = None,
) -> JSONResponse:
    """The ledger's gateway spend per UTC day against `provider`'s cost report; by default the
    week up to yesterday, at a tolerance of 1%. Without `provider`, the schedule's run
    (reconcile_configured): every provider with an admin key, over the default range."""
    if provider is None and first is None and last is None and tolerance_pct is None:
        outcomes = await reconcile_configured()
        return JSONResponse({"providers": outcomes, "within": all(
            o.get("within") is True for o in outcomes.values())})
    done = await run_reconcile(provider_of(provider), first, last, tolerance_of(tolerance_pct))
    return JSONResponse(done.json())
