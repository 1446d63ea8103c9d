"""AWS Lambda's entry point: the same app behind mangum.

Lifespan is off: mangum would run start-up and shutdown on every invocation. Nothing needs
them: the runtime (config, Redis pool) is made on the first request and kept while the
instance is warm.
"""

from typing import Any

from mangum import Mangum

from api.index import app

_http = Mangum(app, lifespan="off")
# What EventBridge's scheduled events carry as their source (serverless.yml `schedule`).
SCHEDULE_SOURCE = "aws.events"
# The daily reconciliation's schedule sends this as its event's input (serverless.yml).
RECONCILE_TASK = "reconcile"


def deliver_alerts() -> dict[str, object]:
    """One alert delivery pass, for the schedule of serverless.yml."""
    import asyncio

    from api.alerts import deliver_once

    report = asyncio.run(deliver_once())
    return {"webhook_configured": report is not None, **(report.json() if report else {})}


def reconcile_providers() -> dict[str, object]:
    """The daily reconciliation of every provider with an admin key (core/reconcile.py)."""
    import asyncio

    from api.routes.reconcile import reconcile_configured

    return asyncio.run(reconcile_configured())


def _dispatch(event: Any, context: Any) -> Any:
    """HTTP events go to the app; the schedules' events run an alert delivery pass or the daily
    reconciliation."""
    if isinstance(event, dict) and event.get("task") == RECONCILE_TASK:
        return reconcile_providers()
    if isinstance(event, dict) and event.get("source") == SCHEDULE_SOURCE:
        return deliver_alerts()
    return _http(event, context)


handler = _dispatch
