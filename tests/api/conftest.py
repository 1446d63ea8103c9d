"""Service instances as real processes over real HTTP, in front of real Redis servers.

Also what the gateway's end-to-end suites share (test_gateway.py, test_hostile.py,
test_messages.py, test_hostile_messages.py): a fault proxy in front of the stub provider, gateway
instances, and helpers that make accounts, call through the `openai` and `anthropic` SDKs and
read what a call was held and charged.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest

from infra.processes import free_port, tls_context
from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from infra.stub_provider import StubProvider

ADMIN_TOKEN = "admin-secret-for-tests"
# A call is settled (or its stream relayed) within this long; the tests poll no longer.
SETTLE_WAIT_S_MAX = 10.0


class Client(httpx.Client):
    """An HTTP client for one instance, with helpers for the admin routes."""

    def admin(self, method: str, path: str, **kwargs: object) -> httpx.Response:
        return self.request(method, path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                            **kwargs)  # type: ignore[arg-type]

    def budget(self, budget_id: str, ceiling_micros: int, period: str = "total",
               allowance_micros: int = 0) -> None:
        r = self.admin("PUT", f"/v1/admin/budgets/{budget_id}", json={
            "limits": [{"period": period, "ceiling_micros": ceiling_micros}],
            "outage_allowance_micros": allowance_micros})
        assert r.status_code == 200, r.text

    def key(self, budget_id: str, run_ceiling_micros: int | None = None,
            roles: tuple[str, ...] = ("gateway",)) -> dict[str, str]:
        """A new API key's Authorization header; its roles as given (the service's default:
        gateway only)."""
        r = self.admin("POST", "/v1/admin/keys", json={
            "budget_id": budget_id, "run_ceiling_micros": run_ceiling_micros,
            "roles": list(roles)})
        assert r.status_code == 201, r.text
        assert r.json()["roles"] == sorted(roles)
        return {"Authorization": f"Bearer {r.json()['api_key']}"}

    def sidecar_key(self, budget_id: str, run_ceiling_micros: int | None = None
                    ) -> dict[str, str]:
        """A key for the reserve / settle / release routes: the sidecar role only."""
        return self.key(budget_id, run_ceiling_micros, ("sidecar",))


def client_for(service: ServiceProcess) -> Client:
    return Client(base_url=service.url, timeout=10.0, verify=tls_context())


@pytest.fixture(scope="session")
def service(redis_server: RedisServer) -> Iterator[ServiceProcess]:
    with ServiceProcess({"REDIS_URL": redis_server.url, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN}) as s:
        yield s


@pytest.fixture
def http(service: ServiceProcess) -> Iterator[Client]:
    with client_for(service) as c:
        yield c


# -- the gateway's end-to-end suites ------------------------------------------------------------


class FaultProxy:
    """A loopback TCP proxy in front of the stub, for faults the stub does not make itself.

    It keeps the last request the gateway sent (to read what was forwarded) and, when armed:
    delays requests (a slow provider), adds an X-Stub-Output-Tokens header (an answer of a
    known length), slows answers down (a provider that generates as it streams), or cuts the
    next answer after a number of bytes or just before some bytes (a provider that drops a
    stream, after its usage and before its end).
    """

    THROTTLE_BYTES = 128
    THROTTLE_PAUSE_S = 0.05

    def __init__(self, target_port: int) -> None:
        self.port = free_port()
        self.target_port = target_port
        self.last_request = b""
        self.delay_s = 0.0
        self.output_tokens: int | None = None
        self.throttle = False
        self.cut_after_bytes: int | None = None
        self.cut_before: bytes | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def disarm(self) -> None:
        self.delay_s, self.output_tokens = 0.0, None
        self.throttle, self.cut_after_bytes, self.cut_before = False, None, None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def forwarded(self) -> dict[str, Any]:
        """The JSON body of the last request the gateway sent."""
        doc = json.loads(self.last_request.split(b"\r\n\r\n", 1)[1])
        assert isinstance(doc, dict)
        return doc

    def forwarded_path(self) -> str:
        return self.last_request.split(b" ", 2)[1].decode()

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        started = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", self.port), self._loop)
        self._server = started.result(timeout=10)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        pipes = [asyncio.ensure_future(self._up(client_r, server_w)),
                 asyncio.ensure_future(self._down(server_r, client_w))]
        await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        for pipe in pipes:
            pipe.cancel()
        for writer in (client_w, server_w):
            writer.close()

    async def _up(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            if data.startswith(b"POST "):
                self.last_request = b""
                if self.output_tokens is not None:
                    line, rest = data.split(b"\r\n", 1)
                    forced = f"X-Stub-Output-Tokens: {self.output_tokens}"
                    data = line + b"\r\n" + forced.encode() + b"\r\n" + rest
                await asyncio.sleep(self.delay_s)
            self.last_request += data
            writer.write(data)
            await writer.drain()

    async def _down(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held = b""  # with cut_before: bytes kept back until it is known they come before it
        while data := await reader.read(self.THROTTLE_BYTES if self.throttle else 65536):
            if self.cut_before is not None:
                held += data
                if (at := held.find(self.cut_before)) >= 0:
                    writer.write(held[:at])
                    await writer.drain()
                    self.cut_before = None
                    return
                keep = len(self.cut_before) - 1
                data, held = held[: len(held) - keep], held[len(held) - keep:]
            if self.cut_after_bytes is not None:
                if len(data) >= self.cut_after_bytes:
                    writer.write(data[: self.cut_after_bytes])
                    await writer.drain()
                    self.cut_after_bytes = None
                    return
                self.cut_after_bytes -= len(data)
            writer.write(data)
            await writer.drain()
            if self.throttle:
                await asyncio.sleep(self.THROTTLE_PAUSE_S)


@pytest.fixture(scope="module")
def proxy(stub: StubProvider) -> Iterator[FaultProxy]:
    """A fault proxy in front of the module's stub provider (its `stub` fixture); it changes
    nothing until a test arms it."""
    with FaultProxy(stub.port) as p:
        yield p


@pytest.fixture(scope="module")
def admin(gw: ServiceProcess) -> Iterator[Client]:
    """An admin client of the module's gateway (its `gw` fixture)."""
    with client_for(gw) as c:
        yield c


