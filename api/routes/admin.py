"""Admin: budgets, API keys and corrections of reservations, behind CEILING_ADMIN_TOKEN. Closed
when the token is unset."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header
from fastapi.responses import JSONResponse

from api.admin_models import BudgetBody, CorrectionBody, KeyBody, RotateBody
from api.auth import bearer
from api.runtime import admin_token, is_admin_token, runtime
from api.views import correction_json, leg_json, stored_reservation_json, users_json
from core.budget_json import budget_json
from core.budgets import BudgetId
from core.errors import BudgetNotFound, Forbidden, InvalidRequest, Unauthorized
from core.operations import Operations
from core.service import CeilingService, check_roles, operator_fingerprint

router = APIRouter(prefix="/v1/admin")


async def service() -> CeilingService:
    # async: FastAPI runs a plain `def` dependency in its thread pool, a thread hand-off per call.
    return runtime().enforcing()


async def admin(authorization: Annotated[str | None, Header()] = None) -> None:
    if not admin_token():
        raise Forbidden("admin routes are closed: CEILING_ADMIN_TOKEN is not set")
    if not is_admin_token(bearer(authorization) or ""):
        raise Unauthorized("the admin token is required")


async def operator(_: Annotated[None, Depends(admin)]) -> str:
    """Who acts, as recorded on what they correct: a fingerprint of the admin token."""
    config = runtime().config
    return operator_fingerprint(config.admin_token if config and config.admin_token else "")


async def operations() -> Operations:
    return runtime().operations()


Admin = Annotated[None, Depends(admin)]
Operator = Annotated[str, Depends(operator)]
Service = Annotated[CeilingService, Depends(service)]
Ops = Annotated[Operations, Depends(operations)]


@router.get("/budgets")
async def list_budgets(_: Admin, ops: Ops, prefix: str | None = None, cursor: str | None = None,
                       limit: int | None = None) -> JSONResponse:
    """Budgets in id order, beginning with `prefix`; `next_cursor` pages on (null: the end)."""
    return JSONResponse((await ops.budgets(prefix, cursor, limit)).json())


@router.put("/budgets/{budget_id:path}")
async def put_budget(budget_id: str, body: BudgetBody, by: Operator, ops: Ops,
                     svc: Service) -> JSONResponse:
    definition = body.definition(budget_id)
    await ops.put_budget(definition, by)
    return await get_budget(budget_id, None, svc)


@router.delete("/budgets/{budget_id:path}")
async def delete_budget(budget_id: str, by: Operator, ops: Ops,
                        force: bool = False) -> JSONResponse:
    """Refused (409 budget_in_use) while open reservations hold money in it or its end users,
    unless force=1, which charges them as unknown. Its counters and its end users' stay
    (re-creating it refills nothing); its users set goes, so its users are counted afresh; its
    keys are revoked."""
    return JSONResponse(await ops.delete_budget(BudgetId.parse(budget_id), force, by))


# Before GET /budgets/{budget_id:path}, which would take '.../users' for a budget id (one that
# no budget can have: a scope is 'kind:name').
@router.get("/budgets/{budget_id:path}/users")
async def list_users(budget_id: str, _: Admin, ops: Ops, cursor: str | None = None,
                     limit: int | None = None) -> JSONResponse:
    """The budget's end users in byte order of their ids, each with its spend per period;
    `next_cursor` pages on (null: the end)."""
    return JSONResponse(users_json(await ops.users(BudgetId.parse(budget_id), cursor, limit)))


@router.get("/budgets/{budget_id:path}")
async def get_budget(budget_id: str, _: Admin, svc: Service) -> JSONResponse:
    found = await svc.budget(BudgetId.parse(budget_id))
    if found is None:
        raise BudgetNotFound(f"no budget {budget_id}", budget_id=budget_id)
    definition, legs = found
    return JSONResponse({**budget_json(definition), "periods": [leg_json(x) for x in legs]})


@router.get("/keys")
async def list_keys(_: Admin, ops: Ops, budget_id: str | None = None, cursor: str | None = None,
                    limit: int | None = None) -> JSONResponse:
    """Key ids, roles, budget, created and last used (to a minute); never a secret or a hash."""
    return JSONResponse((await ops.keys(budget_id, cursor, limit)).json())


@router.post("/keys/{key_id}/rotate")
async def rotate_key(key_id: str, by: Operator, ops: Ops,
                     body: RotateBody | None = None) -> JSONResponse:
    """A new secret, shown once; the previous one keeps working for `grace_ms` (bounded)."""
    return JSONResponse(await ops.rotate_key(key_id, body.grace_ms if body else None, by))


@router.get("/audit")
async def audit(_: Admin, ops: Ops, cursor: str | None = None,
                limit: int | None = None) -> JSONResponse:
    """Every admin change, newest first: who (the admin token's fingerprint), what, when."""
    return JSONResponse((await ops.audit_page(cursor, limit)).json())


@router.post("/ledger/export")
async def export_ledger(by: Operator, ops: Ops) -> JSONResponse:
    """The ledger as one document (`ceiling ledger export`), for a scheduler to store."""
    return JSONResponse(await ops.export(by))


@router.post("/ledger/adopt")
async def adopt_ledger(by: Operator, ops: Ops) -> JSONResponse:
    """Confirm a restored ledger: instances that reported ledger_reset serve against it."""
    return JSONResponse(await ops.adopt(by))


@router.post("/keys", status_code=201)
async def create_key(body: KeyBody, by: Operator, ops: Ops) -> JSONResponse:
    # BudgetId.operator: a key's budget is named by an operator, so no reserved scope kind (a
    # key of `org:x/run:r` would spend in the counters of org:x's keys' run `r`).
    new = await ops.create_key(BudgetId.operator(body.budget_id), body.run_ceiling_micros,
                               check_roles(body.roles), by)
    return JSONResponse({
        "key_id": new.key_id,
        "api_key": new.api_key,
        "budget_id": new.record.budget_id.path,
        "run_ceiling_micros": new.record.run_ceiling_micros,
        "roles": sorted(new.record.roles),
        "note": "the api_key is shown once; only its hash is stored",
    }, status_code=201)


@router.delete("/keys/{key_id}")
async def revoke_key(key_id: str, by: Operator, ops: Ops) -> JSONResponse:
    if not key_id.isascii() or not key_id.startswith("key_") or len(key_id) > 64:
        raise InvalidRequest("not a key id", field="key_id")
    if not await ops.revoke_key(key_id, by):
        raise BudgetNotFound(f"no key {key_id}", key_id=key_id)
    return JSONResponse({"key_id": key_id, "revoked": True})


@router.post("/reservations/{reservation_id}/settle")
async def correct_reservation(reservation_id: str, body: CorrectionBody, by: Operator,
                              ops: Ops) -> JSONResponse:
    """Settle a reservation no API key may settle (a gateway call of unknown outcome) from the
    provider's bill: allowed while it is open or after it expired as `unknown`."""
    settled = await ops.correct(reservation_id, body.actual_micros, body.reason, by)
    return JSONResponse(correction_json(reservation_id, settled, by))


@router.get("/reservations/{reservation_id}")
async def show_reservation(reservation_id: str, _: Admin, svc: Service) -> JSONResponse:
    view = await svc.inspect(reservation_id)
    return JSONResponse(stored_reservation_json(view))
