"""How a route is written: the one pattern, and the one place its requests are dispatched.

Every route is an `async def name(request: Request) -> Response` that reads its own headers,
query and body (api/auth.py for who is calling, `query_of` for a query parameter, `parsed` for a
body, each refusing what does not match with the one error tree's 422 invalid_request), declared
once as a HotRoute: its path, methods, and what it reads, for the document. HotRouter serves
it; FastAPI holds a documented copy of it (HotRoute.documented), so that the OpenAPI schema
describes it with its real headers, query parameters and request body, for clients and for the
fuzzer. The copy never runs its endpoint: HotRouter matches the route's path and method first,
and FastAPI sees only the other methods on that path, which the copy answers with a 405.

Two sets of routes, one pattern. A key holder's or a monitor's route (reserve, settle, release,
the caller's budgets and spend series, the gateway's calls, health and metrics: nearly all of
the traffic) is served by the app's HotRouter, which never imports FastAPI: FastAPI's request
handling (dependency solving, a per-request exit stack) costs more CPU per call than the ledger
round trip (bench/http.py prints both). An operator's route, behind the admin token (admin,
alerts, reconciliation, the dashboard; HotRoute.admin), is served by a second HotRouter built
with FastAPI on the first request that needs either (api/app.py operators_app); its copy is
documented as FastAPI documents a signature (HotRoute.signed), its body model one of the
schema's components, which clients read by name.

The gateway's routes are made from its wire formats (core/formats), one each (format_route).
"""

from __future__ import annotations

import inspect
import keyword
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, TypeVar, cast

from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.exceptions import ExceptionMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Router, compile_path
from starlette.types import ASGIApp, ExceptionHandler, Lifespan, Receive, Scope, Send

from api.errors import InvalidBody
from core.formats import FORMATS, WireFormat
from core.formats.base import Schema
from core.jsonbody import check_depth
from core.limits import RESERVATION_ID_LEN_MAX

if TYPE_CHECKING:
    from fastapi.routing import APIRoute

Endpoint = Callable[[Request], Awaitable[Response]]
HttpHandler = Callable[[Request, Exception], Awaitable[Response]]
# A gateway route's endpoint, given the wire format it serves.
FormatEndpoint = Callable[[Request, WireFormat], Awaitable[Response]]

