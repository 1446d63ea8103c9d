"""api/routing.py HotRouter: which request goes where, matched as Starlette's router would."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import Message, Receive, Scope, Send

from api.routing import HotRoute, HotRouter, body_of, header_of


async def other(scope: Scope, receive: Receive, send: Send) -> None:
    """What gets everything the hot routes do not serve."""
    await PlainTextResponse("other", status_code=299)(scope, receive, send)


async def named(request: Request) -> Response:
    return JSONResponse({"endpoint": "named", "params": request.path_params})


async def by_id(request: Request) -> Response:
    return JSONResponse({"endpoint": "by_id", "params": request.path_params})


async def echo(request: Request) -> Response:
    return JSONResponse({"body": (await body_of(request)).decode(),
                         "key": header_of(request, b"idempotency-key")})


async def refuses(request: Request) -> Response:
    raise HTTPException(418, "no")


async def teapot(request: Request, exc: Exception) -> Response:
    return PlainTextResponse("mapped", status_code=418)


ROUTES = (
    # Declared first, so it wins over the route below for /v1/things/named, as in Starlette.
    HotRoute("/v1/things/{thing_id}", by_id, methods=("GET",)),
    HotRoute("/v1/things/named", named, methods=("GET",)),
    HotRoute("/v1/echo", echo),
    HotRoute("/v1/refuses", refuses),
)


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    app = HotRouter(ROUTES, other, {HTTPException: teapot})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://test") as c:
        yield c


async def test_routes_are_matched_in_the_order_declared(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/things/named")
    assert r.json() == {"endpoint": "by_id", "params": {"thing_id": "named"}}


async def test_a_get_route_serves_head_and_other_methods_go_to_the_other_app(
    client: httpx.AsyncClient,
) -> None:
    assert (await client.head("/v1/things/a")).status_code == 200
    assert (await client.post("/v1/things/a")).status_code == 299
    assert (await client.get("/v1/echo")).status_code == 299
    assert (await client.get("/v1/nothing")).status_code == 299


async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def test_a_route_reads_its_body_and_headers(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/echo", content=b"hello", headers={"Idempotency-Key": "k1"})
    assert r.json() == {"body": "hello", "key": "k1"}
    r = await client.post("/v1/echo", content=chunks(b"he", b"llo"))
    assert r.json() == {"body": "hello", "key": None}


async def test_a_routes_exception_is_answered_by_the_mapping(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/refuses")
    assert (r.status_code, r.text) == (418, "mapped")


async def test_lifespan_events_reach_the_lifespan() -> None:
    seen: list[str] = []

    @contextlib.asynccontextmanager
    async def lifespan(app: object) -> AsyncIterator[None]:
        seen.append("started")
        yield
        seen.append("stopped")

    app = HotRouter(ROUTES, other, {}, lifespan)
    messages = iter([{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}])
    sent: list[str] = []

    async def receive() -> Message:
        return next(messages)

    async def send(message: Message) -> None:
        sent.append(message["type"])

    await app({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send)
    assert seen == ["started", "stopped"]
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
