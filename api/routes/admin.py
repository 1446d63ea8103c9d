"""Admin: budgets and API keys, behind CEILING_ADMIN_TOKEN. Closed when the token is unset."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import APIRouter, Depends, Header
from fastapi.responses import JSONResponse

from api.models import BudgetBody, KeyBody
from api.routes.sidecar import bearer, leg_json
from api.runtime import runtime
from core.budgets import BudgetId
from core.errors import BudgetNotFound, Forbidden, InvalidRequest, Unauthorized
from core.service import CeilingService

router = APIRouter(prefix="/v1/admin")


async def service() -> CeilingService:
    # async: FastAPI runs a plain `def` dependency in its thread pool, a thread hand-off per call.
    return runtime().enforcing()


async def admin(authorization: Annotated[str | None, Header()] = None) -> None:
    config = runtime().config
    expected = config.admin_token if config else None
    if not expected:
        raise Forbidden("admin routes are closed: CEILING_ADMIN_TOKEN is not set")
    given = bearer(authorization) or ""
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise Unauthorized("the admin token is required")


Admin = Annotated[None, Depends(admin)]
Service = Annotated[CeilingService, Depends(service)]


@router.put("/budgets/{budget_id:path}")
async def put_budget(budget_id: str, body: BudgetBody, _: Admin, svc: Service) -> JSONResponse:
    definition = body.definition(budget_id)
    await svc.put_budget(definition)
    return await get_budget(budget_id, _, svc)


@router.get("/budgets/{budget_id:path}")
async def get_budget(budget_id: str, _: Admin, svc: Service) -> JSONResponse:
    found = await svc.budget(BudgetId.parse(budget_id))
    if found is None:
        raise BudgetNotFound(f"no budget {budget_id}", budget_id=budget_id)
    definition, legs = found
    return JSONResponse({
        "budget_id": definition.budget_id.path,
        "limits": [{"period": x.period.value, "ceiling_micros": x.ceiling_micros}
                   for x in definition.limits],
        "timezone": definition.timezone,
        "outage_allowance_micros": definition.outage_allowance_micros,
        "periods": [leg_json(x) for x in legs],
    })


@router.post("/keys", status_code=201)
async def create_key(body: KeyBody, _: Admin, svc: Service) -> JSONResponse:
    new = await svc.create_key(BudgetId.parse(body.budget_id), body.run_ceiling_micros)
    return JSONResponse({
        "key_id": new.key_id,
        "api_key": new.api_key,
        "budget_id": new.record.budget_id.path,
        "run_ceiling_micros": new.record.run_ceiling_micros,
        "note": "the api_key is shown once; only its hash is stored",
    }, status_code=201)


@router.delete("/keys/{key_id}")
async def revoke_key(key_id: str, _: Admin, svc: Service) -> JSONResponse:
    if not key_id.isascii() or not key_id.startswith("key_") or len(key_id) > 64:
        raise InvalidRequest("not a key id", field="key_id")
    if not await svc.revoke_key(key_id):
        raise BudgetNotFound(f"no key {key_id}", key_id=key_id)
    return JSONResponse({"key_id": key_id, "revoked": True})