# The headers every hot route reads: the caller's key, its run and its end user.
HEADERS_COMMON = ("Authorization", "X-Ceiling-Run-Id", "X-Ceiling-User")
# What the service accepts in each header it reads (core/service.py checks the ids).
HEADER_SCHEMAS: dict[str, dict[str, Any]] = {
    "Authorization": {"type": "string",
                      "description": "Bearer <api key> (on health: the admin token, optional; "
                                     "on metrics: the metrics or the admin token)"},
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
B = TypeVar("B", bound=BaseModel)
# How a query parameter of each kind is read: as pydantic reads a string as one.
_ADAPTERS: dict[type, TypeAdapter[Any]] = {k: TypeAdapter(k) for k in (str, int, bool)}


@dataclass(frozen=True)
class Query:
    """A query parameter a route reads (query_of parses it), as the OpenAPI document shows it."""

    name: str
    kind: type[str | int | bool] = str
    default: str | int | bool | None = None

    def parameter(self) -> inspect.Parameter:
        from fastapi import Query as Documented

        kind: Any = self.kind if self.default is not None else self.kind | None
        # `from` is a keyword: the signature's name is another, the alias the query's.
        name = f"{self.name}_" if keyword.iskeyword(self.name) else self.name
        return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=self.default,
                                 annotation=Annotated[kind, Documented(alias=self.name)])


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
    # An operator's route (api/auth.py admin): the Authorization header it reads, its path and
    # query parameters and its body model are documented as FastAPI documents a signature's,
    # the model as one of the schema's components, which clients read by name.
    admin: bool = False
    query: tuple[Query, ...] = ()
    model: type[BaseModel] | None = None
    model_optional: bool = False  # no body at all is the model's None
    in_schema: bool = True  # the dashboard's HTML pages are no part of the API

    def served(self, handlers: Handlers) -> ASGIApp:
        """The route as HotRouter serves it: its middleware around its endpoint, which answers
        the exceptions it raises by `handlers`, or by those a middleware of the route put in
        the request's scope (api/refusals.py RouteHandlers)."""
        endpoint = self.endpoint

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            request = Request(scope, receive, send)
            try:
                response = await endpoint(request)
            except Exception as exc:
                handler = handler_for(exc, scope.get("starlette.exception_handlers", handlers))
                if handler is None:
                    raise
                # Every handler of the app's is a coroutine function (api/errors.py).
                response = await cast(HttpHandler, handler)(request, exc)
                exc.__traceback__ = None  # as Starlette's: a kept exception keeps no frames
            await response(scope, receive, send)

        served: ASGIApp = app
        for cls, args, kwargs in reversed(self.middleware):
            served = cls(served, *args, **kwargs)
        return served

    def documented(self) -> APIRoute:
        # Imported here: only FastAPI's app (built on its first request) documents the routes.
        from fastapi.routing import APIRoute

        if self.admin:
            return APIRoute(self.path, self.signed(), methods=list(self.methods),
                            status_code=self.status_code, include_in_schema=self.in_schema)
        return APIRoute(self.path, self.endpoint, methods=list(self.methods),
                        status_code=self.status_code, openapi_extra=self.openapi(),
                        include_in_schema=self.in_schema)

    def signed(self) -> Callable[..., Awaitable[Response]]:
        """An operator's route as FastAPI documents it: a stand-in of the endpoint's name and
        docstring with a signature of what the route reads. Never called (HotRouter serves
        the route)."""
        from fastapi import Body, Header

        P = inspect.Parameter
        params = [P(p, P.KEYWORD_ONLY, annotation=str) for p in _PATH_PARAM.findall(self.path)]
        params += [q.parameter() for q in self.query]
        if self.model is not None:
            optional = self.model_optional
            params.append(P("body", P.KEYWORD_ONLY, default=None if optional else P.empty,
                            annotation=Annotated[self.model | None if optional else self.model,
                                                 Body()]))
        params.append(P("authorization", P.KEYWORD_ONLY, default=None,
                        annotation=Annotated[str | None, Header()]))

        async def stand_in(**_: Any) -> Response:
            raise NotImplementedError  # pragma: no cover

        stand_in.__name__ = stand_in.__qualname__ = self.endpoint.__name__
        stand_in.__doc__ = self.endpoint.__doc__
        stand_in.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        return stand_in

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


async def body_of(request: Request) -> bytes:
    """The request's body, read from its stream once (what Request.body() returns, and like it
    ClientDisconnect if the client went away), without the async generator Request.stream()
    makes and steps through for every request: a hot route reads its body once."""
    chunks: list[bytes] = []
    while True:
        message = await request.receive()
        if message["type"] == "http.request":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        elif message["type"] == "http.disconnect":
            raise ClientDisconnect


async def parsed(model: type[B], request: Request) -> B:
    """The request's body as `model`; InvalidBody (422 invalid_request) if it is not one."""
    return _validated(model, await body_of(request))


async def parsed_or_none(model: type[B], request: Request) -> B | None:
    """As parsed, where no body (or a JSON null) is the body's None."""
    raw = await body_of(request)
    return None if raw.strip() in (b"", b"null") else _validated(model, raw)


def _validated(model: type[B], raw: bytes) -> B:
    check_depth(raw)  # the gateway's limit, on every route
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise InvalidBody(exc.errors(include_url=False, include_context=False)) from exc


def query_of(request: Request, query: Query) -> Any:
    """`query`'s value in the request (the last one given), or its default; InvalidBody (422
    invalid_request) if it is not of its kind, as pydantic reads a string as one."""
    given = request.query_params.get(query.name)
    if given is None:
        return query.default
    try:
        return _ADAPTERS[query.kind].validate_python(given)
    except ValidationError as exc:
        raise InvalidBody([{**e, "loc": ("query", query.name)} for e in exc.errors(
            include_url=False, include_context=False)]) from exc


def header_of(request: Request, name: bytes) -> str | None:
    """The first `name` header (lower case, as ASGI names them) of the request, as
    Request.headers.get gives it, without its KeyError for a header the request lacks."""
    headers: list[tuple[bytes, bytes]] = request.scope["headers"]
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None


