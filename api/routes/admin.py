"""Admin: budgets, API keys and corrections of reservations, behind CEILING_ADMIN_TOKEN. Closed
when the token is unset. Each route checks the token first (api/auth.py admin), then reads its
parameters and body (api/routing.py query_of, parsed)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse

from api.admin_models import BudgetBody, CorrectionBody, KeyBody, RotateBody
from api.auth import admin
from api.routing import HotRoute, Query, parsed, parsed_or_none, query_of
from api.runtime import runtime
from api.views import budget_view_json, correction_json, stored_reservation_json, users_json
from core.budgets import BudgetId
from core.errors import BudgetNotFound, InvalidRequest
from core.service import check_roles
from core.spend import budget_reading

# The pages' parameters: where a list starts, and how many it holds (core/operations.py bounds it).
PREFIX = Query("prefix")
CURSOR = Query("cursor")
LIMIT = Query("limit", int)
BUDGET_ID = Query("budget_id")
FORCE = Query("force", bool, False)


async def list_budgets(request: Request) -> JSONResponse:
    """Budgets in id order, beginning with `prefix`; `next_cursor` pages on (null: the end)."""
    admin(request)
    page = await runtime().operations().budgets(
        query_of(request, PREFIX), query_of(request, CURSOR), query_of(request, LIMIT))
    return JSONResponse(page.json())


async def put_budget(request: Request) -> JSONResponse:
    by = admin(request)
    ops = runtime().operations()
    budget_id = request.path_params["budget_id"]
    definition = (await parsed(BudgetBody, request)).definition(budget_id)
    await ops.put_budget(definition, by)
    return await _budget_json(budget_id)


async def delete_budget(request: Request) -> JSONResponse:
    """Refused (409 budget_in_use) while open reservations hold money in it or its end users,
    unless force=1, which charges them as unknown. Its counters and its end users' stay
    (re-creating it refills nothing); its users set goes, so its users are counted afresh; its
    keys are revoked."""
    by = admin(request)
    ops = runtime().operations()
    force = query_of(request, FORCE)
    return JSONResponse(await ops.delete_budget(
        BudgetId.parse(request.path_params["budget_id"]), force, by))


async def list_users(request: Request) -> JSONResponse:
    """The budget's end users in byte order of their ids, each with its spend per period;
    `next_cursor` pages on (null: the end)."""
    admin(request)
    ops = runtime().operations()
    return JSONResponse(users_json(await ops.users(
        BudgetId.parse(request.path_params["budget_id"]), query_of(request, CURSOR),
        query_of(request, LIMIT))))


async def get_budget(request: Request) -> JSONResponse:
    admin(request)
    return await _budget_json(request.path_params["budget_id"])


async def _budget_json(budget_id: str) -> JSONResponse:
    found = await budget_reading(runtime().enforcing().store, BudgetId.parse(budget_id))
    if found is None:
        raise BudgetNotFound(f"no budget {budget_id}", budget_id=budget_id)
    return JSONResponse(budget_view_json(*found))


async def list_keys(request: Request) -> JSONResponse:
    """Key ids, roles, budget, created and last used (to a minute); never a secret or a hash."""
    admin(request)
    page = await runtime().operations().keys(
        query_of(request, BUDGET_ID), query_of(request, CURSOR), query_of(request, LIMIT))
    return JSONResponse(page.json())


async def rotate_key(request: Request) -> JSONResponse:
    """A new secret, shown once; the previous one keeps working for `grace_ms` (bounded)."""
    by = admin(request)
    ops = runtime().operations()
    body = await parsed_or_none(RotateBody, request)
    return JSONResponse(await ops.rotate_key(
        request.path_params["key_id"], body.grace_ms if body else None, by))


async def audit(request: Request) -> JSONResponse:
    """Every admin change, newest first: who (the admin token's fingerprint), what, when."""
    admin(request)
    page = await runtime().operations().audit_page(query_of(request, CURSOR),
                                                   query_of(request, LIMIT))
    return JSONResponse(page.json())


async def export_ledger(request: Request) -> JSONResponse:
    """The ledger as one document (`ceiling ledger export`), for a scheduler to store."""
    by = admin(request)
    return JSONResponse(await runtime().operations().export(by))


async def adopt_ledger(request: Request) -> JSONResponse:
    """Confirm a restored ledger: instances that reported ledger_reset serve against it."""
    by = admin(request)
    return JSONResponse(await runtime().operations().adopt(by))


async def create_key(request: Request) -> JSONResponse:
    by = admin(request)
    ops = runtime().operations()
    body = await parsed(KeyBody, request)
    # BudgetId.operator: a key's budget is named by an operator, so no reserved scope kind (a
    # key of `org:x/run:r` would spend in the counters of org:x's keys' run `r`).
    new = await ops.create_key(
        BudgetId.operator(body.budget_id), body.run_ceiling_micros, check_roles(body.roles), by)
    return JSONResponse({
        "key_id": new.key_id,
        "api_key": new.api_key,
        "budget_id": new.record.budget_id.path,
        "run_ceiling_micros": new.record.run_ceiling_micros,
        "roles": sorted(new.record.roles),
        "note": "the api_key is shown once; only its hash is stored",
    }, status_code=201)


async def revoke_key(request: Request) -> JSONResponse:
    by = admin(request)
    key_id: str = request.path_params["key_id"]
    if not key_id.isascii() or not key_id.startswith("key_") or len(key_id) > 64:
        raise InvalidRequest("not a key id", field="key_id")
    if not await runtime().operations().revoke_key(key_id, by):
        raise BudgetNotFound(f"no key {key_id}", key_id=key_id)
    return JSONResponse({"key_id": key_id, "revoked": True})


async def correct_reservation(request: Request) -> JSONResponse:
    """Settle a reservation no API key may settle (a gateway call of unknown outcome) from the
    provider's bill: allowed while it is open or after it expired as `unknown`."""
    by = admin(request)
    ops = runtime().operations()
    reservation_id = request.path_params["reservation_id"]
    body = await parsed(CorrectionBody, request)
    settled = await ops.correct(reservation_id, body.actual_micros, body.reason, by)
    return JSONResponse(correction_json(reservation_id, settled, by))


async def show_reservation(request: Request) -> JSONResponse:
    admin(request)
    view = await runtime().enforcing().inspect(request.path_params["reservation_id"])
    return JSONResponse(stored_reservation_json(view))


BUDGET = "/v1/admin/budgets/{budget_id:path}"
ROUTES = (
    HotRoute("/v1/admin/budgets", list_budgets, ("GET",), admin=True,
             query=(PREFIX, CURSOR, LIMIT)),
    HotRoute(BUDGET, put_budget, ("PUT",), admin=True, model=BudgetBody),
    HotRoute(BUDGET, delete_budget, ("DELETE",), admin=True, query=(FORCE,)),
    # Before GET BUDGET, which would take '.../users' for a budget id (one that no budget can
    # have: a scope is 'kind:name').
    HotRoute(f"{BUDGET}/users", list_users, ("GET",), admin=True, query=(CURSOR, LIMIT)),
    HotRoute(BUDGET, get_budget, ("GET",), admin=True),
    HotRoute("/v1/admin/keys", list_keys, ("GET",), admin=True,
             query=(BUDGET_ID, CURSOR, LIMIT)),
    HotRoute("/v1/admin/keys/{key_id}/rotate", rotate_key, admin=True, model=RotateBody,
             model_optional=True),
    HotRoute("/v1/admin/audit", audit, ("GET",), admin=True, query=(CURSOR, LIMIT)),
    HotRoute("/v1/admin/ledger/export", export_ledger, admin=True),
    HotRoute("/v1/admin/ledger/adopt", adopt_ledger, admin=True),
    HotRoute("/v1/admin/keys", create_key, admin=True, model=KeyBody, status_code=201),
    HotRoute("/v1/admin/keys/{key_id}", revoke_key, ("DELETE",), admin=True),
    HotRoute("/v1/admin/reservations/{reservation_id}/settle", correct_reservation, admin=True,
             model=CorrectionBody),
    HotRoute("/v1/admin/reservations/{reservation_id}", show_reservation, ("GET",), admin=True),
)
