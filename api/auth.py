"""Who is calling: the key a request carries, and the caller it stands for.

Every route that takes a key or a token reads it here: the sidecar's and the gateway's routes
through `authenticated` (a key holder, checked by the service), the admin surface, health,
metrics and the dashboard through `bearer` (the token they compare themselves)."""

from __future__ import annotations

from starlette.requests import Request

from api.runtime import runtime
from core.ledger import Role
from core.service import Caller, CeilingService


def bearer(authorization: str | None) -> str | None:
    """The credential of an `Authorization: Bearer <credential>` header; None for any other."""
    if authorization and authorization[:7].lower() == "bearer ":
        return authorization[7:].strip()
    return None


async def authenticated(
    request: Request, role: Role | None, *, x_api_key: bool = False
) -> tuple[CeilingService, Caller]:
    """The service and the caller acting in `role`, or the reason to refuse: no ledger, then no
    valid key, then a key without the role (None: either role will do). With `x_api_key` the key
    may come as Anthropic's clients send theirs, in `x-api-key`, when no bearer key is given."""
    svc = runtime().enforcing()
    headers = request.headers
    key = bearer(headers.get("authorization"))
    if key is None and x_api_key:
        key = headers.get("x-api-key")
    who = await svc.authenticate(key, headers.get("x-ceiling-run-id"), role,
                                 headers.get("x-ceiling-user"))
    return svc, who
