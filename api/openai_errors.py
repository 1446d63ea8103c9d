"""Errors on the OpenAI-compatible routes, in the shape OpenAI's clients parse.

    {"error": {"message", "type", "param", "code", ...details}}

Status, type, details and Retry-After are what api/errors.py decides for every route; only the
shape and the retry advice are added here. The official SDKs retry 408, 409, 429 and >= 500
unless the answer says `x-should-retry: false`, so an error that retrying the same request
cannot fix says so: a spent budget, a request the gateway refuses, a key used twice, a call
whose outcome is unknown (a blind retry could pay for it twice). Another provider's shape
(api/anthropic_errors.py) is another `shape` for shaped_error_response and refusals_in().
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, cast

from starlette.middleware import Middleware
from starlette.middleware.exceptions import ExceptionMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse

from api import errors
from core.errors import CeilingError

# Codes a retry of the same request cannot fix. budget_busy, idempotency_in_flight,
# ledger_unavailable and upstream_unreachable are left to the SDK's retries: each can pass later.
RETRY_CANNOT_HELP = frozenset({
    "budget_exceeded", "budget_not_found", "budget_paused", "field_unsupported", "forbidden",
    "idempotency_conflict", "input_unbounded", "invalid_configuration", "invalid_request",
    "ledger_not_shared", "model_unbounded", "model_unpriced", "payload_too_large",
    # The call was made and charged; its answer is gone: a retry with the same key cannot help.
    "reply_not_kept",
    # A key's quota window ends hours later: no retry within an SDK's backoff can pass it.
    "state_quota", "unauthorized", "upstream_answer_too_large", "upstream_timeout",
})
# A refusal reserved and charged nothing.
NOTHING_HELD = {"x-ceiling-reserved-micros": "0", "x-ceiling-charged-micros": "0"}


# An error as api/errors.py writes it ({"type", "code", "message", ...details}) -> a body.
Shape = Callable[[dict[str, Any]], dict[str, Any]]
Respond = Callable[[CeilingError, Mapping[str, str]], JSONResponse]


def shaped_error_response(exc: CeilingError, headers: Mapping[str, str],
                          shape: Shape) -> JSONResponse:
    """`exc` answered as api/errors.py decides, in the body `shape` makes of it, with the SDKs'
    retry advice."""
    plain = errors.ceiling_error_response(exc)
    error = json.loads(bytes(plain.body))["error"]
    code = error["code"]
    response = JSONResponse(shape(error), status_code=plain.status_code, headers=dict(headers))
    if "retry-after" in plain.headers:
        response.headers["retry-after"] = plain.headers["retry-after"]
    if code in RETRY_CANNOT_HELP:
        response.headers["x-should-retry"] = "false"
    return response


def openai_shape(error: dict[str, Any]) -> dict[str, Any]:
    error = dict(error)
    code = error.pop("code")
    return {"error": {"message": error.pop("message"), "type": error.pop("type"),
                      "param": error.pop("field", None), "code": code, **error}}


def openai_error_response(exc: CeilingError, headers: Mapping[str, str]) -> JSONResponse:
    return shaped_error_response(exc, headers, openai_shape)


def refusal_headers(exc: CeilingError) -> dict[str, str]:
    headers = dict(NOTHING_HELD)
    remaining = exc.details.get("remaining_micros")
    if isinstance(remaining, int):
        headers["x-ceiling-remaining-micros"] = str(remaining)
    return headers


def refusals_in(respond: Respond) -> Middleware:
    """Declared on a gateway route (api/routes/gateway.py): the app's mapping, with the core's
    refusals answered by `respond`. A route's middleware runs inside the app's, and the handlers
    it declares are the ones its endpoint's exceptions meet; the framework's own errors (a 405,
    a body over the limit) keep the app's shape."""

    async def on_refusal(request: Request, exc: Exception) -> JSONResponse:
        refusal = cast(CeilingError, exc)
        return respond(refusal, refusal_headers(refusal))

    return Middleware(ExceptionMiddleware, handlers={**errors.HANDLERS, CeilingError: on_refusal})


OPENAI_ERRORS = refusals_in(openai_error_response)
