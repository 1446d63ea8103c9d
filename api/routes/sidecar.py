"""Reserve / settle / release for callers that make the model call themselves: keys with the
sidecar role. A key reaches only the reservations it made through these routes, never the ones
the gateway made for it (core/ledger.py GATEWAY_OWNER_PREFIX). And a key holder's own reads,
in either role: its budgets, and its spend series."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from api.auth import authenticated as authenticated  # api/routes/gateway.py imports it here
from api.models import ReserveBody, SettleBody
from api.routing import HotRoute, header_of, parsed
from api.runtime import runtime
from api.views import leg_json, reservation_json, settlement_json, user_headers
from core import spend
from core.errors import InvalidRequest
from core.ledger import Role

# The only query parameter GET /v1/usage/me reads: anything else (a budget id, a key, a run)
# is refused, so a caller cannot believe it asked for someone else's series and got it.
USAGE_QUERY = frozenset({"hours"})


async def reserve(request: Request) -> JSONResponse:
    svc, who = await authenticated(request, Role.SIDECAR)
    body = await parsed(ReserveBody, request)
    r = await svc.reserve(who, body.spec(), header_of(request, b"idempotency-key"))
    return JSONResponse(reservation_json(r), status_code=200 if r.replayed else 201,
                        headers=user_headers(who, r.legs))


async def settle(request: Request) -> JSONResponse:
    reservation_id = request.path_params["reservation_id"]
    svc, who = await authenticated(request, Role.SIDECAR)
    body = await parsed(SettleBody, request)
    s = await svc.settle(who, reservation_id, body.spec())
    return JSONResponse(settlement_json(reservation_id, s))


async def release(request: Request) -> JSONResponse:
    reservation_id = request.path_params["reservation_id"]
    svc, who = await authenticated(request, Role.SIDECAR)
    r = await svc.release(who, reservation_id)
    return JSONResponse({"reservation_id": reservation_id, "released_micros": r.released_micros,
                         "replayed": r.replayed})


async def my_budgets(request: Request) -> JSONResponse:
    svc, who = await authenticated(request, None)
    legs = await svc.my_budgets(who)
    return JSONResponse({"budget_id": who.key.budget_id.path, "run_id": who.run_id,
                         "user": who.user, "budgets": [leg_json(x) for x in legs]},
                        headers=user_headers(who, legs))


def report_json(r: spend.BudgetReport) -> dict[str, Any]:
    return {
        "budget_id": r.budget_id,
        "paused": bool(r.definition and r.definition.paused_at_ms is not None),
        "periods": [leg_json(x) for x in r.legs],
        "series": [{"hour_start_ms": p.hour_start_ms, "committed_micros": p.committed_micros}
                   for p in r.series],
    }


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


# The hot routes (api/routing.py) of this module.
ROUTES = (
    HotRoute("/v1/reservations", reserve, body=ReserveBody.model_json_schema(),
             headers=("Idempotency-Key",), status_code=201),
    HotRoute("/v1/reservations/{reservation_id}/settle", settle,
             body=SettleBody.model_json_schema()),
    HotRoute("/v1/reservations/{reservation_id}/release", release),
    HotRoute("/v1/budgets/me", my_budgets, methods=("GET",)),
    HotRoute("/v1/usage/me", usage_me, methods=("GET",)),
)
