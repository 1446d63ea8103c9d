"""The hot routes, each declared once: served by Starlette, documented by FastAPI.

Reserve, settle, release, the caller's budgets, the gateway's calls and the monitors' health
checks are nearly all of the traffic. Each takes the Request and returns a Response, reading
its own headers and body: FastAPI's request handling (dependency solving, a per-request exit
stack) costs more CPU per call than the ledger round trip (bench/http.py prints both).
api/app.py serves them as plain Starlette routes; FastAPI holds a documented copy of each, so
that its OpenAPI schema describes them with their real headers and request bodies, for clients
and for the fuzzer. The copy never
runs its endpoint: the app's router matches a hot route's path and method first, and FastAPI
sees only the other methods on that path, which the copy answers with a 405.

The gateway's routes are made from its wire formats (core/formats), one each (format_route).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from core.formats import FORMATS, WireFormat
from core.formats.base import Schema
from core.limits import RESERVATION_ID_LEN_MAX

if TYPE_CHECKING:
    from fastapi.routing import APIRoute

Endpoint = Callable[[Request], Awaitable[Response]]
# A gateway route's endpoint, given the wire format it serves.
FormatEndpoint = Callable[[Request, WireFormat], Awaitable[Response]]

# The headers every hot route reads: the caller's key, its run and its end user.
HEADERS_COMMON = ("Authorization", "X-Ceiling-Run-Id", "X-Ceiling-User")
# What the service accepts in each header it reads (core/service.py checks the ids).
HEADER_SCHEMAS: dict[str, dict[str, Any]] = {
    "Authorization": {"type": "string",
                      "description": "Bearer <api key> (on health: the admin token, optional)"},
    "X-Ceiling-Run-Id": {"type": "string", "pattern": "^[A-Za-z0-9._-]{1,64}$"},
    "X-Ceiling-User": {"type": "string", "pattern": "^[A-Za-z0-9._:@-]{1,128}$",
                       "description": "the call's end user, held to its budget's per_user limits"},
    "Idempotency-Key": {"type": "string",
                        "pattern": f"^[\\x21-\\x7e]{{1,{RESERVATION_ID_LEN_MAX}}}$"},
    "X-Ceiling-Clamp": {"type": "string", "enum": ["0", "1"],
                        "description": "1: lower the output cap to what the budgets have room for"},
    # Each wire format's own: the key as its clients send it, and what is forwarded with it.
    **{name: schema for wire in FORMATS.values() for name, schema in wire.header_schemas.items()},
}
_PATH_PARAM = re.compile(r"{(\w+)")


@dataclass(frozen=True)
class HotRoute:
    path: str
    endpoint: Endpoint
    methods: tuple[str, ...] = ("POST",)
    body: dict[str, Any] | None = None  # the request body's JSON Schema
    headers: tuple[str, ...] = ()  # headers read beyond HEADERS_COMMON
    # A key holder's route, which reads HEADERS_COMMON; health is not one.
    keyed: bool = True
    status_code: int = 200  # the documented success
    # The route's own, inside the app's stack: e.g. its errors in another shape.
    middleware: tuple[Middleware, ...] = ()

    def served(self) -> Route:
        return Route(self.path, self.endpoint, methods=list(self.methods),
                     middleware=list(self.middleware))

    def documented(self) -> APIRoute:
        # Imported here: only FastAPI's app (built on its first request) documents the routes.
        from fastapi.routing import APIRoute

        return APIRoute(self.path, self.endpoint, methods=list(self.methods),
                        status_code=self.status_code, openapi_extra=self.openapi())

    def openapi(self) -> dict[str, Any]:
        """What FastAPI cannot see in an endpoint that reads its own request."""
        parameters = [
            {"name": h, "in": "header", "required": False, "schema": HEADER_SCHEMAS[h]}
            for h in (*(HEADERS_COMMON if self.keyed else ()), *self.headers)
        ] + [
            {"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
            for p in _PATH_PARAM.findall(self.path)
        ]
        extra: dict[str, Any] = {"parameters": parameters}
        if self.body is not None:
            extra["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": self.body}}}
        return extra


def format_route(wire: WireFormat, serve: FormatEndpoint, *, headers: tuple[str, ...],
                 body: Schema | None, middleware: tuple[Middleware, ...]) -> HotRoute:
    """`wire`'s hot route: at its path, `serve` with the format, reading the format's headers
    before `headers`. Its endpoint takes the format's name, which the OpenAPI document shows as
    the operation's id and summary."""

    async def endpoint(request: Request) -> Response:
        return await serve(request, wire)

    endpoint.__name__ = endpoint.__qualname__ = wire.name
    return HotRoute(wire.route, endpoint, body=body, headers=(*wire.headers, *headers),
                    middleware=middleware)
