"""The lua/ scripts, each prefixed with lua/lib.lua, as the text every store sends.

The scripts are package data of the `lua` package, read through importlib.resources: the same
lookup finds them in a checkout, an editable install, an installed wheel and the Vercel and
Lambda artifacts, where a path worked out from this file's location holds in a checkout only.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from importlib.resources.abc import Traversable

SCRIPTS_PACKAGE = "lua"
# Fixed, not the locale's: the text's SHA-1 is the script's id in Redis, which every instance
# must compute alike.
SCRIPT_ENCODING = "utf-8"


def lua_dir() -> Traversable:
    """Where the scripts are, as the import system found the `lua` package."""
    return files(SCRIPTS_PACKAGE)


@dataclass(frozen=True)
class Script:
    name: str
    source: str
    sha1: str


@cache
def script(name: str) -> Script:
    """One ledger operation's script; the shared prelude is prepended at load time."""
    scripts = lua_dir()
    lib = scripts.joinpath("lib.lua").read_text(encoding=SCRIPT_ENCODING)
    own = scripts.joinpath(f"{name}.lua").read_text(encoding=SCRIPT_ENCODING)
    source = f"{lib}\n-- ==== {name}.lua ====\n{own}"
    return Script(name, source, hashlib.sha1(source.encode()).hexdigest())  # noqa: S324 (Redis' script id)
