"""Child processes of the harness: waited for until ready, stopped by their pid."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Callable
from functools import cache
from typing import Protocol, Self

# A child that has not exited this long after SIGTERM is killed.
STOP_TIMEOUT_S = 10.0
POLL_INTERVAL_S = 0.05
# A free port is chosen before the child binds it; a parallel test worker may take it between
# the two. A child that lost its first port is started again on another, this many times.
PORT_ATTEMPTS_MAX = 3
# /proc/net/tcp's state of a listening socket.
TCP_LISTEN = "0A"


@cache
def tls_context() -> ssl.SSLContext:
    """The TLS context of the harness's HTTP clients, one per process: httpx's default (it
    verifies against the same CA bundle). httpx builds a new one for every client or one-off
    request that is not given one, reading the whole bundle each time: more CPU than the
    loopback call the client makes, and the suite makes thousands of them (readiness polls,
    fixtures, bill reads, fault resets)."""
    import httpx  # only where a client is made: Redis's and the fork server's users need none

    return httpx.create_ssl_context()


class Child(Protocol):
    """What the harness uses of a child process: subprocess.Popen, or a fork server's child
    (infra/forkserver.py)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


def alive(pid: int) -> bool:
    """A process of this pid exists (a zombie not yet reaped counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class OnAFreePort:
    """A harness server started on a free port: `_start_once` starts the child on `self.port`
    and waits until it is ready, raising RuntimeError if it is not. A first start that fails may
    have lost its port to another process between free_port() and the bind: it is started again
    on another port, up to PORT_ATTEMPTS_MAX times. A restart keeps its port (its clients and
    data are there)."""

    port: int
    _started_once = False

    def _start_once(self) -> None:
        raise NotImplementedError

    def start(self) -> Self:
        for attempt in range(PORT_ATTEMPTS_MAX):
            try:
                self._start_once()
                break
            except RuntimeError:
                if self._started_once or attempt == PORT_ATTEMPTS_MAX - 1:
                    raise
                self.port = free_port()
        self._started_once = True
        return self


def listening(pid: int, port: int) -> bool:
    """`pid` holds the socket listening on `port` (Linux /proc). A server answering on a port is
    not known to be ours until this says so: another process may have bound it first."""
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[len("socket:["):-1])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as rows:
            for row in rows.readlines()[1:]:
                cols = row.split()
                if (cols[3] == TCP_LISTEN and cols[9] in inodes
                        and int(cols[1].rsplit(":", 1)[1], 16) == port):
                    return True
    return False


def wait_ready(
    process: Child, ready: Callable[[], bool], *, timeout_s: float, what: str
) -> None:
    """Poll `ready` until it is true; stop the child and raise if it exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}")
        if ready():
            return
        time.sleep(POLL_INTERVAL_S)
    stop(process)
    raise RuntimeError(f"{what} was not ready within {timeout_s} s")


def stop(process: Child | None, *, kill: bool = False) -> None:
    """Stop a child by its pid: SIGTERM lets it finish cleanly, kill=True is a crash."""
    if process is None:
        return
    # An ended child is not signalled: a fork server's child is reaped as soon as it ends, and
    # its pid may already be another process's.
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(process.pid, signal.SIGKILL if kill else signal.SIGTERM)
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
