"""Alerts: the alert log and the scheduler's delivery trigger (admin), and a budget's resume
after a velocity pause (admin). A key holder's own spend series is a hot route
(api/routes/sidecar.py usage_me)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse

from api.alerts import deliver_once
from api.auth import admin
from api.routing import HotRoute
from api.runtime import runtime
from core import spend
from core.budgets import BudgetId


async def alerts(request: Request) -> JSONResponse:
    admin(request)
    runtime().enforcing()  # the ledger is required, as on every admin route
    config = runtime().config
    return JSONResponse({
        "webhook_configured": bool(config and config.alert_webhook_url),
        "alerts": [e.json() for e in await spend.alert_log(runtime().store())],
    })


async def deliver(request: Request) -> JSONResponse:
    """One delivery pass over every outbox: what a scheduler triggers."""
    admin(request)
    runtime().enforcing()
    report = await deliver_once()
    if report is None:
        return JSONResponse({"webhook_configured": False, "delivered": 0, "retried": 0,
                             "failed": 0})
    return JSONResponse({"webhook_configured": True, **report.json()})


async def deliver_from_cron(request: Request) -> JSONResponse:
    return await deliver(request)


async def resume(request: Request) -> JSONResponse:
    """Lift the pause a velocity alarm put on a budget (recorded in the audit log)."""
    by = admin(request)
    ops = runtime().operations()
    return JSONResponse(await ops.resume(BudgetId.parse(request.path_params["budget_id"]), by))


ROUTES = (
    HotRoute("/v1/admin/alerts", alerts, ("GET",), admin=True),
    HotRoute("/v1/admin/alerts/deliver", deliver, admin=True),
    # GET as well: Vercel's crons call their path with GET (and the bearer CRON_SECRET, which
    # the deployment sets to the admin token).
    HotRoute("/v1/admin/alerts/deliver", deliver_from_cron, ("GET",), admin=True),
    HotRoute("/v1/admin/budgets/{budget_id:path}/resume", resume, admin=True),
)
