"""The gateway's routes: one per wire format (core/formats FORMATS), and each token counting
route. Each parses its request and sends the answer core/gateway.py Gateway decides: price ->
reserve -> call -> settle, and the bill's headers (core/gateway.py bill_headers). API keys need
the `gateway` role, sent as a bearer token or where the format's own clients send theirs
(`x-api-key`; `x-goog-api-key` or `?key=`). Refusals are in the format's error shape."""

from __future__ import annotations

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from api.auth import authenticated
from api.refusals import Shapes, refusal_response, refusals_in
from api.routing import HotRoute, format_route, header_of
from api.runtime import runtime
from api.upstream import upstream
from api.upstreams import routed_client
from core.errors import ensure
from core.formats import FORMATS, WireFormat
from core.gateway import Answer, Gateway, Refused
from core.ledger import ReplyStore, Role

# Headers the gateway reads beyond the key and the run (api/routing.py HEADERS_COMMON).
HEADERS = ("Idempotency-Key", "X-Ceiling-Clamp")
# The request bodies the OpenAPI document shows (documentation only), by format.
BODIES = {api: wire.body_schema for api, wire in FORMATS.items()}


def replies() -> ReplyStore:
    """The idempotency keys' store: asked for only by a call that names a key."""
    return runtime().store().replies


GATEWAY = Gateway(upstream, replies, Shapes(), client_of=routed_client)


def forwarded(request: Request, wire: WireFormat) -> tuple[tuple[str, str], ...]:
    """The request's headers that its format forwards to the provider."""
    names = wire.forwarded_headers
    return tuple((k, v) for k, v in request.headers.items() if k in names) if names else ()


def answered(wire: WireFormat, answer: Answer | Refused) -> Response:
    """What Gateway answered, as Starlette sends it; a refusal in `wire`'s error shape."""
    if isinstance(answer, Refused):
        return refusal_response(wire, answer.error, answer.headers)
    status, headers, body, background = answer
    if not isinstance(body, bytes):
        return StreamingResponse(body, status, headers)
    return Response(body, status, headers,
                    background=None if background is None else BackgroundTask(background))


def key_sent(request: Request, wire: WireFormat) -> str | None:
    """The key where `wire`'s clients send it besides Authorization: its key header, else its
    key query parameter (Anthropic's x-api-key; Google's x-goog-api-key, ?key=). The query's key
    goes no further: the upstream's client makes its own URL, its own key in it."""
    if wire.key_header is not None:
        found = header_of(request, wire.key_header.encode())
        if found is not None:
            return found
    return None if wire.key_query is None else request.query_params.get(wire.key_query)


async def serve(request: Request, wire: WireFormat) -> Response:
    """A call; a format that names its model in its path (Gemini's) has it from the path."""
    svc, who = await authenticated(request, Role.GATEWAY, key_sent=key_sent(request, wire))
    headers = request.headers
    return answered(wire, await GATEWAY.serve(
        svc, who, wire, await request.body(), forwarded(request, wire), runtime().config,
        clamp=headers.get("x-ceiling-clamp") == "1",
        idempotency_key=headers.get("idempotency-key"),
        path_model=request.path_params.get("model")))


async def count(request: Request, wire: WireFormat) -> Response:
    """A token count (Messages' count_tokens, Gemini's :countTokens; Gateway.count)."""
    svc, who = await authenticated(request, Role.GATEWAY, key_sent=key_sent(request, wire))
    return answered(wire, await GATEWAY.count(svc, who, wire, await request.body(),
                                              forwarded(request, wire), runtime().config,
                                              path_model=request.path_params.get("model")))


def versioned(wire: WireFormat, path: str, version: str) -> str:
    """`wire`'s `path` (written with its first API version) under `version`."""
    return f"/{version}/" + path.removeprefix(f"/{wire.path_versions[0]}/")


def count_name(wire: WireFormat) -> str:
    """`wire`'s token counting route's endpoint name (WireFormat.count_name)."""
    return wire.count_name or f"{wire.name}_count_tokens"


def counted_by(wire: WireFormat) -> bool:
    """Whether `wire` makes its token counting route: two formats of one API (a call and its
    stream) share one, made with the first of them in FORMATS."""
    return wire.count_route is not None and wire is next(
        w for w in FORMATS.values() if w.count_route == wire.count_route)


def in_path_routes(wire: WireFormat) -> tuple[HotRoute, ...]:
    """The routes of a format that names its model in its path, one per API version its
    clients call (WireFormat.path_versions), and its token counting route's (counted_by).
    Each version's endpoint has a name of its own, the OpenAPI document's operation id."""
    middleware = (refusals_in(wire),)
    counts = counted_by(wire)
    routes: list[HotRoute] = []
    for version in wire.path_versions:
        suffix = "" if version == wire.path_versions[0] else f"_{version}"

        async def call(request: Request) -> Response:
            return await serve(request, wire)

        call.__name__ = call.__qualname__ = wire.name + suffix
        routes.append(HotRoute(versioned(wire, wire.route, version), call, body=BODIES[wire.api],
                               headers=(*wire.headers, *HEADERS), middleware=middleware))
        if counts:

            async def counted(request: Request) -> Response:
                return await count(request, wire)

            counted.__name__ = counted.__qualname__ = count_name(wire) + suffix
            routes.append(HotRoute(versioned(wire, str(wire.count_route), version), counted,
                                   body=BODIES[wire.api], headers=wire.headers,
                                   middleware=middleware))
    return tuple(routes)


def route(wire: WireFormat) -> HotRoute:
    """`wire`'s hot route (api/routing.py), its refusals in its shape."""
    return format_route(wire, serve, headers=HEADERS, body=BODIES.get(wire.api),
                        middleware=(refusals_in(wire),))


def count_route(wire: WireFormat) -> HotRoute:
    """`wire`'s token counting route, its refusals in its shape."""
    ensure(wire.count_route is not None, f"{wire.api} has no token counting route")

    async def endpoint(request: Request) -> Response:
        return await count(request, wire)

    endpoint.__name__ = endpoint.__qualname__ = count_name(wire)
    return HotRoute(str(wire.count_route), endpoint, body=BODIES.get(wire.api),
                    headers=wire.headers, middleware=(refusals_in(wire),))


# The hot routes of this module: one per wire format, and one per token counting endpoint.
# Formats that name their model in their path (Gemini's) come last: their paths are matched by
# pattern (api/routing.py HotRouter), after every other route's.
ROUTES = (*(route(wire) for wire in FORMATS.values() if not wire.model_in_path),
          *(count_route(wire) for wire in FORMATS.values()
            if counted_by(wire) and not wire.model_in_path),
          *(r for wire in FORMATS.values() if wire.model_in_path for r in in_path_routes(wire)))
