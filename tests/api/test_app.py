"""The composition (api/app.py): the hot routes in Starlette, FastAPI for the rest, one stack
around both. In process, under a root path, on the single-replica ledger."""

from __future__ import annotations

import ast
import json
import re
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import httpx
import pytest
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import api.runtime
from api.app import BODY_BYTES_MAX, HOT_ROUTES, MIDDLEWARE, create_app
from api.routing import HEADER_SCHEMAS
from api.runtime import Runtime

ADMIN = {"Authorization": "Bearer admin-for-app-tests"}
ROOT_PATH = "/prefix"
API_DIR = Path(api.runtime.__file__).parent


class RequestId:
    """A middleware a deployment might add: every answer names its request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex.encode()

        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message["headers"], (b"x-request-id", request_id)]
            await send(message)

        await self.app(scope, receive, named)


@pytest.fixture(autouse=True)
def single_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's runtime, on the in-memory ledger, for the length of one test."""
    rt = Runtime.from_env({"CEILING_SINGLE_REPLICA": "1",
                           "CEILING_ADMIN_TOKEN": ADMIN["Authorization"][7:]})
    monkeypatch.setattr(api.runtime, "_runtime", rt)


def client_of(middleware: Sequence[Middleware] = MIDDLEWARE) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=create_app(middleware), root_path=ROOT_PATH)
    return httpx.AsyncClient(transport=transport, base_url=f"http://test{ROOT_PATH}")


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with client_of() as c:
        yield c


async def key_for(client: httpx.AsyncClient, ceiling_micros: int,
                  roles: tuple[str, ...] = ("sidecar",)) -> dict[str, str]:
    budget_id = f"org:a{uuid.uuid4().hex[:8]}"
    r = await client.put(f"/v1/admin/budgets/{budget_id}", headers=ADMIN, json={
        "limits": [{"period": "total", "ceiling_micros": ceiling_micros}]})
    assert r.status_code == 200, r.text
    r = await client.post("/v1/admin/keys", headers=ADMIN,
                          json={"budget_id": budget_id, "roles": list(roles)})
    assert r.status_code == 201, r.text
    return {"Authorization": f"Bearer {r.json()['api_key']}"}


async def chunks(total_bytes: int) -> AsyncIterator[bytes]:
    """A chunked body: no Content-Length, so only counting it as it streams can refuse it."""
    while total_bytes > 0:
        yield b" " * min(total_bytes, 1_000_000)
        total_bytes -= 1_000_000


async def test_a_hot_route_gets_its_path_params_under_a_root_path(
    client: httpx.AsyncClient,
) -> None:
    key = await key_for(client, 1_000)
    r = await client.post("/v1/reservations", headers=key, json={"amount_micros": 100})
    assert r.status_code == 201, r.text
    rid = r.json()["reservation_id"]
    r = await client.post(f"/v1/reservations/{rid}/settle", headers=key,
                          json={"actual_micros": 40})
    assert (r.status_code, r.json()["reservation_id"], r.json()["charged_micros"]) == (
        200, rid, 40)


async def test_errors_on_a_hot_route_have_the_apps_shape(client: httpx.AsyncClient) -> None:
    key = await key_for(client, 100)
    r = await client.post("/v1/reservations/r-7/settle", headers=key,
                          json={"actual_micros": "5"})
    assert (r.status_code, r.json()["error"]["code"]) == (422, "invalid_request")
    assert r.json()["error"]["problems"][0]["field"] == "actual_micros"
    r = await client.post("/v1/reservations/r-7/settle", headers=key, json={"actual_micros": 5})
    assert (r.status_code, r.json()["error"]["code"]) == (404, "reservation_not_found")
    assert (await client.post("/v1/reservations", headers=key,
                              json={"amount_micros": 100})).status_code == 201
    r = await client.post("/v1/reservations", headers=key, json={"amount_micros": 1})
    assert (r.status_code, r.json()["error"]["code"]) == (429, "budget_busy")
    assert int(r.headers["retry-after"]) >= 1


