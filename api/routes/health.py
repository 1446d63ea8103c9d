"""Health for uptime monitors: 200 only when `ok`. It never raises: a failing ledger shows in
the body, with 503.

Hot routes (api/routing.py), as reserve and the gateway are: a monitor polling a new serverless
instance, or a fleet waiting for its instances, does not make it build the admin surface."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from api.auth import bearer
from api.routing import HotRoute
from api.runtime import VERSION, is_admin_token, runtime

# Budgets with outage_policy `open` that health names: enough for an operator to see which, and a
# bounded body for a monitor polling it.
OPEN_BUDGETS_LISTED_MAX = 100

# Reasons that mean this instance cannot enforce at all (as opposed to enforcing with a caveat).
# A ledger that went back in time is refused until an operator adopts it, and one with fewer
# replicas than reserves must wait for refuses every reserve: down, not degraded.
DOWN_REASONS = frozenset({"ledger_unreachable", "ledger_reset", "ledger_error", "ledger_auth",
                          "invalid_configuration", "ledger_rolled_back",
                          "ledger_not_replicated"})
# What anyone may read: whether to page, and why. The ledger's and the instances' ids, latency
# and counts help whoever maps a deployment, so they go to the admin token's holder only.
PUBLIC_FIELDS = ("status", "reasons")


async def health_body(operator: bool = True) -> dict[str, Any]:
    """`operator`: the caller showed the admin token (or is the CLI): the whole body, open
    budgets by name; anyone else: status and reasons (PUBLIC_FIELDS)."""
    body = await _health_body(operator)
    return body if operator else {name: body[name] for name in PUBLIC_FIELDS}


async def _health_body(operator: bool) -> dict[str, Any]:
    rt = runtime()
    body: dict[str, Any] = {
        "status": "down",
        "reasons": [],
        "ledger": {"backend": None, "shared": False, "reachable": False, "latency_ms": None,
                   "ledger_id": None},
        "single_replica": bool(rt.config and rt.config.single_replica),
        "instance_id": rt.instance_id,
        "version": VERSION,
        "instances_seen": None,
    }
    if rt.service is None:
        problem = rt.problem
        body["reasons"] = [
            getattr(problem, "reason", None) or (problem.code if problem else "unknown")
        ]
        return body
    try:
        probe = await rt.store().probe(rt.instance_id)
        if probe.reachable:
            await rt.service.flush_journal()
    except Exception as exc:  # noqa: BLE001 (health must answer, whatever broke)
        body["reasons"] = ["health_error"]
        body["error"] = type(exc).__name__
        return body
    reasons = list(probe.reasons)
    body["reasons"] = reasons
    body["ledger"] = {"backend": probe.backend, "shared": probe.shared,
                      "reachable": probe.reachable, "latency_ms": probe.latency_ms,
                      "ledger_id": probe.ledger_id}
    body["instances_seen"] = probe.instances_seen
    body["outage_journal_entries"] = rt.service.outage.journal_size
    # Budgets this instance last read as outage_policy `open`: uncapped if the ledger goes away.
    # Health answers anyone, and budget ids name customers: by name only to an operator.
    open_budgets = rt.service.outage.open_budgets(OPEN_BUDGETS_LISTED_MAX)
    body["outage_open_budgets_count"] = len(open_budgets)
    if operator:
        body["outage_open_budgets"] = open_budgets
    if not probe.reachable or DOWN_REASONS.intersection(reasons):
        body["status"] = "down"
    elif reasons:
        body["status"] = "degraded"
    else:
        body["status"] = "ok"
    return body


def _is_operator(authorization: str | None) -> bool:
    return bool(authorization) and is_admin_token(bearer(authorization))


async def health(request: Request) -> JSONResponse:
    body = await health_body(operator=_is_operator(request.headers.get("authorization")))
    return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)


async def live(request: Request) -> JSONResponse:
    return JSONResponse({"status": "live", "instance_id": runtime().instance_id})


# GET, which Starlette serves for HEAD too. Authorization here is the admin token, optional.
ROUTES = (
    HotRoute("/health", health, methods=("GET",), keyed=False, headers=("Authorization",)),
    HotRoute("/health/live", live, methods=("GET",), keyed=False),
)
