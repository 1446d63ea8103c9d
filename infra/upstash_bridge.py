"""A local server that speaks Upstash's REST protocol in front of a real redis-server.

UpstashStore is tested and benchmarked through it, so that the upstash-redis SDK, its HTTP
client and its reply decoding all run for real while the ledger itself is a real Redis: every
command is forwarded to Redis, none is simulated. What it speaks, as Upstash does:

- `POST /` with a JSON command array `["SET", "k", "v"]` -> `{"result": ...}` or `{"error": ...}`
  (400); `POST /pipeline` and `POST /multi-exec` with an array of commands -> an array of those.
- `Authorization: Bearer <token>`; a wrong or missing token is 401 `{"error": "Unauthorized"}`.
- `Upstash-Encoding: base64` (the SDK's default): every bulk string is base64, except the
  status reply `OK`, which Upstash sends as is and the SDK passes through undecoded.

Test faults, only with `--test-faults`: `POST /_bridge/fault` with `{"mode": "hang" | "drop_reply"
| "none", "requests": N}` arms the next N command requests (the same bearer token applies), and
`GET /_bridge/fault` reads back what is still armed. `hang` holds a request without forwarding
it, until the client gives up; `drop_reply` forwards it to Redis, then closes the connection
before the reply is complete: the lost reply after which the SDK replays a request.

Run: `python -m infra.upstash_bridge --port P --redis-url redis://127.0.0.1:6379/0 --token T`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import secrets
import shutil
import subprocess
import sys
import tempfile
from base64 import b64encode
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import redis.asyncio as aioredis
import uvicorn
from redis import exceptions as rex
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from infra.processes import OnAFreePort, free_port, stop, tls_context, wait_ready

HOST = "127.0.0.1"
# Connections the bridge holds to Redis. Under a burst the bridge is CPU-bound, not Redis: a
# small pool makes requests queue for a connection in order, where a large one sets off a storm
# of new connections (each a connect and a handshake) on an event loop that is already behind.
REDIS_CONNECTIONS_MAX = 64
# How long a request may queue for one of them: the bridge's backlog when several test processes
# burst at once on a shared machine. Its clients bound their own wait; this only bounds the
# bridge's, so a request is not held forever.
REDIS_POOL_WAIT_S = 60.0
# Connecting to Redis and its reply: every ledger script runs in well under a millisecond, but
# the reply is read by an event loop that may be seconds behind under a burst.
REDIS_SOCKET_TIMEOUT_S = 10.0
# A hung request is held until its client disconnects, and at most this long, so a test that
# never disconnects cannot keep the bridge from shutting down.
HANG_MAX_S = 60.0
# The bridge imports Starlette, uvicorn and redis-py and then answers within a second or two;
# twenty seconds on a loaded machine means it is not coming up.
START_TIMEOUT_S = 20.0
# Let a request that is mid-flight at shutdown finish, but not a hung one.
GRACEFUL_SHUTDOWN_S = 1

UNAUTHORIZED = {"error": "Unauthorized"}
FAULT_MODES = ("none", "hang", "drop_reply")

Json = Any


class CommandRefused(Exception):
    """A request body that is not a command Upstash would accept; the reply is a 400."""


def command_of(raw: Json) -> list[str | int | float]:
    if (
        not isinstance(raw, list)
        or not raw
        or not all(isinstance(a, str | int | float) and not isinstance(a, bool) for a in raw)
    ):
        raise CommandRefused("ERR a command is a non-empty JSON array of strings and numbers")
    return raw


def encode(reply: Any, base64: bool) -> Json:
    """A RESP2 reply as Upstash puts it in JSON: bulk strings base64'd when the client asks."""
    if isinstance(reply, bytes):
        if not base64:
            return reply.decode("utf-8", errors="replace")
        # redis-py hands over a status reply and a bulk string alike, so a bulk "OK" goes out
        # as is too; the SDK reads both as "OK", and base64 is never two characters long.
        return "OK" if reply == b"OK" else b64encode(reply).decode("ascii")
    if isinstance(reply, list):
        return [encode(item, base64) for item in reply]
    if isinstance(reply, rex.ResponseError):
        # An error nested in a script's reply table: nothing the ledger's scripts return, so it
        # fails the whole command rather than passing as a string.
        raise reply
    return reply


