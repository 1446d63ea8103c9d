"""Alerts: the alert log and the scheduler's delivery trigger (admin), and a budget's resume
after a velocity pause (admin). A key holder's own spend series is a hot route
(api/routes/sidecar.py usage_me)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from api.alerts import deliver_once
from api.routes.admin import Admin, Operator, Ops, Service
from api.runtime import runtime
from core import spend
from core.budgets import BudgetId

router = APIRouter()


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
