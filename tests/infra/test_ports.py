"""A harness server whose free port was taken before it bound it (a parallel test worker) moves to
another port, and is never mistaken for the server that took it."""

from __future__ import annotations

import socket

import httpx
import pytest

from infra.processes import listening
from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from infra.upstash_bridge import UpstashBridge

# Servers and service instances started only to test the harness's port handling: outside the
# dev loop (`-m "not slow"`), run in CI and when infra/processes.py changes.
pytestmark = pytest.mark.slow


def test_a_redis_server_whose_port_is_taken_starts_on_another() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with RedisServer(port=port) as server:
            assert server.port != port
            assert server.process is not None
            assert listening(server.process.pid, server.port)


def test_an_upstash_bridge_whose_port_is_taken_starts_on_another() -> None:
    with socket.socket() as taken, RedisServer() as redis_server:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with UpstashBridge(redis_server.url, port=port) as bridge:
            assert bridge.port != port
            assert bridge.ping()


def test_a_service_never_takes_another_service_on_its_port_for_itself() -> None:
    env = {"CEILING_SINGLE_REPLICA": "1"}
    with ServiceProcess(env) as first, ServiceProcess(env, port=first.port) as second:
        assert second.port != first.port
        ids = {httpx.get(f"{s.url}/health/live").json()["instance_id"] for s in (first, second)}
        assert len(ids) == 2


def test_an_upstash_bridge_starts_with_a_token_that_begins_with_a_dash() -> None:
    # secrets.token_urlsafe() begins with '-' one time in 64: given as a separate argument,
    # argparse took it for an option and every Upstash test of that run failed at set-up.
    with RedisServer() as redis_server, UpstashBridge(redis_server.url, token="-dash") as bridge:
        assert bridge.ping()