async def test_the_gateway_routes_refuse_in_openais_shape(client: httpx.AsyncClient) -> None:
    sidecar = await key_for(client, 100)
    for path in ("/v1/chat/completions", "/v1/responses"):
        r = await client.post(path, headers=sidecar, json={"model": "gpt-4o"})
        error = r.json()["error"]
        assert (r.status_code, error["code"], error["type"]) == (
            403, "forbidden", "permission_error")
        assert "param" in error
        assert r.headers["x-should-retry"] == "false"
        assert r.headers["x-ceiling-reserved-micros"] == "0"
    # The sidecar routes keep the app's shape: no `param`, no retry advice.
    gateway_only = await key_for(client, 100, ("gateway",))
    r = await client.post("/v1/reservations", headers=gateway_only, json={"amount_micros": 1})
    assert (r.status_code, r.json()["error"]["code"]) == (403, "forbidden")
    assert "param" not in r.json()["error"]
    assert "x-should-retry" not in r.headers


async def test_other_methods_and_paths_answer_in_the_apps_shape(
    client: httpx.AsyncClient,
) -> None:
    for path in ("/v1/reservations/r-7/settle", "/v1/chat/completions"):
        r = await client.get(path)
        assert (r.status_code, r.json()["error"]["code"]) == (405, "method_not_allowed")
        assert r.headers["allow"] == "POST"
    for method, path in (("POST", "/v1/nothing"), ("GET", "/v1/admin/nothing/here")):
        r = await client.request(method, path)
        assert (r.status_code, r.json()["error"]["code"]) == (404, "not_found")


@pytest.mark.parametrize("path", ["/v1/reservations", "/v1/chat/completions",
                                  "/v1/admin/budgets/org:big"])
async def test_every_route_keeps_the_body_limit(client: httpx.AsyncClient, path: str) -> None:
    # Callers the route admits, so that only the body's size stands in the way.
    method, auth = ("PUT", ADMIN) if "admin" in path else (
        "POST", await key_for(client, 100, ("sidecar", "gateway")))
    r = await client.request(method, path, headers=auth, content=chunks(BODY_BYTES_MAX + 1))
    assert (r.status_code, r.json()["error"]["code"]) == (413, "payload_too_large")
    r = await client.request(method, path, headers=auth, content=b" " * (BODY_BYTES_MAX + 1))
    assert (r.status_code, r.json()["error"]["code"]) == (413, "payload_too_large")


async def test_a_middleware_added_to_the_list_applies_to_every_route() -> None:
    added = (Middleware(RequestId), Middleware(CORSMiddleware, allow_origins=["https://a.test"],
                                               allow_methods=["*"], allow_headers=["*"]))
    async with client_of((*added, *MIDDLEWARE)) as client:
        key = await key_for(client, 1_000, ("sidecar", "gateway"))
        origin = {"Origin": "https://a.test"}
        answers = {
            "hot": await client.post("/v1/reservations", headers={**key, **origin},
                                     json={"amount_micros": 1}),
            "hot, refused": await client.post("/v1/reservations", headers=origin, json={}),
            "gateway, refused": await client.post("/v1/chat/completions",
                                                  headers={**key, **origin}, json={}),
            "my budgets": await client.get("/v1/budgets/me", headers={**key, **origin}),
            "admin": await client.get("/v1/admin/keys/key_x", headers={**ADMIN, **origin}),
            "health": await client.get("/health/live", headers=origin),
            "schema": await client.get("/openapi.json", headers=origin),
            "unknown path": await client.get("/v1/nothing", headers=origin),
            "too large": await client.post("/v1/reservations", headers={**key, **origin},
                                           content=b" " * (BODY_BYTES_MAX + 1)),
        }
        # A preflight is answered by the CORS middleware itself, for a hot route as for any.
        preflight = await client.options("/v1/reservations", headers={
            **origin, "Access-Control-Request-Method": "POST"})
    statuses = {name: r.status_code for name, r in answers.items()}
    assert statuses == {"hot": 201, "hot, refused": 401, "gateway, refused": 422,
                        "my budgets": 200, "admin": 405, "health": 200, "schema": 200,
                        "unknown path": 404, "too large": 413}
    for name, r in answers.items():
        assert len(r.headers.get("x-request-id", "")) == 32, name
        assert r.headers.get("access-control-allow-origin") == "https://a.test", name
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://a.test"


