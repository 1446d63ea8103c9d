"""A gateway process in front of a provider that misbehaves on the socket, judged by the ledger.

tests/api/test_upstream_faults.py proves what the provider client reports for each failure; this
proves what the gateway then does with the money, end to end: a call the provider may have read
keeps its whole hold (unknown, charged at expiry unless an operator corrects it), and only a
call that never left is released. The provider's socket is the witness of what it received.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Iterator

import openai
import pytest

from infra.processes import free_port
from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from tests.api.conftest import Client, account, client_for, gateway, header, ledger, sdk
from tests.support import write_prices

MODEL = "gw-transport"
MESSAGES = [{"role": "user", "content": "hello"}]
# The gateway gives up on a provider that does not answer this fast.
UPSTREAM_TIMEOUT_S = 3
# A prompt long enough that the provider can reset while the request body is still coming.
LONG_TEXT_CHARS = 2 * 1024 * 1024


class HostileProvider:
    """A loopback server that reads each request (all of it, or its head and `body_bytes` of its
    body) and then hangs up: with a FIN (`reset` False) or a TCP reset. It records how many bytes
    of each request's body it read, and each request's length."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.reset = False
        self.body_bytes: int | None = None
        self.received: list[tuple[int, int]] = []  # (body bytes read, Content-Length)
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> HostileProvider:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        # On Linux, close() does not wake a thread blocked in accept(): without the shutdown the
        # join waited out its whole timeout.
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(5)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with conn:
                self._read_and_hang_up(conn)

    def _read_and_hang_up(self, conn: socket.socket) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        wanted = length if self.body_bytes is None else min(length, self.body_bytes)
        while len(body) < wanted:
            chunk = conn.recv(min(65536, wanted - len(body)))
            if not chunk:
                break
            body += chunk
        self.received.append((min(len(body), wanted), length))
        if self.reset:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


@pytest.fixture(scope="module")
def prices_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_prices(tmp_path_factory, "transport", {"models": {
        MODEL: {"input_usd_per_mtok": "1.00", "output_usd_per_mtok": "4.00"}}})


@pytest.fixture(scope="module")
def provider() -> Iterator[HostileProvider]:
    with HostileProvider() as p:
        yield p


@pytest.fixture(scope="module")
def gw(redis_server: RedisServer, prices_file: str,
       provider: HostileProvider) -> Iterator[ServiceProcess]:
    with gateway(redis_server, prices_file, provider.url, UPSTREAM_TIMEOUT_S) as service:
        yield service


@pytest.fixture(scope="module")
def gw_nowhere(redis_server: RedisServer, prices_file: str) -> Iterator[ServiceProcess]:
    with gateway(redis_server, prices_file, f"http://127.0.0.1:{free_port()}/v1",
                 UPSTREAM_TIMEOUT_S) as service:
        yield service


@pytest.fixture(scope="module")
def admin(gw: ServiceProcess) -> Iterator[Client]:
    with client_for(gw) as c:
        yield c


def failed_call(service: ServiceProcess, key: str, text: str) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as failed:
        sdk(service, key, max_retries=2).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=100)
    return failed.value


@pytest.mark.parametrize(("reset", "body_bytes", "text"), [
    (False, None, "hello"),  # read the whole request, then a FIN
    (True, None, "hello"),  # read the whole request, then a reset
    (True, 4096, "x" * LONG_TEXT_CHARS),  # a reset while the body is still coming
], ids=["read-then-hang-up", "read-then-reset", "reset-mid-body"])
def test_a_provider_that_may_have_read_the_call_leaves_it_held(
    gw: ServiceProcess, admin: Client, provider: HostileProvider, reset: bool,
    body_bytes: int | None, text: str,
) -> None:
    provider.reset, provider.body_bytes = reset, body_bytes
    received_before = len(provider.received)
    tag, key = account(admin, 100_000_000)
    error = failed_call(gw, key, text)
    assert (error.status_code, error.code) == (504, "upstream_timeout")
    answer = error.response
    assert (answer.headers["x-ceiling-billing-outcome"], answer.headers["x-should-retry"]) == (
        "unknown", "false")
    held = header(answer, "x-ceiling-reserved-micros")
    assert held > 0
    assert header(answer, "x-ceiling-charged-micros") == held
    # The SDK did not retry a call whose outcome is unknown: the provider saw it once.
    (read_bytes, length), = provider.received[received_before:]
    if body_bytes is None:
        assert read_bytes == length
    else:
        assert read_bytes == body_bytes < length
    period = ledger(admin, tag)
    assert (period["committed_micros"], period["reserved_micros"]) == (0, held)


def test_a_provider_that_cannot_be_reached_releases_the_hold(
    gw_nowhere: ServiceProcess, admin: Client,
) -> None:
    tag, key = account(admin, 100_000_000)
    error = failed_call(gw_nowhere, key, "hello")
    assert (error.status_code, error.code) == (502, "upstream_unreachable")
    assert error.response.headers["x-ceiling-billing-outcome"] == "released"
    period = ledger(admin, tag)
    assert (period["committed_micros"], period["reserved_micros"]) == (0, 0)
