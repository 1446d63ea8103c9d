"""The one place that knows HTTP status codes: core errors in, JSON error bodies out.

Body: {"error": {"type", "code", "message", ...details}}. A budget refusal says which budget
and whether retrying can help, so a client that retries blindly is not invited to: 402 for a
budget that is spent until it resets, 429 with Retry-After only when open reservations are in
the way.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, Protocol, cast

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from core.errors import CeilingError, LedgerUnavailable

# code -> (HTTP status, error type)
STATUS: dict[str, tuple[int, str]] = {
    "invalid_request": (422, "invalid_request_error"),
    "model_unpriced": (422, "invalid_request_error"),
    "input_unbounded": (422, "invalid_request_error"),
    "model_unbounded": (422, "invalid_request_error"),
    "field_unsupported": (422, "invalid_request_error"),
    # No upstream of CEILING_UPSTREAMS serves the model (or two do): the request names what
    # the gateway does not route, as a model the provider does not know (its 400).
    "model_not_routed": (400, "invalid_request_error"),
    "unauthorized": (401, "authentication_error"),
    "forbidden": (403, "permission_error"),
    "budget_not_found": (404, "invalid_request_error"),
    "reservation_not_found": (404, "invalid_request_error"),
    "not_found": (404, "invalid_request_error"),
    "method_not_allowed": (405, "invalid_request_error"),
    "payload_too_large": (413, "invalid_request_error"),
    "budget_exceeded": (402, "budget_error"),
    "budget_busy": (429, "budget_error"),
    "state_quota": (429, "rate_limit_error"),
    "rate_limited": (429, "rate_limit_error"),
    "concurrency_limited": (429, "rate_limit_error"),
    "users_exhausted": (403, "permission_error"),
    "model_not_allowed": (403, "permission_error"),
    "user_required": (400, "invalid_request_error"),
    "budget_paused": (402, "budget_error"),
    "idempotency_conflict": (409, "idempotency_error"),
    "idempotency_in_flight": (409, "idempotency_error"),
    "reply_not_kept": (409, "idempotency_error"),
    "reservation_resolved": (409, "invalid_request_error"),
    "operation_refused": (409, "invalid_request_error"),
    "budget_in_use": (409, "invalid_request_error"),
    "ledger_not_empty": (409, "invalid_request_error"),
    "upstream_unreachable": (502, "upstream_error"),
    "upstream_timeout": (504, "upstream_error"),
    "upstream_answer_too_large": (502, "upstream_error"),
    "cost_report_failed": (502, "upstream_error"),
    "ledger_unavailable": (503, "ledger_error"),
    "ledger_not_shared": (503, "ledger_error"),
    "invalid_configuration": (503, "configuration_error"),
    "invariant_broken": (500, "internal_error"),
}


def error_response(
    code: str, message: str, details: dict[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    status, error_type = STATUS[code]
    details = details or {}
    headers = dict(headers or {})
    if "retry_after_s" in details and status in (429, 409, 503):
        headers["Retry-After"] = str(details["retry_after_s"])
    body = {"error": {"type": error_type, "code": code, "message": message, **details}}
    return JSONResponse(body, status_code=status, headers=headers)


def ceiling_error_response(exc: CeilingError) -> JSONResponse:
    code = exc.code
    details = dict(exc.details)
    if isinstance(exc, LedgerUnavailable):
        code = "ledger_not_shared" if exc.reason == "ledger_not_shared" else "ledger_unavailable"
        details.setdefault("retry_after_s", 1)
        details["forwarded"] = False
    return error_response(code, exc.message, details)


async def _on_ceiling_error(request: Request, exc: Exception) -> JSONResponse:
    return ceiling_error_response(cast(CeilingError, exc))


class ValidationProblems(Protocol):
    """A request that does not match the API, as pydantic lists its errors: FastAPI's
    RequestValidationError, and InvalidBody."""

    def errors(self) -> Sequence[Any]: ...


class InvalidBody(Exception):
    """A hot route's body that does not match its model (api/routes/sidecar.py), answered as
    FastAPI answers its own routes' RequestValidationError. The hot routes raise this one so
    that serving them never imports FastAPI (api/app.py builds it on the first request that
    needs it)."""

    def __init__(self, errors: Sequence[Any]) -> None:
        super().__init__(errors)
        self._errors = errors

    def errors(self) -> Sequence[Any]:
        return self._errors


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    return validation_error_response(cast(ValidationProblems, exc))


def validation_error_response(exc: ValidationProblems) -> JSONResponse:
    problems = [
        {"field": ".".join(str(p) for p in e.get("loc", ()) if p != "body"), "problem": e["msg"]}
        for e in exc.errors()
    ]
    return error_response(
        "invalid_request", "the request does not match the API; nothing was reserved",
        {"problems": problems[:20]},
    )


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    exc = cast(HTTPException, exc)
    code = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}.get(
        exc.status_code, "invalid_request"
    )
    # The framework's own headers stay: a 405's Allow.
    return error_response(code, str(exc.detail), headers=exc.headers)


# The one mapping of errors to answers. api/app.py gives it to the app, and to FastAPI with
# FastAPI's own validation error added (fastapi_handlers); a route whose errors take another
# shape declares its own on top of it (api/openai_errors.py). Starlette calls each handler only
# with the exception class it was registered for.
Handler = Callable[[Request, Any], Coroutine[Any, Any, Response]]
HANDLERS: dict[int | type[Exception], Handler] = {
    CeilingError: _on_ceiling_error,
    InvalidBody: _on_validation_error,
    HTTPException: _on_http_error,
}


def fastapi_handlers() -> dict[int | type[Exception], Handler]:
    """HANDLERS, and FastAPI's RequestValidationError answered as InvalidBody is: for the
    FastAPI app alone, which imports FastAPI when it is built."""
    from fastapi.exceptions import RequestValidationError

    return {**HANDLERS, RequestValidationError: _on_validation_error}
