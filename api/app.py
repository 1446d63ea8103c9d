"""The application: every route served by HotRouter (api/routing.py), one stack around them.

Every request goes through one stack, outermost first:

    ServerErrorMiddleware   Starlette's: an exception nothing handled is a 500
    *MIDDLEWARE             declared once, below: the body limit, and whatever is added there
    HotRouter               the key holders' and monitors' routes, each answering its own
                            errors by errors.HANDLERS, the one mapping of errors to answers;
                            then, for everything else, operators_app:
      HotRouter             the operators' routes (admin token), with the same mapping; then
      FastAPI               the docs, the OpenAPI schema (which documents every route), and
                            the 404s and 405s of what no route serves, with the same mapping

operators_app is built, and FastAPI and the operators' route modules imported, on the first
request that reaches it: a serverless instance started for a reserve, a gateway call or a
health check never imports FastAPI (bench/http.py judges `import api.index` against `import
fastapi`). A middleware added to MIDDLEWARE (CORS, request ids, tracing) applies to every
route; FastAPI's own per-request telemetry sees only what reaches FastAPI.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from typing import Any

from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.types import ASGIApp, Lifespan, Message, Receive, Scope, Send

from api import errors
from api.routes import gateway, health, metrics, sidecar
from api.routing import HotRouter
from api.runtime import VERSION

# The largest request body accepted: a chat request with a long prompt fits in a few hundred KB;
# anything larger is refused with 413 before it is parsed.
BODY_BYTES_MAX = 4 * 1024 * 1024
TOO_LARGE = f"request bodies are limited to {BODY_BYTES_MAX} bytes"
# Digits of BODY_BYTES_MAX: a Content-Length of more, leading zeros aside, is over it. Counted
# before int(), which raises ValueError (a 500) on over 4,300 digits: the HTTP server passes such
# a header on when its digits are zeros in front of a small number.
BODY_BYTES_DIGITS = len(str(BODY_BYTES_MAX))


def too_large(length: bytes) -> bool:
    """Whether a Content-Length is no number of bytes, or one over BODY_BYTES_MAX."""
    digits = length.lstrip(b"0")
    return (not length.isdigit() or len(digits) > BODY_BYTES_DIGITS
            or int(digits or b"0") > BODY_BYTES_MAX)


class BodyLimit:
    """Refuse bodies over BODY_BYTES_MAX: by Content-Length before the app runs, and a chunked
    body as it streams in (the app's exception mapping answers that one)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if too_large(length):
                await errors.error_response("payload_too_large", TOO_LARGE)(scope, receive, send)
                return
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
                raise HTTPException(413, TOO_LARGE)
            return message

        await self.app(scope, limited, send)


# Every request goes through these, outermost first, hot route or not.
MIDDLEWARE: tuple[Middleware, ...] = (Middleware(BodyLimit),)
HOT_ROUTES = (*sidecar.ROUTES, *gateway.ROUTES, *health.ROUTES, *metrics.ROUTES)


def operators_app() -> ASGIApp:
    """The operators' routes (admin token: admin, alerts, reconciliation, the dashboard), served
    as the hot ones are, in front of FastAPI, which documents every route and serves the docs."""
    from fastapi import FastAPI

    from api.routes import admin, alerts, dashboard, reconcile

    operators = (*admin.ROUTES, *alerts.ROUTES, *reconcile.ROUTES, *dashboard.ROUTES)
    documented = FastAPI(
        title="spend-ceiling", version=VERSION, exception_handlers=errors.fastapi_handlers(),
        routes=[r.documented() for r in (*operators, *HOT_ROUTES)],
    )
    return HotRouter(operators, documented, errors.HANDLERS)


class OnFirstRequest:
    """An ASGI app built by `build` when the first request reaches it, then that app.

    What the build imports and makes (FastAPI, pydantic's models, the routes) lives as long as
    the process, like the start-up objects `ceiling serve` freezes (api/cli.py run_server): it
    is frozen too once built. Left in the collector's generations, its tens of thousands of
    objects were walked by every full collection, a pause on every request in flight that made
    most of the gateway's p99 (bench/gateway_tail.py). Frozen objects are still freed when
    nothing refers to them; only the collector's cycle search passes them by."""

    def __init__(self, build: Callable[[], ASGIApp]) -> None:
        self.build = build
        self.app: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.app is None:
            self.app = self.build()
            gc.freeze()
        await self.app(scope, receive, send)


def create_app(middleware: Sequence[Middleware] = MIDDLEWARE,
               lifespan: Lifespan[Any] | None = None) -> ServerErrorMiddleware:
    """`lifespan`: what runs from start-up to shutdown; `ceiling serve` delivers alerts there."""
    # The dispatcher (api/routing.py HotRouter): a hot route's path and method go to that
    # route; anything else (admin, dashboard, docs, a hot path with another method, a path
    # nobody serves) to operators_app, with the path and root path as they came.
    app: ASGIApp = HotRouter(HOT_ROUTES, OnFirstRequest(operators_app), errors.HANDLERS,
                             lifespan)
    for cls, args, kwargs in reversed(middleware):
        app = cls(app, *args, **kwargs)
    return ServerErrorMiddleware(app)