async def test_the_schema_documents_the_hot_routes_with_their_bodies(
    client: httpx.AsyncClient,
) -> None:
    r = await client.get("/openapi.json")
    schema = r.json()
    assert schema["servers"] == [{"url": ROOT_PATH}]
    paths = schema["paths"]
    for route in HOT_ROUTES:
        for method in route.methods:
            # The schema names a path parameter without its converter ({model:path}: {model}).
            operation = paths[re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path)][method.lower()]
            headers = {p["name"] for p in operation["parameters"] if p["in"] == "header"}
            assert ({"Authorization", "X-Ceiling-Run-Id"} <= headers) == route.keyed, route.path
            if route.body is not None:
                body = operation["requestBody"]["content"]["application/json"]["schema"]
                assert (set(body["properties"]), body.get("required")) == (
                    set(route.body["properties"]), route.body.get("required")), route.path
    chat = paths["/v1/chat/completions"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]
    assert {"model", "messages"} <= set(chat["required"])
    assert {"max_tokens", "max_completion_tokens", "n", "stream", "stream_options", "tools",
            "service_tier"} <= set(chat["properties"])
    responses = paths["/v1/responses"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]
    assert {"model", "input"} <= set(responses["required"])
    assert {"max_output_tokens", "stream", "tools", "service_tier", "reasoning"} <= set(
        responses["properties"])
    assert paths["/v1/reservations"]["post"]["responses"].keys() >= {"201"}
    # Embedded schemas carry no references into a document they are not in.
    assert "$ref" not in json.dumps([route.body for route in HOT_ROUTES])
    assert "/v1/admin/keys" in paths


def framework_classes(tree: ast.Module) -> set[str]:
    """Names a module binds to FastAPI's or Starlette's modules and their members."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in (
                "fastapi", "starlette"):
            names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.asname or a.name.split(".")[0] for a in node.names
                         if a.name.split(".")[0] in ("fastapi", "starlette"))
    return names


def test_api_subclasses_nothing_of_the_frameworks() -> None:
    found = []
    for path in sorted(API_DIR.rglob("*.py")):
        tree = ast.parse(path.read_text())
        framework = framework_classes(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for base in node.bases:
                    root = base
                    while isinstance(root, ast.Attribute):
                        root = root.value
                    if isinstance(root, ast.Name) and root.id in framework:
                        found.append(f"{path.name}: class {node.name}({ast.unparse(base)})")
    assert found == []


# (value, accepted as a run id, accepted as an Idempotency-Key)
HEADER_VALUES = [
    ("a", True, True), ("A.b_c-9", True, True), ("x" * 64, True, True), ("x" * 65, False, True),
    ("~" * 128, False, True), ("~" * 129, False, False), ("a/b", False, True),
    ("a b", False, False), ("\u00e9t\u00e9", False, False),
]


@pytest.mark.parametrize(("value", "run_id_ok", "idempotency_key_ok"), HEADER_VALUES)
async def test_the_documented_header_formats_are_what_the_service_accepts(
    client: httpx.AsyncClient, value: str, run_id_ok: bool, idempotency_key_ok: bool,
) -> None:
    key = await key_for(client, 1_000)
    for header, ok in (("X-Ceiling-Run-Id", run_id_ok), ("Idempotency-Key", idempotency_key_ok)):
        documented = re.fullmatch(HEADER_SCHEMAS[header]["pattern"], value) is not None
        r = await client.post("/v1/reservations", json={"amount_micros": 1},
                              headers={**key, header: value.encode()})
        assert (documented, r.status_code in (200, 201)) == (ok, ok), (header, r.text)
