"""The platform entry points: the Lambda handler with real API Gateway v2 events, and the
Vercel entry loaded the way Vercel's Python runtime loads it (by file path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

from infra.redis_server import RedisServer
from tests.api.conftest import ADMIN_TOKEN

LAMBDA_DRIVER = r"""
import json, sys
from api.lambda_handler import handler

class Context:
    function_name = "spend-ceiling"; aws_request_id = "req-1"; memory_limit_in_mb = 512
    invoked_function_arn = "arn:aws:lambda:eu-west-1:123456789012:function:spend-ceiling"
    def get_remaining_time_in_millis(self): return 30_000

def event(method, path, body=None, token=None):
    headers = {"content-type": "application/json",
               "host": "abc.execute-api.eu-west-1.amazonaws.com"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    return {
        "version": "2.0", "routeKey": "$default", "rawPath": path, "rawQueryString": "",
        "headers": headers, "isBase64Encoded": False,
        "body": json.dumps(body) if body is not None else None,
        "requestContext": {
            "accountId": "123456789012", "apiId": "abc", "domainName": headers["host"],
            "domainPrefix": "abc", "requestId": "r", "routeKey": "$default", "stage": "$default",
            "time": "30/Nov/2026:12:00:00 +0000", "timeEpoch": 1796040000000,
            "http": {"method": method, "path": path, "protocol": "HTTP/1.1",
                     "sourceIp": "127.0.0.1", "userAgent": "test"},
        },
    }

tag, admin = sys.argv[1], sys.argv[2]
out = []
def call(*args, **kwargs):
    r = handler(event(*args, **kwargs), Context())
    out.append([r["statusCode"], json.loads(r["body"]) if r.get("body") else None])
    return out[-1]
call("GET", "/health")
call("PUT", f"/v1/admin/budgets/{tag}", {"limits": [{"period": "total", "ceiling_micros": 100}]},
     token=admin)
key = call("POST", "/v1/admin/keys", {"budget_id": tag, "roles": ["sidecar"]},
           token=admin)[1]["api_key"]
rid = call("POST", "/v1/reservations", {"amount_micros": 100}, token=key)[1]["reservation_id"]
call("POST", f"/v1/reservations/{rid}/settle", {"actual_micros": 100}, token=key)
call("POST", "/v1/reservations", {"amount_micros": 1}, token=key)
from api.runtime import runtime
print(json.dumps({"answers": out, "client": id(runtime().service.store._t._client)}))
"""


def _connections(redis_server: RedisServer) -> int:
    import redis

    info = redis.Redis.from_url(redis_server.url).info("stats")
    return int(info["total_connections_received"])


def test_lambda_handler_answers_api_gateway_v2_events(redis_server: RedisServer) -> None:
    tag = f"org:l{uuid.uuid4().hex[:10]}"
    env = {**os.environ, "REDIS_URL": redis_server.url, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN}
    before = _connections(redis_server)
    done = subprocess.run([sys.executable, "-c", LAMBDA_DRIVER, tag, ADMIN_TOKEN], env=env,
                          capture_output=True, text=True, timeout=60, check=True)
    result = json.loads(done.stdout.splitlines()[-1])
    statuses = [status for status, _ in result["answers"]]
    assert statuses == [200, 200, 201, 201, 200, 402], result
    assert result["answers"][0][1]["status"] == "ok"
    # Six warm invocations in one process share its connections: they do not reconnect. One
    # for the client's commands, one for the scripts' (core/stores/redis_resp.py), and the one
    # this count opens.
    assert _connections(redis_server) - before <= 3


VERCEL_DRIVER = r"""
import asyncio, importlib.util, json
import httpx
# Vercel's Python runtime loads the entry by path and serves its ASGI `app`.
spec = importlib.util.spec_from_file_location("__vc_main__", "api/index.py")
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)

async def main():
    transport = httpx.ASGITransport(app=module.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://vercel") as c:
        r = await c.get("/health")
        print(json.dumps([r.status_code, r.json()["status"]]))
asyncio.run(main())
"""


def test_vercel_entry_loads_by_path_and_serves(redis_server: RedisServer) -> None:
    env = {**os.environ, "REDIS_URL": redis_server.url}
    done = subprocess.run([sys.executable, "-c", VERCEL_DRIVER], env=env, capture_output=True,
                          text=True, timeout=60, check=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert json.loads(done.stdout.splitlines()[-1]) == [200, "ok"]


# FastAPI's callables a full collection may walk once the admin surface was built and frozen: a
# few made by the requests since, never the hundreds its import makes.
WALKED_AFTER_FREEZE_MAX = 50

COLD_IMPORT = r"""
import gc, json, sys
import api.index
hot = sorted(m for m in sys.modules if m.startswith("api.routes."))
fastapi_before = "fastapi" in sys.modules
from starlette.testclient import TestClient
with TestClient(api.index.app) as client:
    status = client.get("/health").status_code
    fastapi_after_health = "fastapi" in sys.modules
    client.get("/v1/admin/keys/key_x")
    # What a full collection would walk: FastAPI's own functions, if they were left to it.
    walked = sum(1 for o in gc.get_objects() if callable(o) and isinstance(
        getattr(o, "__module__", None), str) and o.__module__.startswith("fastapi"))
print(json.dumps({"before": hot, "fastapi_before": fastapi_before, "status": status,
                  "fastapi_after_health": fastapi_after_health,
                  "after": "api.routes.admin" in sys.modules, "walked": walked}))
"""


def test_an_instance_imports_the_admin_surface_on_its_first_request_for_it() -> None:
    # A serverless instance started for a reserve or a gateway call imports only the hot
    # routes, and no FastAPI (bench/http.py judges the import's time), nor does health; FastAPI
    # and the admin and dashboard routes come with the first request that reaches them.
    done = subprocess.run([sys.executable, "-c", COLD_IMPORT], capture_output=True, text=True,
                          timeout=60, check=True)
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["before"] == ["api.routes.gateway", "api.routes.health", "api.routes.metrics",
                              "api.routes.sidecar"]
    assert seen["fastapi_before"] is False  # not even for its exceptions or route classes
    assert seen["fastapi_after_health"] is False  # a monitor's check is a hot route
    assert seen["after"] is True
    assert seen["status"] in (200, 503)
    # Built once, it is frozen with what it imported (api/app.py OnFirstRequest): the
    # collector's full collections do not walk it on every request in flight. Left out, its
    # functions alone are hundreds; what is left is made by the requests since.
    assert seen["walked"] < WALKED_AFTER_FREEZE_MAX
