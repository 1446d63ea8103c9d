"""Reserve / settle / release for callers that make the model call themselves: keys with the
sidecar role. A key reaches only the reservations it made through these routes, never the ones
the gateway made for it (core/ledger.py GATEWAY_OWNER_PREFIX)."""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from api.models import ReserveBody, SettleBody
from api.routing import LeanRoute
from api.runtime import runtime
from core.ledger import LegStatus, Reservation, Role
from core.money import micros_to_usd
from core.service import Caller, CeilingService

B = TypeVar("B", bound=BaseModel)


router = APIRouter(prefix="/v1", route_class=LeanRoute)


def bearer(authorization: str | None) -> str | None:
    if authorization and authorization[:7].lower() == "bearer ":
        return authorization[7:].strip()
    return None


# The hot routes read headers and body themselves: FastAPI's dependency and parameter machinery
# cost more CPU per call than the ledger round trip (bench/http.py). The schema still documents
# them, for clients and for the fuzzer.
def _documented(body: type[BaseModel] | None, *headers: str, in_path: bool = False
                ) -> dict[str, Any]:
    extra: dict[str, Any] = {"parameters": [
        {"name": h, "in": "header", "required": False, "schema": {"type": "string"}}
        for h in ("Authorization", "X-Ceiling-Run-Id", *headers)
    ]}
    if in_path:
        extra["parameters"].append({"name": "reservation_id", "in": "path", "required": True,
                                    "schema": {"type": "string"}})
    if body is not None:
        extra["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": body.model_json_schema()}}}
    return extra


async def authenticated(
    request: Request, role: Role | None
) -> tuple[CeilingService, Caller]:
    """The service and the caller acting in `role`, or the reason to refuse: no ledger, then no
    valid key, then a key without the role (None: either role will do)."""
    svc = runtime().enforcing()
    headers = request.headers
    who = await svc.authenticate(
        bearer(headers.get("authorization")), headers.get("x-ceiling-run-id"), role
    )
    return svc, who


async def parsed(model: type[B], request: Request) -> B:
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False, include_context=False)) from exc


def leg_json(leg: LegStatus) -> dict[str, Any]:
    return {
        "budget_id": leg.budget_id,
        # A StrEnum is its value (.value costs a descriptor call per leg).
        "period": leg.period if leg.window_key != "outage" else "outage",
        "period_key": leg.window_key,
        "ceiling_micros": leg.ceiling_micros,
        "committed_micros": leg.committed_micros,
        "reserved_micros": leg.reserved_micros,
        "remaining_micros": leg.remaining_micros,
        "overshoot_micros": leg.overshoot_micros,
        "resets_at_ms": leg.resets_at_ms,
    }


def reservation_json(r: Reservation) -> dict[str, Any]:
    return {
        "reservation_id": r.reservation_id,
        "reserved_micros": r.reserved_micros,
        "reserved_usd": micros_to_usd(r.reserved_micros),
        "expires_at_ms": r.expires_at_ms,
        "replayed": r.replayed,
        "budgets": [leg_json(x) for x in r.legs],
    }


@router.post("/reservations", status_code=201,
             openapi_extra=_documented(ReserveBody, "Idempotency-Key"))
async def reserve(request: Request) -> JSONResponse:
    svc, who = await authenticated(request, Role.SIDECAR)
    body = await parsed(ReserveBody, request)
    r = await svc.reserve(who, body.spec(), request.headers.get("idempotency-key"))
    return JSONResponse(reservation_json(r), status_code=200 if r.replayed else 201)


@router.post("/reservations/{reservation_id}/settle",
             openapi_extra=_documented(SettleBody, in_path=True))
async def settle(request: Request) -> JSONResponse:
    reservation_id = request.path_params["reservation_id"]
    svc, who = await authenticated(request, Role.SIDECAR)
    body = await parsed(SettleBody, request)
    s = await svc.settle(who, reservation_id, body.spec())
    return JSONResponse({
        "reservation_id": reservation_id,
        "charged_micros": s.charged_micros,
        "released_micros": s.released_micros,
        "overshoot_micros": s.overshoot_micros,
        "late": s.late,
        "replayed": s.replayed,
    })


@router.post("/reservations/{reservation_id}/release",
             openapi_extra=_documented(None, in_path=True))
async def release(request: Request) -> JSONResponse:
    reservation_id = request.path_params["reservation_id"]
    svc, who = await authenticated(request, Role.SIDECAR)
    r = await svc.release(who, reservation_id)
    return JSONResponse({"reservation_id": reservation_id, "released_micros": r.released_micros,
                         "replayed": r.replayed})


@router.get("/budgets/me", openapi_extra=_documented(None))
async def my_budgets(request: Request) -> JSONResponse:
    svc, who = await authenticated(request, None)
    legs = await svc.my_budgets(who)
    return JSONResponse({"budget_id": who.key.budget_id.path, "run_id": who.run_id,
                         "budgets": [leg_json(x) for x in legs]})
