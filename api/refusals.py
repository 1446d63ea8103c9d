"""Errors on the gateway's routes, in the shape their wire format's clients parse
(core/formats: WireFormat.error_body, error_event): OpenAI's

    {"error": {"message", "type", "param", "code", ...details}}

on the OpenAI-compatible routes, Anthropic's

    {"type": "error", "error": {"type", "message", "code", ...details}}

on /v1/messages. Status, type, details and Retry-After are what api/errors.py decides for every
route; only the shape and the retry advice are added here. The official SDKs (OpenAI's and
Anthropic's) retry 408, 409, 429 and >= 500 unless the answer says `x-should-retry: false`, so
an error that retrying the same request cannot fix says so: a spent budget, a request the
gateway refuses, a key used twice, a call whose outcome is unknown (a blind retry could pay for
it twice).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, cast

from starlette.middleware import Middleware
from starlette.middleware.exceptions import ExceptionMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, ExceptionHandler, Receive, Scope, Send

from api import errors
from core.errors import CeilingError
from core.formats.base import WireFormat
from core.ledger import StoredReply

# Codes a retry of the same request cannot fix. budget_busy, idempotency_in_flight,
# ledger_unavailable and upstream_unreachable are left to the SDK's retries: each can pass later.
RETRY_CANNOT_HELP = frozenset({
    "budget_exceeded", "budget_not_found", "budget_paused", "field_unsupported", "forbidden",
    "idempotency_conflict", "input_unbounded", "invalid_configuration", "invalid_request",
    "ledger_not_shared", "model_not_routed", "model_unbounded", "model_unpriced",
    "payload_too_large",
    # The call was made and charged; its answer is gone: a retry with the same key cannot help.
    "reply_not_kept",
    # A key's quota window ends hours later: no retry within an SDK's backoff can pass it.
    "state_quota", "unauthorized", "upstream_answer_too_large", "upstream_timeout",
})
# A refusal reserved and charged nothing.
NOTHING_HELD = {"x-ceiling-reserved-micros": "0", "x-ceiling-charged-micros": "0"}


def _plain(exc: CeilingError) -> tuple[JSONResponse, dict[str, Any]]:
    """`exc` answered as api/errors.py answers it on every route, and its error object."""
    plain = errors.ceiling_error_response(exc)
    return plain, json.loads(bytes(plain.body))["error"]


def refusal_response(wire: WireFormat, exc: CeilingError,
                     headers: Mapping[str, str]) -> JSONResponse:
    """`exc` answered as api/errors.py decides, in `wire`'s shape, with the SDKs' retry
    advice."""
    plain, error = _plain(exc)
    code = error["code"]
    shaped = wire.error_body(error)
    response = JSONResponse(shaped, status_code=wire.error_status(shaped, plain.status_code),
                            headers=dict(headers))
    if "retry-after" in plain.headers:
        response.headers["retry-after"] = plain.headers["retry-after"]
    if code in RETRY_CANNOT_HELP:
        response.headers["x-should-retry"] = "false"
    return response


def error_event(wire: WireFormat, exc: CeilingError) -> bytes:
    """The event a stream in `wire`'s format already answered 200 ends on: its SDK raises it."""
    return wire.error_event(_plain(exc)[1])


def refusal_headers(exc: CeilingError) -> dict[str, str]:
    headers = dict(NOTHING_HELD)
    remaining = exc.details.get("remaining_micros")
    if isinstance(remaining, int):
        headers["x-ceiling-remaining-micros"] = str(remaining)
    return headers


class RouteHandlers:
    """A route's own exception mapping, as Starlette's ExceptionMiddleware declares it, without
    the wrapping that middleware adds around the route: a route's endpoint already runs inside
    Starlette's handling of exceptions (starlette.routing.request_response), which maps them by
    the handlers in the request's scope, so this only puts its mapping there. The mapping is
    the one an ExceptionMiddleware with these handlers builds. One layer fewer for every call of
    the route to pass through (and its send wrapper for every message sent)."""

    def __init__(self, app: ASGIApp, handlers: Mapping[Any, ExceptionHandler]) -> None:
        self.app = app
        declared = ExceptionMiddleware(app, handlers=handlers)
        self._handlers = (declared._exception_handlers, declared._status_handlers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            scope["starlette.exception_handlers"] = self._handlers
        await self.app(scope, receive, send)


def refusals_in(wire: WireFormat) -> Middleware:
    """Declared on a gateway route (api/routes/gateway.py): the app's mapping, with the core's
    refusals answered in `wire`'s shape. A route's middleware runs inside the app's, and the
    handlers it declares are the ones its endpoint's exceptions meet; the framework's own errors
    (a 405, a body over the limit) keep the app's shape."""

    async def on_refusal(request: Request, exc: Exception) -> JSONResponse:
        refusal = cast(CeilingError, exc)
        return refusal_response(wire, refusal, refusal_headers(refusal))

    return Middleware(RouteHandlers, handlers={**errors.HANDLERS, CeilingError: on_refusal})


class Shapes:
    """core.gateway.Shapes: refusals in api/refusals.py's shapes."""

    @staticmethod
    def kept(wire: WireFormat, error: CeilingError) -> StoredReply:
        note = refusal_response(wire, error, {})
        return StoredReply(note.status_code, tuple(
            (k, v) for k, v in note.headers.items() if k != "content-length"),
            bytes(note.body).decode())

    @staticmethod
    def event(wire: WireFormat, error: CeilingError) -> bytes:
        return error_event(wire, error)
