"""The platform's side of an invocation, run inside a built artifact.

tests/deploy/test_built_artifacts.py runs this file's text as `python3.12 -S -c ... MODE ...` with
the artifact's root as the working directory and PYTHONPATH as the platform sets it: only the
standard library and what the artifact carries can be imported. It plays one warm instance: it
loads the handler named by the artifact's own configuration and sends it the same scenario, one
invocation after another, in one process; then prints one JSON line with the answers.

MODE:
- `lambda HANDLER`: API Gateway HTTP API (payload 2.0) events and a context object, the handler
  loaded as AWS's Python runtime loads `module/path.attr`.
- `vercel-event HANDLER`: the events of Vercel's Python launcher (vc__handler__python): the
  request as JSON in the event's body, the body itself base64.
- `vercel-ipc MODULE`: Vercel's current protocol. The function is imported in a child process with
  VERCEL_IPC_PATH set; it serves HTTP on a loopback port that it announces over that Unix socket
  ("server-started"), and reports each request's start and end there.

Standard library only: nothing may be imported from outside the artifact.
"""

from __future__ import annotations

import base64
import importlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

# (method, path, JSON body or None, bearer token or None) -> (status, JSON body or None)
Call = Callable[[str, str, Any, Any], tuple[int, Any]]
HOST = "spend-ceiling.example.test"
IPC_START_TIMEOUT_S = 60.0
# After the scenario, more health checks: a warm instance reuses its Redis connections.
HEALTH_REPEATS = 4


def scenario(call: Call, tag: str, admin_token: str) -> list[list[Any]]:
    """Health, a budget of 100 micros and a key, the whole ceiling reserved and settled, then 1."""
    answers: list[list[Any]] = []

    def step(method: str, path: str, body: dict[str, Any] | None = None,
             token: str | None = None) -> Any:
        status, payload = call(method, path, body, token)
        answers.append([status, payload])
        return payload

    step("GET", "/health", token=admin_token)  # the version is the operator's to read
    step("PUT", f"/v1/admin/budgets/{tag}",
         {"limits": [{"period": "total", "ceiling_micros": 100}]}, admin_token)
    key = step("POST", "/v1/admin/keys", {"budget_id": tag, "roles": ["sidecar"]},
               admin_token)["api_key"]
    rid = step("POST", "/v1/reservations", {"amount_micros": 100}, key)["reservation_id"]
    step("POST", f"/v1/reservations/{rid}/settle", {"actual_micros": 100}, key)
    step("POST", "/v1/reservations", {"amount_micros": 1}, key)
    for _ in range(HEALTH_REPEATS):
        step("GET", "/health")
    return answers


def request_headers(body: bytes | None, token: str | None) -> dict[str, str]:
    headers = {"host": HOST, "user-agent": "spend-ceiling-deploy-test", "accept": "*/*",
               "x-forwarded-proto": "https", "x-forwarded-for": "203.0.113.7"}
    if body is not None:
        headers["content-type"] = "application/json"
        headers["content-length"] = str(len(body))
    if token:
        headers["authorization"] = f"Bearer {token}"
    return headers


def decoded(body: str | None, base64_encoded: bool) -> Any:
    """A JSON body as data; anything else (a bare 500's text) as text."""
    if not body:
        return None
    raw = base64.b64decode(body) if base64_encoded else body.encode()
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def load_handler(spec: str) -> Callable[[dict[str, Any], Any], dict[str, Any]]:
    """`api/lambda_handler.handler` or `vc__handler__python.vc_handler`, as the runtimes load it."""
    module, _, attr = spec.rpartition(".")
    handler: Callable[[dict[str, Any], Any], dict[str, Any]]
    handler = getattr(importlib.import_module(module.replace("/", ".")), attr)
    return handler


class LambdaContext:
    function_name = "spend-ceiling-dev-api"
    function_version = "$LATEST"
    invoked_function_arn = "arn:aws:lambda:us-east-1:123456789012:function:spend-ceiling-dev-api"
    memory_limit_in_mb = "512"
    log_group_name = "/aws/lambda/spend-ceiling-dev-api"
    log_stream_name = "2026/11/30/[$LATEST]00000000000000000000000000000000"

    def __init__(self, request_id: str) -> None:
        self.aws_request_id = request_id

    def get_remaining_time_in_millis(self) -> int:
        return 300_000


