"""Alerts and spend: the alert log and the scheduler's delivery trigger (admin), a
budget's resume after a velocity pause (admin), and a key holder's own spend series."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from api.alerts import deliver_once
from api.auth import authenticated
from api.routes.admin import Admin, Operator, Ops, Service
from api.runtime import runtime
from api.views import leg_json
from core import spend
from core.budgets import BudgetId
from core.errors import InvalidRequest

router = APIRouter()

# The only query parameter GET /v1/usage/me reads: anything else (a budget id, a key, a run)
# is refused, so a caller cannot believe it asked for someone else's series and got it.
USAGE_QUERY = frozenset({"hours"})


@router.get("/v1/admin/alerts")
async def alerts(_: Admin, svc: Service) -> JSONResponse:
    config = runtime().config
    return JSONResponse({
        "webhook_configured": bool(config and config.alert_webhook_url),
        "alerts": [e.json() for e in await spend.alert_log(runtime().store())],
    })


@router.post("/v1/admin/alerts/deliver")
async def deliver(_: Admin, svc: Service) -> JSONResponse:
    """One delivery pass over every outbox: what a scheduler triggers."""
    return await _deliver()


# GET as well: Vercel's crons call their path with GET (and the bearer CRON_SECRET, which the
# deployment sets to the admin token).
@router.get("/v1/admin/alerts/deliver")
async def deliver_from_cron(_: Admin, svc: Service) -> JSONResponse:
    return await _deliver()


async def _deliver() -> JSONResponse:
    report = await deliver_once()
    if report is None:
        return JSONResponse({"webhook_configured": False, "delivered": 0, "retried": 0,
                             "failed": 0})
    return JSONResponse({"webhook_configured": True, **report.json()})


@router.post("/v1/admin/budgets/{budget_id:path}/resume")
async def resume(budget_id: str, by: Operator, ops: Ops) -> JSONResponse:
    """Lift the pause a velocity alarm put on a budget (recorded in the audit log)."""
    return JSONResponse(await ops.resume(BudgetId.parse(budget_id), by))


def report_json(r: spend.BudgetReport) -> dict[str, Any]:
    return {
        "budget_id": r.budget_id,
        "paused": bool(r.definition and r.definition.paused_at_ms is not None),
        "periods": [leg_json(x) for x in r.legs],
        "series": [{"hour_start_ms": p.hour_start_ms, "committed_micros": p.committed_micros}
                   for p in r.series],
    }


@router.get("/v1/usage/me")
async def usage_me(request: Request) -> JSONResponse:
    """The caller's own budgets (its key's budget and the scopes above it), each with its
    periods and hourly spend: the key decides whose, never a parameter."""
    _, who = await authenticated(request, None)
    asked = set(request.query_params) - USAGE_QUERY
    if asked:
        raise InvalidRequest(
            f"GET /v1/usage/me shows the calling key's own budgets; it takes only 'hours', not "
            f"{sorted(asked)}", field=sorted(asked)[0])
    hours = spend.check_hours(request.query_params.get("hours"))
    reports = await spend.usage(runtime().store(), who.key.budget_id, hours)
    return JSONResponse({"budget_id": who.key.budget_id.path, "hours": hours,
                         "budgets": [report_json(r) for r in reports]})
