"""A forked instance is `ceiling serve` configured by the environment it was given alone, reports
how it ended, and does not outlive the fork server's client."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from infra.fleet import LEDGER_ENV
from infra.forkserver import ForkServer
from infra.processes import alive, free_port, wait_ready

START_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    # The server's own environment names a ledger; no instance is given it.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
        s = ForkServer()
    yield s
    s.stop()


def serve_argv(port: int) -> list[str]:
    return ["serve", "--host", "127.0.0.1", "--port", str(port)]


def test_an_instance_is_configured_by_its_environment_alone(
    server: ForkServer, tmp_path: Path
) -> None:
    port = free_port()
    env = {"PATH": os.environ["PATH"], "CEILING_SINGLE_REPLICA": "1",
           "CEILING_ADMIN_TOKEN": "t" * 32}
    child = server.spawn(serve_argv(port), env, str(tmp_path / "log"))
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:

        def live() -> bool:
            try:
                return http.get("/health/live").status_code == 200
            except httpx.HTTPError:
                return False

        wait_ready(child, live, timeout_s=START_TIMEOUT_S, what="forked instance")
        health = http.get("/health").json()
    assert health["status"] == "degraded"  # the memory ledger: the server's REDIS_URL unseen
    assert "ledger_not_shared" in health["reasons"]
    child.kill()
    assert child.wait(timeout=10) == -9
    assert not alive(child.pid)


def test_an_instance_that_refuses_to_start_says_why_and_exits_with_its_code(
    server: ForkServer, tmp_path: Path
) -> None:
    env = {**os.environ, **dict.fromkeys(LEDGER_ENV, "")}
    env.pop("REDIS_URL")
    log = tmp_path / "log"
    child = server.spawn(serve_argv(free_port()), env, str(log))
    assert child.wait(timeout=START_TIMEOUT_S) == 2  # `ceiling serve` refusing to start
    assert "refusing to start" in log.read_text()


def test_the_instances_stop_when_the_client_goes(tmp_path: Path) -> None:
    server = ForkServer()
    env = {**os.environ, "REDIS_URL": "", "CEILING_SINGLE_REPLICA": "1"}
    child = server.spawn(serve_argv(free_port()), env, str(tmp_path / "log"))
    assert child.poll() is None
    server.stop()
    assert not alive(child.pid)
