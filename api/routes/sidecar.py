"""Reserve / settle / release for callers that make the model call themselves."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header
from fastapi.responses import JSONResponse

from api.models import ReserveBody, SettleBody
from api.runtime import runtime
from core.ledger import LegStatus, Reservation
from core.money import micros_to_usd
from core.service import Caller, CeilingService

router = APIRouter(prefix="/v1")


def service() -> CeilingService:
    return runtime().enforcing()


def bearer(authorization: str | None) -> str | None:
    if authorization and authorization[:7].lower() == "bearer ":
        return authorization[7:].strip()
    return None


async def caller(
    svc: Annotated[CeilingService, Depends(service)],
    authorization: Annotated[str | None, Header()] = None,
    x_ceiling_run_id: Annotated[str | None, Header()] = None,
) -> Caller:
    return await svc.authenticate(bearer(authorization), x_ceiling_run_id)


def leg_json(leg: LegStatus) -> dict[str, Any]:
    return {
        "budget_id": leg.budget_id,
        "period": leg.period.value if leg.window_key != "outage" else "outage",
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


@router.post("/reservations", status_code=201)
async def reserve(
    body: ReserveBody,
    who: Annotated[Caller, Depends(caller)],
    svc: Annotated[CeilingService, Depends(service)],
    idempotency_key: Annotated[str | None, Header()] = None,
) -> JSONResponse:
    r = await svc.reserve(who, body.spec(), idempotency_key)
    return JSONResponse(reservation_json(r), status_code=200 if r.replayed else 201)


@router.post("/reservations/{reservation_id}/settle")
async def settle(
    reservation_id: str,
    body: SettleBody,
    who: Annotated[Caller, Depends(caller)],
    svc: Annotated[CeilingService, Depends(service)],
) -> JSONResponse:
    s = await svc.settle(who, reservation_id, body.spec())
    return JSONResponse({
        "reservation_id": reservation_id,
        "charged_micros": s.charged_micros,
        "released_micros": s.released_micros,
        "overshoot_micros": s.overshoot_micros,
        "late": s.late,
        "replayed": s.replayed,
    })


@router.post("/reservations/{reservation_id}/release")
async def release(
    reservation_id: str,
    who: Annotated[Caller, Depends(caller)],
    svc: Annotated[CeilingService, Depends(service)],
) -> JSONResponse:
    r = await svc.release(who, reservation_id)
    return JSONResponse({"reservation_id": reservation_id, "released_micros": r.released_micros,
                         "replayed": r.replayed})


@router.get("/budgets/me")
async def my_budgets(
    who: Annotated[Caller, Depends(caller)],
    svc: Annotated[CeilingService, Depends(service)],
) -> JSONResponse:
    legs = await svc.my_budgets(who)
    return JSONResponse({"budget_id": who.key.budget_id.path, "run_id": who.run_id,
                         "budgets": [leg_json(x) for x in legs]})
