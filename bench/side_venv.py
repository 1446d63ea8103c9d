"""The benchmarks' side venv: the tools they measure against, kept out of the project's venv.

    .venv/bin/python -m bench.side_venv        # make it (once; later runs reuse it) and say where

hardcap (the baseline gateway bench/gateway.py runs beside ours) brings aiohttp, uvloop and its
own pins of redis-py; installed into the project's venv they would change what `ceiling serve`
runs on (uvicorn picks uvloop up by itself). py-spy (the sampling profiler
bench/gateway_profile.py attaches to the server) is a binary and needs no project at all. So
both live in a venv of their own under the user's cache, made on first use and reused while its
requirements are the same.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

# Pinned: a baseline that moves between runs is not a baseline.
REQUIREMENTS = ("hardcap==0.1.0", "py-spy==0.4.3")
# Installing them takes under a minute from the package index; ten is a hung index.
INSTALL_TIMEOUT_S = 600.0


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "spend-ceiling"


def side_venv() -> Path:
    """The side venv's directory, made now if it is missing or was made for other requirements."""
    root = cache_dir() / "bench-venv"
    stamp = root / f".installed-{hashlib.sha256(' '.join(REQUIREMENTS).encode()).hexdigest()[:16]}"
    if stamp.exists():
        return root
    print(f"bench: making the side venv {root} ({', '.join(REQUIREMENTS)})", file=sys.stderr)
    # The base interpreter, not this venv's: a venv made from a venv's python links to it.
    base_python = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base_python, "-m", "venv", "--clear", str(root)], check=True,
                   timeout=INSTALL_TIMEOUT_S)
    subprocess.run([str(root / "bin" / "python"), "-m", "pip", "install", "-q",
                    "--disable-pip-version-check", *REQUIREMENTS],
                   check=True, timeout=INSTALL_TIMEOUT_S, stdout=subprocess.DEVNULL)
    stamp.touch()
    return root


def python() -> str:
    return str(side_venv() / "bin" / "python")


def tool(name: str) -> str:
    """An executable the side venv installed (hardcap, py-spy)."""
    return str(side_venv() / "bin" / name)


if __name__ == "__main__":
    print(side_venv())
