"""The lua/ scripts, each prefixed with lua/lib.lua, as the text every store sends."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

LUA_DIR = Path(__file__).resolve().parents[2] / "lua"


@dataclass(frozen=True)
class Script:
    name: str
    source: str
    sha1: str


@cache
def script(name: str) -> Script:
    """One ledger operation's script; the shared prelude is prepended at load time."""
    lib = (LUA_DIR / "lib.lua").read_text()
    source = f"{lib}\n-- ==== {name}.lua ====\n{(LUA_DIR / f'{name}.lua').read_text()}"
    return Script(name, source, hashlib.sha1(source.encode()).hexdigest())  # noqa: S324 (Redis' script id)