def lambda_calls(handler_spec: str) -> Call:
    handler = load_handler(handler_spec)
    count = 0

    def call(method: str, path: str, body: dict[str, Any] | None,
             token: str | None) -> tuple[int, Any]:
        nonlocal count
        count += 1
        raw = json.dumps(body).encode() if body is not None else None
        now_ms = int(time.time() * 1000)
        event = {
            "version": "2.0", "routeKey": "$default", "rawPath": path, "rawQueryString": "",
            "headers": request_headers(raw, token),
            "requestContext": {
                "accountId": "123456789012", "apiId": "abc123", "domainName": HOST,
                "domainPrefix": "abc123", "requestId": f"req-{count}", "routeKey": "$default",
                "stage": "$default", "time": time.strftime("%d/%b/%Y:%H:%M:%S +0000"),
                "timeEpoch": now_ms,
                "http": {"method": method, "path": path, "protocol": "HTTP/1.1",
                         "sourceIp": "203.0.113.7", "userAgent": "spend-ceiling-deploy-test"},
            },
            "isBase64Encoded": raw is not None,
        }
        if raw is not None:
            event["body"] = base64.b64encode(raw).decode()
        response = handler(event, LambdaContext(f"req-{count}"))
        return response["statusCode"], decoded(response.get("body"),
                                               bool(response.get("isBase64Encoded")))

    return call


def vercel_event_calls(handler_spec: str) -> Call:
    handler = load_handler(handler_spec)

    def call(method: str, path: str, body: dict[str, Any] | None,
             token: str | None) -> tuple[int, Any]:
        raw = json.dumps(body).encode() if body is not None else None
        request: dict[str, Any] = {"method": method, "path": path,
                                   "headers": request_headers(raw, token)}
        if raw is not None:
            request["body"] = base64.b64encode(raw).decode()
            request["encoding"] = "base64"
        response = handler({"Action": "Invoke", "body": json.dumps(request)},
                           LambdaContext("vercel"))
        return response["statusCode"], decoded(response.get("body"),
                                               response.get("encoding") == "base64")

    return call


class IpcPeer:
    """Vercel's end of the function's IPC socket: NUL-separated JSON messages."""

    def __init__(self, path: str) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(1)
        self.listener.settimeout(IPC_START_TIMEOUT_S)
        self.messages: list[dict[str, Any]] = []
        self.started = threading.Event()
        self.port = 0

    def serve(self) -> None:
        connection, _ = self.listener.accept()
        buffer = b""
        with connection:
            while chunk := connection.recv(65536):
                buffer += chunk
                *complete, buffer = buffer.split(b"\0")
                for raw in complete:
                    message = json.loads(raw)
                    self.messages.append(message)
                    if message.get("type") == "server-started":
                        self.port = int(message["payload"]["httpPort"])
                        self.started.set()
                    if message.get("type") == "unrecoverable-error":
                        self.started.set()


def vercel_ipc_run(module: str, tag: str, admin_token: str) -> dict[str, Any]:
    ipc_path = os.path.join(tempfile.mkdtemp(prefix="vc-ipc-"), "ipc.sock")
    peer = IpcPeer(ipc_path)
    reader = threading.Thread(target=peer.serve, daemon=True)
    reader.start()
    child = subprocess.Popen([sys.executable, "-S", "-c", f"import {module}"],
                             env={**os.environ, "VERCEL_IPC_PATH": ipc_path})
    try:
        if not peer.started.wait(IPC_START_TIMEOUT_S) or not peer.port:
            raise RuntimeError(f"the function did not start: {peer.messages}")
        count = 0

        def call(method: str, path: str, body: dict[str, Any] | None,
                 token: str | None) -> tuple[int, Any]:
            nonlocal count
            count += 1
            raw = json.dumps(body).encode() if body is not None else None
            headers = {**request_headers(raw, token), "x-vercel-internal-invocation-id": "inv-1",
                       "x-vercel-internal-request-id": str(count)}
            request = urllib.request.Request(
                f"http://127.0.0.1:{peer.port}{path}", data=raw, headers=headers, method=method)
            try:
                # S310: a loopback port the function announced, not a user-given URL.
                with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310
                    return response.status, decoded(response.read().decode(), False)
            except urllib.error.HTTPError as exc:
                return exc.code, decoded(exc.read().decode(), False)

        answers = scenario(call, tag, admin_token)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and sum(
            m.get("type") == "end" for m in peer.messages
        ) < count:
            time.sleep(0.05)
        kinds = [m.get("type") for m in peer.messages]
        return {"answers": answers, "requests": count,
                "ipc_started": kinds.count("handler-started"), "ipc_ended": kinds.count("end"),
                "ipc_errors": kinds.count("unrecoverable-error")}
    finally:
        child.terminate()  # by pid: the process this driver started
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        os.unlink(ipc_path)
        os.rmdir(os.path.dirname(ipc_path))


def main(argv: list[str]) -> None:
    mode, spec, tag, admin_token = argv
    if mode == "vercel-ipc":
        result = vercel_ipc_run(spec, tag, admin_token)
    else:
        call = lambda_calls(spec) if mode == "lambda" else vercel_event_calls(spec)
        result = {"answers": scenario(call, tag, admin_token)}
        import core
        import core.stores.scripts as scripts

        result["core"] = core.__file__
        result["lua_dir"] = str(scripts.lua_dir())
    result["python"] = list(sys.version_info[:2])
    result["modules_outside"] = sorted(
        name for name, m in sys.modules.items()
        if getattr(m, "__file__", None) and not os.path.realpath(m.__file__ or "").startswith(
            (os.getcwd(), os.path.realpath(sys.base_prefix)))
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
