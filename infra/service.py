"""Start-up of one service instance as its own OS process, as a serverless instance would be.

`ServiceProcess` runs `ceiling serve` (uvicorn, one worker) on a free loopback port with the
environment it is given, waits until `/health/live` answers, and stops it by pid. With
`platform=True` it runs the app the way Vercel and Lambda do: the ASGI app served as it is, with
no `ceiling serve` start-up check in front of it. `ceiling serve` is forked from a process that
has imported the app (infra/forkserver.py) unless told not to.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from dataclasses import dataclass, field
from types import TracebackType

import httpx

from infra.forkserver import ForkServer
from infra.processes import (
    Child,
    OnAFreePort,
    free_port,
    listening,
    stop,
    tls_context,
    wait_ready,
)

# An instance imports FastAPI and answers /health/live in moments; after 30 s it is broken.
START_TIMEOUT_S = 30.0
# Variables read by the dynamic loader or the interpreter at exec, which a fork never repeats.
EXEC_ONLY_ENV_PREFIXES = ("LD_", "PYTHON")


@dataclass
class ServiceProcess(OnAFreePort):
    env: dict[str, str]
    port: int = field(default_factory=free_port)
    process: Child | None = None
    log_path: str | None = None
    platform: bool = False
    # Forked from a process that has imported the service already (infra/forkserver.py): the
    # same `ceiling serve`, without each start's import CPU, which the suite pays per start. An
    # environment that acts only when an interpreter starts (LD_PRELOAD's libfaketime, PYTHON*)
    # is run as a command of its own, as is `platform`; forked=False always is.
    forked: bool = True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def forks(self) -> bool:
        return self.forked and not self.platform and not any(
            name.startswith(EXEC_ONLY_ENV_PREFIXES) for name in self.env)

    def _start_once(self) -> None:
        env = {**os.environ, **self.env}
        listen = ["--host", "127.0.0.1", "--port", str(self.port)]
        if self.forks:
            self.process = ForkServer.shared().spawn(["serve", *listen], env, self.log_path)
        else:
            out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
            command = (
                ["-m", "uvicorn", "api.index:app", "--log-level", "warning"]
                if self.platform else ["-m", "api.cli", "serve"]
            )
            self.process = subprocess.Popen(
                [sys.executable, *command, *listen], env=env, stdout=out, stderr=out)
        # One client for all polls, with the process's one SSL context: a new context per client
        # is CPU that 25 instances starting at once would pay many times over.
        with httpx.Client(timeout=1.0, verify=tls_context()) as client:

            def live() -> bool:
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.url}/health/live").status_code != 200:
                        return False
                    assert self.process is not None
                    return listening(self.process.pid, self.port)
                return False

            wait_ready(self.process, live, timeout_s=START_TIMEOUT_S,
                       what=f"service on port {self.port}")

    def stop(self, *, kill: bool = False) -> None:
        """SIGTERM lets uvicorn finish open requests; kill=True is a crash."""
        stop(self.process, kill=kill)
        self.process = None

    def __enter__(self) -> ServiceProcess:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
