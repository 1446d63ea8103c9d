"""Reserve / settle / release for callers that make the model call themselves: keys with the
sidecar role. A key reaches only the reservations it made through these routes, never the ones
the gateway made for it (core/ledger.py GATEWAY_OWNER_PREFIX)."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

from api.auth import authenticated as authenticated  # api/routes/gateway.py imports it here
from api.errors import InvalidBody
from api.models import ReserveBody, SettleBody
from api.routing import HotRoute
from api.views import leg_json, reservation_json, settlement_json, user_headers
from core.jsonbody import check_depth
from core.ledger import Role

B = TypeVar("B", bound=BaseModel)


async def parsed(model: type[B], request: Request) -> B:
    raw = await request.body()
    check_depth(raw)  # the gateway's limit, on every route
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise InvalidBody(exc.errors(include_url=False, include_context=False)) from exc


async def reserve(request: Request) -> JSONResponse:
    svc, who = await authenticated(request, Role.SIDECAR)
    body = await parsed(ReserveBody, request)
    r = await svc.reserve(who, body.spec(), request.headers.get("idempotency-key"))
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


# The hot routes (api/routing.py) of this module.
ROUTES = (
    HotRoute("/v1/reservations", reserve, body=ReserveBody.model_json_schema(),
             headers=("Idempotency-Key",), status_code=201),
    HotRoute("/v1/reservations/{reservation_id}/settle", settle,
             body=SettleBody.model_json_schema()),
    HotRoute("/v1/reservations/{reservation_id}/release", release),
    HotRoute("/v1/budgets/me", my_budgets, methods=("GET",)),
)
