"""The FastAPI application: routes, the error mapping, and a request-size limit."""

from __future__ import annotations

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import errors
from api.routes import admin, gateway, health, sidecar
from api.runtime import VERSION

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


def create_app() -> FastAPI:
    # The app serves the routers' routes itself instead of through include_router(): FastAPI
    # matches an included router through a layer of its own that cost more CPU per request
    # than the rest of a reserve's Python (bench/http.py). The enforcement routes come first,
    # so the calls made most are matched first.
    app = FastAPI(title="spend-ceiling", version=VERSION, routes=[
        *sidecar.router.routes, *gateway.router.routes, *health.router.routes,
        *admin.router.routes,
    ])
    errors.install(app)
    app.add_middleware(BodyLimit)
    return app
