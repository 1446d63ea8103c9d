"""Service instances forked from one process that has imported the service already.

A `ceiling serve` process spends nearly all of its start-up CPU importing the app (FastAPI,
pydantic, uvicorn, the gateway's HTTP clients); a fleet pays that once per instance, and the
suite starts many fleets. The fork server imports those modules once, then forks an
instance per request: each child sets the environment it is given, sends its output to its own
log, and runs `ceiling serve` (api.cli.main) as the command line would. Each instance is still
an OS process with its own memory, configured only by its environment, stopped by its pid.

Nothing is configured before the fork: the imports read no environment (api.runtime reads it on
the first call), so an instance sees only the environment it was given. Python reseeds `random`
in a forked child; the instances share the server's hash seed, as processes started with one
PYTHONHASHSEED would.

Protocol over the server's stdin and stdout, one JSON object a line: the client sends
{"argv", "env", "cwd", "log"}; the server answers {"pid"} (or {"error"}) in order, and sends
{"exited", "code"} whenever a child ends (the server reaps its children; a child of the server
cannot be waited for by the client).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from infra.processes import STOP_TIMEOUT_S, alive

# What `ceiling serve` imports before and while it serves a fleet's instance (the gateway's
# transport, the admin and health routes the fleet calls), uvicorn's loop and protocols, the
# ledger stores the harness starts instances against (api.runtime imports the one its
# environment names, at start), and the HTTP client's connection layer (httpx imports it with
# the first client an instance makes: the alert delivery's, at start).
PRELOADED = (
    "api.cli", "api.app", "api.alerts", "api.transport", "api.routes.admin",
    "api.routes.alerts", "api.routes.dashboard", "api.routes.health", "fastapi", "uvicorn",
    "uvicorn.loops.auto", "uvicorn.protocols.http.auto", "uvicorn.lifespan.on",
    "core.stores.redis", "core.stores.redis_cluster", "core.stores.upstash", "httpcore",
    "certifi",
)
# The `serve` extra's loop and parser, when installed (uvicorn falls back without them).
PRELOADED_IF_INSTALLED = ("uvloop", "httptools", "uvicorn.loops.uvloop",
                          "uvicorn.protocols.http.httptools_impl")
# The server imports what one instance does; past this it is broken.
READY_TIMEOUT_S = 60.0
# A child still running this long after SIGTERM, when the server ends, is killed.
CHILD_STOP_TIMEOUT_S = STOP_TIMEOUT_S
# The client waits this long for the server to stop its children and exit.
SERVER_STOP_TIMEOUT_S = CHILD_STOP_TIMEOUT_S + 5.0
# Descriptors a child closes before it runs: everything but stdin, stdout and stderr.
FD_FIRST_CLOSED = 3


# ---- the server (python -m infra.forkserver) --------------------------------------------------


def _child(request: dict[str, Any]) -> None:
    """In the forked child: become the instance the request describes. Never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        log = request["log"] or os.devnull
        out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.closerange(FD_FIRST_CLOSED, os.sysconf("SC_OPEN_MAX"))
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        from api.cli import main

        sys.argv = ["ceiling", *request["argv"]]
        try:
            code = main(request["argv"])
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - a child reports its failure by its exit code
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    for name in PRELOADED:
        __import__(name)
    for name in PRELOADED_IF_INSTALLED:
        with contextlib.suppress(ImportError):
            __import__(name)
    # The imported modules' objects are shared with every child: frozen here, a child's own
    # collections (`ceiling serve` collects and freezes at its start) never walk them, and
    # touch the pages that hold them to do so, which would copy those pages into the child.
    gc.collect()
    gc.freeze()
    reader, waker = os.pipe()
    os.set_blocking(waker, False)
    signal.set_wakeup_fd(waker)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    out = sys.stdout

    def send(message: dict[str, Any]) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    children: set[int] = set()
    try:
        _serve(children, send, reader)
    finally:
        _stop_children(children)


def _stop_children(children: set[int]) -> None:
    """SIGTERM each child, SIGKILL any still running after CHILD_STOP_TIMEOUT_S, and reap them
    all here: none is left running or left to init, whatever ended the server."""
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + CHILD_STOP_TIMEOUT_S
    while children and time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # none left to reap: all of them are gone
            break
        if pid == 0:
            time.sleep(0.05)
        else:
            children.discard(pid)
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in children:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    children.clear()