def gateway(redis_server: RedisServer, prices_file: str, upstream_url: str,
            timeout_s: float, env: dict[str, str] | None = None) -> ServiceProcess:
    """A gateway instance (not started) in front of `upstream_url`, with `env` added."""
    return ServiceProcess({
        "REDIS_URL": redis_server.url, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN,
        "CEILING_PRICES_FILE": prices_file, "CEILING_UPSTREAM_URL": upstream_url,
        "CEILING_UPSTREAM_TIMEOUT_S": str(timeout_s), **(env or {}),
    })


def gateway_to_stub(redis_server: RedisServer, prices_file: str, stub: StubProvider,
                    timeout_s: float) -> ServiceProcess:
    """A gateway instance (not started) whose OpenAI and Anthropic upstreams are both `stub`."""
    return gateway(redis_server, prices_file, f"{stub.url}/v1", timeout_s,
                   {"CEILING_ANTHROPIC_URL": stub.url})


def account(admin: Client, ceiling_micros: int, run_ceiling_micros: int | None = None,
            roles: tuple[str, ...] = ("gateway",)) -> tuple[str, str]:
    """A budget of its own and an API key for it (a gateway key unless told otherwise)."""
    tag = f"org:g{uuid.uuid4().hex[:10]}"
    admin.budget(tag, ceiling_micros)
    return tag, admin.key(tag, run_ceiling_micros, roles)["Authorization"].removeprefix(
        "Bearer ")


# A key holder who also has the sidecar role: the most a key can be given.
BOTH_ROLES = ("gateway", "sidecar")


