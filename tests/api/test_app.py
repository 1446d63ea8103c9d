"""CeilingApp runs its lean routes ahead of FastAPI's stack with the same answers as FastAPI."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import Request, Response
from fastapi.responses import JSONResponse

from api import errors
from api.app import BODY_BYTES_MAX, BodyLimit, CeilingApp
from api.models import SettleBody
from api.routes.sidecar import parsed
from api.routing import LeanRoute
from core.errors import BudgetBusy, ReservationNotFound


async def echo(request: Request) -> Response:
    if request.headers.get("x-refuse"):
        raise ReservationNotFound("no such reservation", reservation_id="r1")
    body = await parsed(SettleBody, request)
    return JSONResponse({"id": request.path_params["rid"], "actual": body.actual_micros})


async def crowded(request: Request) -> Response:
    raise BudgetBusy("held by open reservations", budget_id="org:a", retry_after_s=1)


def app() -> CeilingApp:
    a = CeilingApp(routes=[LeanRoute("/v1/things/{rid}/settle", echo, methods=["POST"]),
                           LeanRoute("/v1/busy", crowded, methods=["POST"])])
    errors.install(a)
    a.add_middleware(BodyLimit)
    return a


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app(), root_path="/prefix")
    async with httpx.AsyncClient(transport=transport, base_url="http://test/prefix") as c:
        yield c


async def test_a_lean_route_gets_its_path_params_under_a_root_path(
    client: httpx.AsyncClient,
) -> None:
    r = await client.post("/v1/things/r-7/settle", json={"actual_micros": 5})
    assert (r.status_code, r.json()) == (200, {"id": "r-7", "actual": 5})


async def test_errors_on_a_lean_route_have_the_apps_shape(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/things/r-7/settle", json={"actual_micros": "5"})
    assert (r.status_code, r.json()["error"]["code"]) == (422, "invalid_request")
    assert r.json()["error"]["problems"][0]["field"] == "actual_micros"
    r = await client.post("/v1/things/r-7/settle", json={}, headers={"x-refuse": "1"})
    assert (r.status_code, r.json()["error"]["code"]) == (404, "reservation_not_found")
    r = await client.post("/v1/busy")
    assert (r.status_code, r.headers["retry-after"]) == (429, "1")


async def test_other_methods_and_paths_go_through_fastapi(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/things/r-7/settle")
    assert (r.status_code, r.json()["error"]["code"]) == (405, "method_not_allowed")
    r = await client.post("/v1/nothing")
    assert (r.status_code, r.json()["error"]["code"]) == (404, "not_found")


async def test_a_lean_route_keeps_the_body_limit(client: httpx.AsyncClient) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(BODY_BYTES_MAX // 1_000_000 + 1):
            yield b" " * 1_000_000

    r = await client.post("/v1/things/r-7/settle", content=chunks())
    assert (r.status_code, r.json()["error"]["code"]) == (413, "payload_too_large")


def test_lean_routes_stay_in_the_openapi_schema() -> None:
    assert set(app().openapi()["paths"]) == {"/v1/things/{rid}/settle", "/v1/busy"}
