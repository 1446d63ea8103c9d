"""The real Python LLM clients, installed in a virtualenv of their own, and run.

The OpenAI Agents SDK, langchain-openai, langchain-anthropic and pydantic-ai pin versions of
`openai`, `anthropic`, `httpx`, `pydantic` and `starlette` that would fight the project's, so
they live apart from .venv: pinned with hashes in tests/clients/py/requirements.lock (made by
the `uv pip compile` command at its top), installed once per lock and interpreter into
~/.cache/spend-ceiling/clients-py-<digest> (SC_CLIENTS_CACHE overrides the directory it sits
in). A file lock beside each entry means two pytest workers never fill one entry at once; the
first one installs, the others wait and reuse it, and so does every later run: a clean clone's
CI installs them once. An entry unused for a week is deleted (infra/deploy_build.py's cache).

Each client is a script in tests/clients/py/ that runs named cases in one process, one at a
time as the harness asks for them (`ClientRun`): the harness sets the stub provider up for a
case (its bill, the tool call it scripts), sends the case's name on the script's stdin, and
reads one `CASE {json}` line back: what the client returned, or what it raised.

The clients are configured as a team would point them at the gateway, and only so: the base
URLs and the key in the environment. Nothing they run reaches anything but loopback: their
telemetry is off (tests/clients/py/_report.py) and every HTTP proxy variable points at a closed
loopback port, so a request to anywhere else fails instead of leaving the machine.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from infra.clients import cache_base
from infra.deploy_build import digest, filled_once

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS_DIR = ROOT / "tests" / "clients" / "py"
LOCK_FILE = SCRIPTS_DIR / "requirements.lock"
# Far above what installing the locked wheels takes (about 10 s with uv, a minute with pip);
# past this, something is hanging.
INSTALL_TIMEOUT_S = 900
# A client script imports its library before it can run a case: seconds on a busy machine.
START_TIMEOUT_S = 60.0
# One case is at most a few calls to the stub through the gateway.
CASE_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
OUTPUT_TAIL_CHARS = 6000
# What a script prints before each case's result, and the line it answers when ready.
CASE_MARKER = "CASE "
READY_LINE = "READY"


_HELD_SOCKETS: list[socket.socket] = []


class PyClientsError(Exception):
    """The clients could not be installed, or a client script did not answer; says why."""


def _install_command(venv_python: Path) -> list[str]:
    """uv where the project's environment has it (seconds), else pip (a minute)."""
    uv = Path(sys.executable).with_name("uv")
    uv_path = str(uv) if uv.exists() else shutil.which("uv")
    if uv_path is not None:
        return [uv_path, "pip", "install", "-q", "--python", str(venv_python),
                "--compile-bytecode", "--require-hashes", "-r", str(LOCK_FILE)]
    return [str(venv_python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
            "--require-hashes", "--no-deps", "-r", str(LOCK_FILE)]


def _run(args: list[str], what: str) -> None:
    try:
        done = subprocess.run(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=INSTALL_TIMEOUT_S,
                              check=False)
    except subprocess.TimeoutExpired as exc:
        raise PyClientsError(f"{what}: no result after {INSTALL_TIMEOUT_S} s") from exc
    if done.returncode != 0:
        raise PyClientsError(f"{what} exited with {done.returncode}:\n"
                             f"{done.stdout[-OUTPUT_TAIL_CHARS:]}")


def ensure_py_clients() -> Path:
    """The Python interpreter of the clients' virtualenv, installed first if this lock and
    interpreter have none yet."""
    lock = LOCK_FILE.read_bytes()
    # The interpreter is part of the key: a virtualenv runs only on the one that made it.
    interpreter = f"{sys.version_info[:3]} {Path(sys.base_prefix).resolve()}".encode()
    home = cache_base() / f"clients-py-{digest([lock, interpreter])}"

    def fill(entry: Path) -> None:
        _run([sys.executable, "-m", "venv", str(entry / "venv")], "python -m venv (clients)")
        _run(_install_command(entry / "venv" / "bin" / "python"), f"installing {LOCK_FILE.name}")

    return filled_once(home, fill) / "venv" / "bin" / "python"


@cache
def closed_port() -> int:
    """A loopback port that refuses every connection for as long as this process runs: bound,
    never listened on, so no server of the suite can take it (a port found free could be)."""
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.bind(("127.0.0.1", 0))
    _HELD_SOCKETS.append(held)
    return int(held.getsockname()[1])


def client_env(*, openai_base_url: str, anthropic_base_url: str, api_key: str) -> dict[str, str]:
    """A client's whole environment: the gateway's base URLs and the key, nothing inherited
    that could point it elsewhere (OPENAI_*, ANTHROPIC_*, proxies), and every proxy variable at
    a closed loopback port, so that a request anywhere but loopback fails."""
    dead_proxy = f"http://127.0.0.1:{closed_port()}"
    kept = {name: os.environ[name] for name in ("PATH", "HOME", "LANG", "TMPDIR", "SYSTEMROOT")
            if name in os.environ}
    return {
        **kept,
        "OPENAI_BASE_URL": openai_base_url, "OPENAI_API_KEY": api_key,
        "ANTHROPIC_BASE_URL": anthropic_base_url, "ANTHROPIC_API_KEY": api_key,
        **{name: dead_proxy for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY",
                                         "http_proxy", "https_proxy", "all_proxy")},
        "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
        "PYTHONUNBUFFERED": "1",
    }


class ClientRun:
    """One client script, started once and asked for its cases one at a time."""

    def __init__(self, python: Path, script: str, env: Mapping[str, str]) -> None:
        self.python = python
        self.script = SCRIPTS_DIR / script
        self.env = dict(env)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stderr: list[str] = []
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> ClientRun:
        self._proc = subprocess.Popen(
            [str(self.python), "-W", "ignore", str(self.script), "--serve"], cwd=SCRIPTS_DIR,
            env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, bufsize=1)
        for stream, put in ((self._proc.stdout, self._lines.put),
                            (self._proc.stderr, self._stderr.append)):
            threading.Thread(target=self._read, args=(stream, put), daemon=True).start()
        self._expect(lambda line: line == READY_LINE, START_TIMEOUT_S, "start")
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)

    @staticmethod
    def _read(stream: IO[str] | None, put: Any) -> None:
        if stream is None:
            return
        for line in stream:
            put(line.rstrip("\n"))
        put(None)

    def _expect(self, wanted: Any, timeout_s: float, what: str) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise PyClientsError(f"{self.script.name}: no answer to {what} after "
                                     f"{timeout_s:.0f} s{self._tail()}") from None
            if line is None:
                raise PyClientsError(f"{self.script.name} exited during {what}{self._tail()}")
            if wanted(line):
                return str(line)

    def _tail(self) -> str:
        return "; its stderr:\n" + "\n".join(self._stderr)[-OUTPUT_TAIL_CHARS:]

    def case(self, name: str) -> dict[str, Any]:
        """Run one case; what it returned (`ok`, `text`) or raised (`error_type`,
        `error_status`, `error`)."""
        if self._proc is None or self._proc.stdin is None:
            raise PyClientsError("ClientRun.case before the script was started")
        self._proc.stdin.write(name + "\n")
        self._proc.stdin.flush()
        line = self._expect(lambda line: line.startswith(CASE_MARKER), CASE_TIMEOUT_S, name)
        result = json.loads(line.removeprefix(CASE_MARKER))
        if not isinstance(result, dict) or result.get("case") != name:
            raise PyClientsError(f"{self.script.name} answered {line!r} to {name}")
        return result
