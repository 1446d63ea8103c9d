"""A real redis-server on a free loopback port, started and stopped by pid.

Used by the test fixtures, the demo and the benchmarks. `durable=True` is the configuration
spend-ceiling ships for production: AOF with fsync every second, and `noeviction`, because an
evicted counter is a refilled budget. The fault tests (tests/reliability/test_ledger_field.py)
start the others: snapshots only (`snapshots=True`), an evicting `maxmemory_policy`, and a
replica of another server (`replica_of`).
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from infra.processes import OnAFreePort, free_port, listening, stop, wait_ready

# redis-server answers PING as soon as it has started; 10 s means it is not coming up.
START_TIMEOUT_S = 10.0


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        raise RuntimeError(
            "redis-server is not installed; `bash infra/test.sh` installs it (apt-get install "
            "redis-server)"
        )
    return found


@dataclass
class RedisServer(OnAFreePort):
    port: int = field(default_factory=free_port)
    durable: bool = False
    # Redis' own default persistence: an RDB snapshot on a schedule, no AOF (`durable` wins).
    snapshots: bool = False
    maxmemory_policy: str = "noeviction"
    # The port of a server on 127.0.0.1 this one replicates.
    replica_of: int | None = None
    extra_args: tuple[str, ...] = ()
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="sc-redis-")))
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def args(self) -> list[str]:
        persistence = (
            ["--appendonly", "yes", "--appendfsync", "everysec", "--save", ""]
            if self.durable
            else ["--appendonly", "no", "--save", "3600 1 300 100 60 10000"]
            if self.snapshots
            else ["--appendonly", "no", "--save", ""]
        )
        replication = ["--replicaof", "127.0.0.1", str(self.replica_of)] if self.replica_of else []
        return [
            redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
            "--dir", str(self.workdir), "--maxmemory-policy", self.maxmemory_policy,
            "--daemonize", "no", "--loglevel", "warning", *persistence, *replication,
            *self.extra_args,
        ]

    def _start_once(self) -> None:
        self.process = subprocess.Popen(
            self.args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_ready(self.process, self.ours, timeout_s=START_TIMEOUT_S,
                   what=f"redis-server on port {self.port}")

    def ours(self) -> bool:
        """It answers, and it is this process that listens on the port."""
        return self.ping() and self.process is not None and listening(self.process.pid, self.port)

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self, *, kill: bool = False) -> None:
        """Stop by pid: SIGTERM lets Redis write its AOF; kill=True is a crash."""
        stop(self.process, kill=kill)
        self.process = None

    def restart(self, *, wipe: bool = False) -> None:
        """Stop and start on the same port; wipe=True also deletes what it persisted."""
        self.stop()
        if wipe:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir.mkdir(parents=True)
        self.start()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


class Forwarder:
    """A TCP endpoint on a free loopback port that forwards to a server's port, and can be
    pointed at another: a managed Redis' endpoint, behind which a failover promotes a replica.
    `switch` closes every forwarded connection, as a failover breaks its clients'. `stall`
    stops delivering what either side sends (a replication link that stalled: what was sent
    meanwhile never arrives), until `switch`."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        self._stalled = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=2)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                if not self._stalled:
                    sink.sendall(data)
        except OSError:
            pass
        for s in (source, sink):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def stall(self) -> None:
        self._stalled = True

    def switch(self, target_port: int) -> None:
        self.target_port, self._stalled = target_port, False
        with self._lock:
            connections, self._open = self._open, []
        for s in connections:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.switch(self.target_port)
