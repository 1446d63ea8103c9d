"""Who is calling: the key a request carries, and the caller it stands for.

Every route that takes a key or a token reads it here: the sidecar's and the gateway's routes
through `authenticated` (a key holder, checked by the service), the operators' routes through
`admin` (the admin token), health, metrics and the dashboard through `bearer` (the token they
compare themselves)."""

from __future__ import annotations

from starlette.requests import Request

from api.routing import header_of
from api.runtime import admin_token, is_admin_token, runtime
from core.errors import Forbidden, Unauthorized
from core.ledger import Role
from core.service import Caller, CeilingService, operator_fingerprint


def bearer(authorization: str | None) -> str | None:
    """The credential of an `Authorization: Bearer <credential>` header; None for any other."""
    if authorization and authorization[:7].lower() == "bearer ":
        return authorization[7:].strip()
    return None


def admin(request: Request) -> str:
    """The operator acting, as recorded on what they change: a fingerprint of the admin token;
    or the reason to refuse: the admin routes are closed (no token set), or this is not it."""
    token = admin_token()
    if not token:
        raise Forbidden("admin routes are closed: CEILING_ADMIN_TOKEN is not set")
    if not is_admin_token(bearer(header_of(request, b"authorization")) or ""):
        raise Unauthorized("the admin token is required")
    return operator_fingerprint(token)


async def authenticated(
    request: Request, role: Role | None, *, key_sent: str | None = None
) -> tuple[CeilingService, Caller]:
    """The service and the caller acting in `role`, or the reason to refuse: no ledger, then no
    valid key, then a key without the role (None: either role will do). `key_sent`: the key as
    the route read it where its format's clients send it (Anthropic's x-api-key, Google's
    x-goog-api-key or ?key=), taken when no bearer key is given."""
    svc = runtime().enforcing()
    # The headers by name, the first of each, as Starlette's Headers.get reads them (names as
    # the ASGI server gives them: lower case). One dict, made in C: Headers.get scans every
    # header for each name, and raises and catches a KeyError for each one the request lacks,
    # which most requests do for the run and the end user.
    headers: dict[bytes, bytes] = dict(reversed(request.scope["headers"]))
    key = bearer(_text(headers.get(b"authorization")))
    if key is None:
        key = key_sent
    who = await svc.authenticate(key, _text(headers.get(b"x-ceiling-run-id")), role,
                                 _text(headers.get(b"x-ceiling-user")))
    return svc, who


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("latin-1")  # as Starlette decodes headers