def _serve(children: set[int], send: Callable[[dict[str, Any]], None], reader: int) -> None:
    send({"ready": os.getpid()})
    stdin = sys.stdin.fileno()
    pending = b""
    while True:
        ready, _, _ = select.select([stdin, reader], [], [])
        if reader in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(reader, 4096)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            send({"exited": pid, "code": os.waitstatus_to_exitcode(status)})
        if stdin not in ready:
            continue
        chunk = os.read(stdin, 65536)
        if not chunk:  # the client is gone: so are the instances it started (serve's finally)
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            try:
                pid = os.fork()
            except OSError as exc:
                send({"error": str(exc)})
                continue
            if pid == 0:
                _child(request)
            children.add(pid)
            send({"pid": pid})


# ---- the client ------------------------------------------------------------------------------


class Forked:
    """A child of the fork server, with the part of subprocess.Popen the harness uses."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.server, self.pid = server, pid
        self.args = ["forked", str(pid)]
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid, timeout_s=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid, timeout_s=timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The client side: one server per process that asks (`ForkServer.shared()`), stopped by pid
    when that process exits."""

    _shared: ForkServer | None = None
    _shared_lock = threading.Lock()

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "infra.forkserver"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, bufsize=0,
        )
        self._lock = threading.Lock()  # one spawn at a time: its answer is the next "pid"
        self._changed = threading.Condition()
        self._exits: dict[int, int] = {}
        self._answers: list[dict[str, Any]] = []
        self._ready = False
        self._gone = False
        threading.Thread(target=self._read, name="forkserver-reader", daemon=True).start()
        with self._changed:
            if not self._changed.wait_for(lambda: self._ready or self._gone, READY_TIMEOUT_S):
                self.stop()
                raise RuntimeError(f"the fork server was not ready within {READY_TIMEOUT_S} s")
        if not self._ready:
            raise RuntimeError(f"the fork server exited with {self.process.wait()}")

    @classmethod
    def shared(cls) -> ForkServer:
        with cls._shared_lock:
            if cls._shared is None or cls._shared._gone:
                cls._shared = cls()
                import atexit

                atexit.register(cls._shared.stop)
            return cls._shared

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            message = json.loads(line)
            with self._changed:
                if "ready" in message:
                    self._ready = True
                elif "exited" in message:
                    self._exits[message["exited"]] = message["code"]
                else:
                    self._answers.append(message)
                self._changed.notify_all()
        with self._changed:
            self._gone = True
            self._changed.notify_all()

    def spawn(self, argv: list[str], env: dict[str, str], log_path: str | None) -> Forked:
        """Fork an instance running `ceiling <argv>` with exactly `env`; output to `log_path`."""
        request = {"argv": argv, "env": env, "cwd": os.getcwd(), "log": log_path}
        with self._lock:
            assert self.process.stdin is not None
            try:
                self.process.stdin.write((json.dumps(request) + "\n").encode())
            except BrokenPipeError as exc:
                raise RuntimeError("the fork server is gone") from exc
            with self._changed:
                if not self._changed.wait_for(lambda: self._answers or self._gone,
                                              READY_TIMEOUT_S) or not self._answers:
                    raise RuntimeError("the fork server did not answer")
                answer = self._answers.pop(0)
        if "error" in answer:
            raise RuntimeError(f"the fork server could not fork: {answer['error']}")
        return Forked(self, int(answer["pid"]))

    def exit_code(self, pid: int, *, timeout_s: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits or self._gone, timeout_s)
            if pid in self._exits:
                return self._exits.pop(pid)
            if self._gone:
                # The server stopped and reaped its children on its way out (_stop_children);
                # one that outlived a server that was killed is killed here.
                if alive(pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                return -signal.SIGTERM
            return None

    def stop(self) -> None:
        """Closing its stdin ends the server, which stops what it still runs."""
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        try:
            self.process.wait(timeout=SERVER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


if __name__ == "__main__":
    serve()