def error_text(exc: rex.RedisError) -> str:
    """Redis' error reply as Redis sent it: redis-py moves a known code such as NOSCRIPT or ERR
    out of the message into `status_code`, and Upstash clients look for the code."""
    return f"{exc.status_code} {exc}" if exc.status_code else str(exc)


@dataclass
class Fault:
    mode: str = "none"
    requests: int = 0

    def take(self) -> str:
        """The fault this request suffers, consuming one armed request."""
        if self.requests <= 0:
            return "none"
        self.requests -= 1
        return self.mode


class DroppedReply(Response):
    """Starts a reply and stops, so uvicorn closes the connection: the client sees a lost reply
    after the command ran."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"64")],
            }
        )


class Bridge:
    def __init__(self, redis_url: str, token: str, *, test_faults: bool) -> None:
        self._redis_url = redis_url
        self._authorization = f"Bearer {token}".encode()
        self._test_faults = test_faults
        self._fault = Fault()
        self._redis: aioredis.Redis | None = None

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        pool = aioredis.BlockingConnectionPool.from_url(
            self._redis_url,
            # RESP2 is what Upstash's JSON replies mirror: arrays, integers, strings and null.
            protocol=2,
            decode_responses=False,
            max_connections=REDIS_CONNECTIONS_MAX,
            timeout=REDIS_POOL_WAIT_S,
            socket_timeout=REDIS_SOCKET_TIMEOUT_S,
            socket_connect_timeout=REDIS_SOCKET_TIMEOUT_S,
        )
        client = aioredis.Redis(connection_pool=pool)
        # redis-py reshapes some replies (SET -> bool, TIME -> tuple); the bridge must pass on
        # what Redis said, as Upstash does.
        client.response_callbacks.clear()
        self._redis = client
        try:
            yield
        finally:
            await client.aclose()
            await pool.aclose()

    def app(self) -> Starlette:
        routes = [
            Route("/", self.single, methods=["POST"]),
            Route("/pipeline", self.pipeline, methods=["POST"]),
            Route("/multi-exec", self.multi_exec, methods=["POST"]),
        ]
        if self._test_faults:
            routes.append(Route("/_bridge/fault", self.fault, methods=["GET", "POST"]))
        return Starlette(routes=routes, lifespan=self.lifespan)

    @property
    def redis(self) -> aioredis.Redis:
        if self._redis is None:
            raise RuntimeError("the bridge's Redis client exists only while the app runs")
        return self._redis

    def _authorized(self, request: Request) -> bool:
        given = request.headers.get("authorization", "").encode()
        return hmac.compare_digest(given, self._authorization)

    async def _body(self, request: Request) -> Json:
        try:
            return json.loads(await request.body())
        except ValueError as exc:
            raise CommandRefused("ERR the request body is not JSON") from exc

    async def _serve(self, request: Request, transaction: bool | None) -> Response:
        """One command (transaction None), a pipeline, or a MULTI/EXEC transaction."""
        if not self._authorized(request):
            return JSONResponse(UNAUTHORIZED, status_code=401)
        base64 = request.headers.get("upstash-encoding", "").lower() == "base64"
        try:
            body = await self._body(request)
            if transaction is None:
                commands = [command_of(body)]
            elif isinstance(body, list) and body:
                commands = [command_of(c) for c in body]
            else:
                raise CommandRefused("ERR a pipeline is a non-empty JSON array of commands")
        except CommandRefused as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        fault = self._fault.take()
        if fault == "hang":
            return await self._hang(request)
        if transaction is None:
            reply, status = await self._one(commands[0], base64)
        else:
            reply, status = await self._many(commands, transaction, base64), 200
        return DroppedReply() if fault == "drop_reply" else JSONResponse(reply, status)

    async def _one(self, command: Sequence[str | int | float], base64: bool) -> tuple[Json, int]:
        try:
            reply = await self.redis.execute_command(*command)  # type: ignore[no-untyped-call]
            return {"result": encode(reply, base64)}, 200
        except rex.ResponseError as exc:
            return {"error": error_text(exc)}, 400
        except (rex.RedisError, OSError) as exc:
            return {"error": f"ERR the bridge could not reach Redis: {exc}"}, 503

    async def _many(
        self, commands: Sequence[Sequence[str | int | float]], transaction: bool, base64: bool
    ) -> Json:
        try:
            async with self.redis.pipeline(transaction=transaction) as pipe:
                for command in commands:
                    pipe.execute_command(*command)
                replies = await pipe.execute(raise_on_error=False)
        except rex.ResponseError as exc:  # EXECABORT: a transaction Redis refused as a whole
            return [{"error": error_text(exc)} for _ in commands]
        except (rex.RedisError, OSError) as exc:
            return [{"error": f"ERR the bridge could not reach Redis: {exc}"} for _ in commands]
        out = []
        for reply in replies:
            try:
                out.append({"result": encode(reply, base64)})
            except rex.ResponseError as exc:
                out.append({"error": error_text(exc)})
        return out

    async def _hang(self, request: Request) -> Response:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(HANG_MAX_S):
                # The body is read, so the next message uvicorn has for us is the disconnect.
                while (await request.receive())["type"] != "http.disconnect":
                    pass
        return JSONResponse({"error": "ERR the bridge held this request (test fault)"}, 504)

    async def single(self, request: Request) -> Response:
        return await self._serve(request, None)

    async def pipeline(self, request: Request) -> Response:
        return await self._serve(request, False)

    async def multi_exec(self, request: Request) -> Response:
        return await self._serve(request, True)

    async def fault(self, request: Request) -> Response:
        if not self._authorized(request):
            return JSONResponse(UNAUTHORIZED, status_code=401)
        if request.method == "POST":
            try:
                body = await self._body(request)
                mode, count = body["mode"], body["requests"]
            except (CommandRefused, KeyError, TypeError):
                mode, count = None, None
            if mode not in FAULT_MODES or type(count) is not int or count < 0:
                return JSONResponse(
                    {"error": f"the body is {{'mode': one of {FAULT_MODES}, 'requests': N}}"},
                    status_code=400,
                )
            self._fault = Fault(mode, count)
        return JSONResponse({"result": {"mode": self._fault.mode,
                                        "requests": self._fault.requests}})


@dataclass
class UpstashBridge(OnAFreePort):
    """The bridge as a subprocess on a free loopback port, started and stopped by pid."""

    redis_url: str
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    test_faults: bool = False
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="sc-bridge-")))

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def args(self) -> list[str]:
        # --token=VALUE: a random token starts with '-' one time in 64, which argparse would
        # read as an option of its own.
        args = [sys.executable, "-m", "infra.upstash_bridge", "--port", str(self.port),
                "--redis-url", self.redis_url, f"--token={self.token}"]
        return [*args, "--test-faults"] if self.test_faults else args

    @property
    def log_path(self) -> Path:
        return self.workdir / "bridge.log"

    # Its PING carries its own token: a bridge that answers it is this one.
    def _start_once(self) -> None:
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.args(), stdout=log, stderr=subprocess.STDOUT,
                cwd=Path(__file__).resolve().parents[1],
            )
        try:
            wait_ready(self.process, self.ping, timeout_s=START_TIMEOUT_S,
                       what=f"the Upstash bridge on {self.url}")
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}: {self.log_tail()}") from exc

    def ping(self) -> bool:
        """True once the bridge answers a command, which proves Redis behind it answers too."""
        try:
            reply = httpx.post(
                self.url, json=["PING"], headers={"Authorization": f"Bearer {self.token}"},
                timeout=0.5, verify=tls_context(),
            )
        except httpx.HTTPError:
            return False
        return reply.status_code == 200 and reply.json() == {"result": "PONG"}

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        stop(self.process)
        self.process = None

    def __enter__(self) -> UpstashBridge:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--test-faults", action="store_true",
                        help="enable /_bridge/fault, which tests use to hang or drop replies")
    opts = parser.parse_args(argv)
    bridge = Bridge(opts.redis_url, opts.token, test_faults=opts.test_faults)
    uvicorn.run(
        bridge.app(), host=HOST, port=opts.port, log_level="warning", access_log=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )


if __name__ == "__main__":
    main()
