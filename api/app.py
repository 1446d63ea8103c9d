"""The FastAPI application: routes, the error mapping, and a request-size limit."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import errors
from api.routes import admin, gateway, health, sidecar
from api.routing import LeanRoute
from api.runtime import VERSION
from core.errors import CeilingError

# The largest request body accepted: a chat request with a long prompt fits in a few hundred KB;
# anything larger is refused with 413 before it is parsed.
BODY_BYTES_MAX = 4 * 1024 * 1024


class BodyLimit:
    """Refuse bodies over BODY_BYTES_MAX, by Content-Length and while streaming."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > BODY_BYTES_MAX):
            await errors.error_response(
                "payload_too_large", f"request bodies are limited to {BODY_BYTES_MAX} bytes"
            )(scope, receive, send)
            return
        if length is not None:
            # The HTTP server reads no more than Content-Length: only a chunked body can grow
            # past what was announced, so only that one is counted as it streams in.
            await self.app(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > BODY_BYTES_MAX:
                raise errors.PayloadTooLarge()
            return message

        try:
            await self.app(scope, limited, send)
        except errors.PayloadTooLarge:
            await errors.error_response(
                "payload_too_large", f"request bodies are limited to {BODY_BYTES_MAX} bytes"
            )(scope, receive, send)


class CeilingApp(FastAPI):
    """The FastAPI app, with its lean routes dispatched ahead of FastAPI's middleware stack.

    Reserve, settle, release and the gateway's calls are nearly all of the traffic. FastAPI's
    middleware stack and router cost ~90 us of CPU a request here (an in-process A/B), about a
    third of what the service spent beyond its ledger round trip; bench/http.py shows the
    effect end to end. A request for a lean route (its path
    and method) is run here directly, inside the same body limit, with the app's error mapping;
    everything else goes through FastAPI. The lean routes stay FastAPI's routes, which is what
    documents them in the OpenAPI schema.

    What those requests skip: FastAPI's own per-request telemetry (an OpenTelemetry ASGI
    middleware wrapped around the whole app still sees them) and its exception handlers, whose
    mapping they share through api/errors.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._lean = [r for r in self.router.routes if isinstance(r, LeanRoute)]
        self._lean_limited = BodyLimit(self._serve_lean)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for route in self._lean:
                # The route's own matcher: its path, its methods, its converters, the root path.
                match, child_scope = route.matches(scope)
                if match is Match.FULL:
                    scope.update(child_scope, app=self)
                    await self._lean_limited(scope, receive, send)
                    return
        await super().__call__(scope, receive, send)

    async def _serve_lean(self, scope: Scope, receive: Receive, send: Send) -> None:
        route: LeanRoute = scope["route"]
        try:
            response = await route.handler(Request(scope, receive, send))
        except CeilingError as exc:
            response = errors.ceiling_error_response(exc)
        except RequestValidationError as exc:
            response = errors.validation_error_response(exc)
        await response(scope, receive, send)


def create_app() -> FastAPI:
    # The app serves the routers' routes itself instead of through include_router(): FastAPI
    # matches an included router through a layer of its own that cost more CPU per request
    # than the rest of a reserve's Python (bench/http.py).
    app = CeilingApp(title="spend-ceiling", version=VERSION, routes=[
        *sidecar.router.routes, *gateway.router.routes, *health.router.routes,
        *admin.router.routes,
    ])
    errors.install(app)
    app.add_middleware(BodyLimit)
    return app