# An exception mapping as Starlette keeps one in a request's scope: by exception class, and for
# an HTTPException by its status code first.
Handlers = tuple[dict[Any, ExceptionHandler], dict[int, ExceptionHandler]]


def handlers_of(declared: Mapping[Any, ExceptionHandler]) -> Handlers:
    """`declared` (api/errors.py HANDLERS) in the form Starlette's ExceptionMiddleware makes of
    it, which is the form a route's own mapping takes (api/refusals.py)."""
    made = ExceptionMiddleware(_nothing, handlers=declared)
    return made._exception_handlers, made._status_handlers


def handler_for(exc: Exception, handlers: Handlers) -> ExceptionHandler | None:
    """The handler of `exc` in `handlers`, looked up as Starlette looks it up; None: none."""
    by_class, by_status = handlers
    if isinstance(exc, HTTPException):
        found = by_status.get(exc.status_code)
        if found is not None:
            return found
    for cls in type(exc).__mro__:
        if cls in by_class:
            return by_class[cls]
    return None


async def _nothing(scope: Scope, receive: Receive, send: Send) -> None:
    raise NotImplementedError


class HotRouter:
    """The app's router: a hot route's path and method go to that route, anything else (admin,
    the dashboard, the docs, a hot path with another method, a path nobody serves) to `other`.

    Starlette's Router and its request_response would do the same, at a cost on every hot call
    that is not theirs to save: the hot routes are tried one by one (a gateway call's path was
    the fifth), each match makes a scope of its own, and the endpoint runs inside two layers of
    exception mapping, the app's ExceptionMiddleware and the route's own, each with a Request
    and a wrapper around every message sent. Here a path without parameters is one dict
    lookup, the others are matched as Starlette matches them (compile_path), in the order
    declared, and each route maps its endpoint's exceptions once (HotRoute.served), as
    Starlette would. `other` maps its own: FastAPI's app does. Lifespan events go to a
    Starlette Router that has no routes, only `lifespan`."""

    def __init__(self, routes: Sequence[HotRoute], other: ASGIApp,
                 handlers: Mapping[Any, ExceptionHandler],
                 lifespan: Lifespan[Any] | None = None) -> None:
        mapping = handlers_of(handlers)
        self._other = other
        self._lifespan = Router(lifespan=lifespan)
        self._static: dict[tuple[str, str], tuple[ASGIApp, Endpoint]] = {}
        self._patterns: list[tuple[re.Pattern[str], frozenset[str], ASGIApp, Endpoint]] = []
        for route in routes:
            served = route.served(mapping)
            # Starlette serves HEAD wherever it serves GET.
            methods = frozenset({*route.methods, *(("HEAD",) if "GET" in route.methods else ())})
            regex, _, convertors = compile_path(route.path)
            # compile_path's parameters are strings here (no `{x:int}`): kept as matched.
            ensure_strings(route.path, convertors)
            if convertors or any(p.match(route.path) for p, *_ in self._patterns):
                self._patterns.append((regex, methods, served, route.endpoint))
            else:
                for method in methods:
                    self._static.setdefault((route.path, method), (served, route.endpoint))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = route_path(scope)
            found = self._static.get((path, scope["method"]))
            if found is not None:
                scope["endpoint"] = found[1]
                await found[0](scope, receive, send)
                return
            for regex, methods, served, endpoint in self._patterns:
                matched = regex.match(path)
                if matched is not None and scope["method"] in methods:
                    scope["endpoint"] = endpoint
                    scope["path_params"] = {**scope.get("path_params", {}),
                                            **matched.groupdict()}
                    await served(scope, receive, send)
                    return
        elif scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        await self._other(scope, receive, send)


def ensure_strings(path: str, convertors: Mapping[str, Any]) -> None:
    if any(c.regex not in ("[^/]+", ".*") for c in convertors.values()):
        raise ValueError(f"a route's path parameters are strings (`:path` may hold a /): {path}")


def route_path(scope: Scope) -> str:
    """The path the routes are matched against: the request's, less the root path it is served
    under (starlette's get_route_path)."""
    path: str = scope["path"]
    root_path: str = scope.get("root_path", "")
    if root_path and path.startswith(root_path):
        if path == root_path:
            return ""
        if path[len(root_path)] == "/":
            return path[len(root_path):]
    return path
