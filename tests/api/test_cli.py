"""The `ceiling` command talks to the same core as the API."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
import uuid

import httpx

import api.runtime
from api import cli
from core.service import KEY_TRUST_MS, operator_fingerprint
from infra.redis_server import RedisServer
from infra.service import ServiceProcess


def ceiling_process(redis_server: RedisServer, *args: str,
                    env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`ceiling ARGS` as its own process, as an operator's shell runs it: its exit code is the
    process's."""
    env = {**os.environ, "REDIS_URL": redis_server.url, **(env or {})}
    return subprocess.run([sys.executable, "-m", "api.cli", *args], env=env,
                          capture_output=True, text=True, timeout=60, check=False)


def ceiling(redis_server: RedisServer, *args: str,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`ceiling ARGS` run by its main() in this process, with the environment it would be
    given: the same parser, runtime and output as the command, without a Python start-up each
    time. main()'s return (or argparse's exit) is the exit code. test_bad_input_... runs the
    real process."""
    changed = {"REDIS_URL": redis_server.url, **(env or {})}
    saved = {name: os.environ.get(name) for name in changed}
    out, err = io.StringIO(), io.StringIO()
    os.environ.update(changed)
    api.runtime._runtime = None  # made from the environment above, as a new process would
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(list(args))
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        api.runtime._runtime = None
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return subprocess.CompletedProcess(["ceiling", *args], code, out.getvalue(), err.getvalue())


def test_budgets_and_keys_from_the_command_line(
    redis_server: RedisServer, service: ServiceProcess
) -> None:
    tag = f"org:c{uuid.uuid4().hex[:10]}"
    made = ceiling(redis_server, "budgets", "set", tag, "--limit", "day=$1.50",
                   "--limit", "total=5000000", "--timezone", "Asia/Tokyo")
    assert made.returncode == 0, made.stderr
    shown = json.loads(ceiling(redis_server, "budgets", "show", tag).stdout)
    assert [(p["period"], p["ceiling_micros"]) for p in shown["periods"]] == [
        ("day", 1_500_000), ("total", 5_000_000)]
    assert shown["timezone"] == "Asia/Tokyo"
    key = json.loads(ceiling(redis_server, "keys", "create", tag, "--role", "sidecar").stdout)
    auth = {"Authorization": f"Bearer {key['api_key']}"}
    r = httpx.post(f"{service.url}/v1/reservations", headers=auth, json={"amount_micros": 5})
    assert r.status_code == 201
    revoked = json.loads(ceiling(redis_server, "keys", "revoke", key["key_id"]).stdout)
    assert revoked == {"key_id": key["key_id"], "revoked": True}
    # An instance trusts a key it just checked for KEY_TRUST_MS (the documented delay of a
    # revocation); once that has passed, the revoked key is refused.
    time.sleep(KEY_TRUST_MS / 1000)
    r = httpx.post(f"{service.url}/v1/reservations", headers=auth, json={"amount_micros": 5})
    assert r.status_code == 401


def test_bad_input_on_the_command_line_is_an_error(redis_server: RedisServer) -> None:
    # Real processes: the exit codes an operator's shell sees.
    bad = ceiling_process(redis_server, "budgets", "set", "org:x{y}", "--limit", "day=5")
    assert bad.returncode == 1
    assert json.loads(bad.stderr)["error"]["code"] == "invalid_request"
    assert ceiling_process(redis_server, "budgets", "set", "org:x", "--limit",
                           "fortnight=5").returncode == 2
    # The same refusals from main() in this process, as the other tests here run it.
    bad = ceiling(redis_server, "budgets", "set", "org:x{y}", "--limit", "day=5")
    assert bad.returncode == 1
    assert json.loads(bad.stderr)["error"]["code"] == "invalid_request"
    assert ceiling(redis_server, "budgets", "set", "org:x", "--limit", "fortnight=5"
                   ).returncode == 2


def test_health_from_the_command_line(redis_server: RedisServer) -> None:
    done = ceiling(redis_server, "health")
    assert done.returncode == 0, done.stdout
    assert json.loads(done.stdout)["status"] == "ok"


def test_an_operator_corrects_and_shows_a_reservation_from_the_command_line(
    redis_server: RedisServer, service: ServiceProcess
) -> None:
    tag = f"org:c{uuid.uuid4().hex[:10]}"
    assert ceiling(redis_server, "budgets", "set", tag, "--limit", "total=$1").returncode == 0
    key = json.loads(ceiling(redis_server, "keys", "create", tag, "--role", "sidecar",
                             "--role", "gateway").stdout)
    assert key["roles"] == ["gateway", "sidecar"]
    auth = {"Authorization": f"Bearer {key['api_key']}"}
    rid = httpx.post(f"{service.url}/v1/reservations", headers=auth,
                     json={"amount_micros": 500}).json()["reservation_id"]
    token = "cli-operators-admin-token"
    done = ceiling(redis_server, "reservations", "settle", rid, "--actual", "$0.0002",
                   "--reason", "bill line 12", env={"CEILING_ADMIN_TOKEN": token})
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert (answer["charged_micros"], answer["released_micros"], answer["corrected_by"]) == (
        200, 300, operator_fingerprint(token))
    shown = json.loads(ceiling(redis_server, "reservations", "show", rid).stdout)
    assert (shown["state"], shown["outcome"], shown["corrected_from_micros"],
            shown["correction_reason"]) == ("settled", "corrected", 500, "bill line 12")
    # Safe to run twice; another amount is refused with the error's code.
    again = ceiling(redis_server, "reservations", "settle", rid, "--actual", "200",
                    "--reason", "bill line 12")
    assert json.loads(again.stdout)["replayed"] is True
    other = ceiling(redis_server, "reservations", "settle", rid, "--actual", "201",
                    "--reason", "bill line 12")
    assert other.returncode == 1
    assert json.loads(other.stderr)["error"]["code"] == "idempotency_conflict"
    me = httpx.get(f"{service.url}/v1/budgets/me", headers=auth).json()["budgets"][0]
    assert (me["committed_micros"], me["reserved_micros"]) == (200, 0)
    missing = ceiling(redis_server, "reservations", "show", "0123456789abcdef0123456789abcdef")
    assert json.loads(missing.stderr)["error"]["code"] == "reservation_not_found"
