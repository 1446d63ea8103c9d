"""Child processes of the harness: waited for until ready, stopped by their pid."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable

# A child that has not exited this long after SIGTERM is killed.
STOP_TIMEOUT_S = 10.0
POLL_INTERVAL_S = 0.05


def wait_ready(
    process: subprocess.Popen[bytes], ready: Callable[[], bool], *, timeout_s: float, what: str
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


def stop(process: subprocess.Popen[bytes] | None, *, kill: bool = False) -> None:
    """Stop a child by its pid: SIGTERM lets it finish cleanly, kill=True is a crash."""
    if process is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(process.pid, signal.SIGKILL if kill else signal.SIGTERM)
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