def as_key(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def correct(admin: Client, reservation_id: str, actual_micros: int) -> dict[str, Any]:
    """An operator's correction of a gateway reservation, from the provider's bill."""
    r = admin.admin("POST", f"/v1/admin/reservations/{reservation_id}/settle",
                    json={"actual_micros": actual_micros, "reason": "the provider's bill"})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert isinstance(answer, dict)
    return answer


def reservation(admin: Client, reservation_id: str) -> dict[str, Any]:
    r = admin.admin("GET", f"/v1/admin/reservations/{reservation_id}")
    assert r.status_code == 200, r.text
    found = r.json()
    assert isinstance(found, dict)
    return found


def refused_to_key(admin: Client, key: str, reservation_id: str) -> None:
    """Neither settle nor release of a gateway reservation works for a key: as a stranger's id."""
    for action, body in (("release", None), ("settle", {"actual_micros": 0}),
                         ("settle", {"input_tokens": 0, "output_tokens": 0})):
        r = admin.post(f"/v1/reservations/{reservation_id}/{action}", headers=as_key(key),
                       json=body)
        assert (r.status_code, r.json()["error"]["code"]) == (404, "reservation_not_found"), (
            action, r.text)


def ledger(admin: Client, tag: str) -> dict[str, Any]:
    period = admin.admin("GET", f"/v1/admin/budgets/{tag}").json()["periods"][0]
    assert isinstance(period, dict)
    return period


def settled(admin: Client, tag: str) -> dict[str, Any]:
    """The budget once no reservation is held: streams settle after their client has gone."""
    deadline = time.monotonic() + SETTLE_WAIT_S_MAX
    while (period := ledger(admin, tag))["reserved_micros"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return period


def sdk(service: ServiceProcess, key: str, *, max_retries: int = 0,
        http_client: httpx2.Client | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{service.url}/v1", api_key=key, max_retries=max_retries,
                         http_client=http_client, timeout=30)


def async_sdk(service: ServiceProcess, key: str, *, max_retries: int = 0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{service.url}/v1", api_key=key,
                              max_retries=max_retries, timeout=30)


def anthropic_sdk(service: ServiceProcess, key: str, *, max_retries: int = 0,
                  http_client: httpx2.Client | None = None) -> anthropic.Anthropic:
    """The anthropic SDK pointed at a gateway, as its users point it: the base URL without /v1,
    the spend-ceiling key as its API key (sent as x-api-key)."""
    return anthropic.Anthropic(base_url=service.url, api_key=key, max_retries=max_retries,
                               http_client=http_client, timeout=30)


def async_anthropic_sdk(service: ServiceProcess, key: str, *,
                        max_retries: int = 0) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=service.url, api_key=key, max_retries=max_retries,
                                    timeout=30)


def counting_client() -> tuple[httpx2.Client, list[str]]:
    """An SDK transport (either SDK's) that counts the HTTP requests it sends, retries
    included."""
    sent: list[str] = []
    client = httpx2.Client(event_hooks={"request": [lambda r: sent.append(str(r.url))]})
    return client, sent


def header(raw: Any, name: str) -> int:
    return int(raw.headers[name])


def trailer(text: str) -> dict[str, str]:
    """The figures a stream ends with, from its `: x-ceiling-...: value` comment lines."""
    lines = [line[2:].split(": ", 1) for line in text.split("\n") if line.startswith(": x-")]
    return {name: value for name, value in lines}


def per_user_budget(ceiling_micros: int, user_ceiling_micros: int, users_max: int,
                    required: bool = False, rate: dict[str, int] | None = None,
                    user_rate: dict[str, int] | None = None) -> dict[str, Any]:
    """A PUT /v1/admin/budgets body: a total ceiling, each end user's own total, and the rates
    given (None: none)."""
    per_user: dict[str, Any] = {
        "limits": [{"period": "total", "ceiling_micros": user_ceiling_micros}],
        "users_max": users_max, "required": required}
    if user_rate is not None:
        per_user["rate"] = user_rate
    body: dict[str, Any] = {"limits": [{"period": "total", "ceiling_micros": ceiling_micros}],
                            "per_user": per_user}
    if rate is not None:
        body["rate"] = rate
    return body
