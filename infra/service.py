"""Start-up of one service instance as its own OS process, as a serverless instance would be.

`ServiceProcess` runs `ceiling serve` (uvicorn, one worker) on a free loopback port with the
environment it is given, waits until `/health/live` answers, and stops it by pid. With
`platform=True` it runs the app the way Vercel and Lambda do: the ASGI app served as it is, with
no `ceiling serve` start-up check in front of it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from types import TracebackType

import httpx

from infra.redis_server import free_port

# An instance imports FastAPI and answers /health/live within a second or two; 30 s is broken.
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


@dataclass
class ServiceProcess:
    env: dict[str, str]
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    log_path: str | None = None
    platform: bool = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServiceProcess:
        env = {**os.environ, **self.env}
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        command = (
            ["-m", "uvicorn", "api.index:app", "--log-level", "warning"]
            if self.platform else ["-m", "api.cli", "serve"]
        )
        self.process = subprocess.Popen(
            [sys.executable, *command, "--host", "127.0.0.1", "--port", str(self.port)],
            env=env, stdout=out, stderr=out,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        # One client for all polls: a new one per poll costs ~77 ms of CPU (its SSL context),
        # which 25 instances starting at once pay many times over.
        with httpx.Client(timeout=1.0) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"service exited with {self.process.returncode}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.url}/health/live").status_code == 200:
                        return self
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"service did not answer on port {self.port}")

    def stop(self, *, kill: bool = False) -> None:
        """SIGTERM lets uvicorn finish open requests; kill=True is a crash."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.pid, signal.SIGKILL if kill else signal.SIGTERM)
        try:
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None

    def __enter__(self) -> ServiceProcess:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
