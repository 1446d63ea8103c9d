"""A real redis-server on a free loopback port, started and stopped by pid.

Used by the test fixtures, the demo and the benchmarks. `durable=True` is the configuration
spend-ceiling ships for production: AOF with fsync every second, and `noeviction`, because an
evicted counter is a refilled budget.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
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
            else ["--appendonly", "no", "--save", ""]
        )
        return [
            redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
            "--dir", str(self.workdir), "--maxmemory-policy", "noeviction",
            "--daemonize", "no", "--loglevel", "warning", *persistence, *self.extra_args,
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
