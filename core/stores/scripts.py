"""The lua/ scripts, each prefixed with the names core/stores/wire.py generates and lua/lib.lua,
as the text every store sends.

The scripts are package data of the `lua` package, read through importlib.resources: the same
lookup finds them in a checkout, an editable install, an installed wheel and the Vercel and
Lambda artifacts, where a path worked out from this file's location holds in a checkout only.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from importlib.resources.abc import Traversable

from core.stores.wire import prelude

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


# A top-level statement of the prelude or lib.lua: 'local NAME ...' or 'local function NAME'
# at the start of a line, with the comment lines right above it.
_STATEMENT = re.compile(r"^local (?:function )?([A-Za-z_]\w*)", re.MULTILINE)
_NAME = re.compile(r"[A-Za-z_]\w*")
_COMMENT = re.compile(r"--.*$", re.MULTILINE)
# Starts the line of a script after which its general case runs (`assembled`).
GENERAL_CASE = "-- The general case"


def statements(source: str) -> list[tuple[str, str]]:
    """(name, text) of each top-level statement of `source`, in order; the comment lines right
    above one belong to it, and what stands above the first (a file's header) to none."""
    lines = source.splitlines(keepends=True)
    starts = []
    for i, line in enumerate(lines):
        if _STATEMENT.match(line):
            while i > 0 and lines[i - 1].startswith("--"):
                i -= 1
            starts.append(i)
    out = []
    for begin, end in zip(starts, [*starts[1:], len(lines)], strict=True):
        text = "".join(lines[begin:end])
        found = _STATEMENT.search(text)
        assert found is not None
        out.append((found.group(1), text))
    return out


def needed(parts: Sequence[tuple[str, str]], body: str, have: frozenset[str] = frozenset()
           ) -> set[str]:
    """The statements `body` uses, and those they use, beyond the ones in `have`."""
    defined = dict(parts)
    wanted: set[str] = set()
    todo = [body]
    while todo:
        for name in _NAME.findall(_COMMENT.sub("", todo.pop())):
            if name in defined and name not in wanted and name not in have:
                wanted.add(name)
                todo.append(defined[name])
    return wanted


def assembled(parts: Sequence[tuple[str, str]], own: str) -> str:
    """A script: the statements its own text uses, then its own text. The server runs every
    statement of a script on every call, and a function costs it as much to define as a few
    commands: each script defines only what it runs, and a script whose common case answers
    before its general case (a line starting GENERAL_CASE) defines what only the general case
    uses after that line, where the common case never reaches."""
    common, marker, general = own.partition("\n" + GENERAL_CASE)
    first = needed(parts, common)
    rest = needed(parts, general, frozenset(first)) if marker else set()

    def text(names: set[str]) -> str:
        return "".join(t for n, t in parts if n in names)

    if not marker:
        return f"{text(first)}\n{common}"
    return f"{text(first)}\n{common}\n{text(rest)}{GENERAL_CASE}{general}"


@cache
def script(name: str) -> Script:
    """One ledger operation's script, built from its own file and the statements of the
    generated prelude (core/stores/wire.py) and lua/lib.lua that it uses. The text depends only
    on this version's code, so every instance of a version sends a script under the same
    SHA-1."""
    scripts = lua_dir()
    lib = scripts.joinpath("lib.lua").read_text(encoding=SCRIPT_ENCODING)
    own = scripts.joinpath(f"{name}.lua").read_text(encoding=SCRIPT_ENCODING)
    parts = [*((n, text + "\n") for chunk in prelude() for n, text in statements(chunk)),
             *statements(lib)]
    source = f"-- ==== {name}.lua, with what it uses ====\n{assembled(parts, own)}"
    return Script(name, source, hashlib.sha1(source.encode()).hexdigest())  # noqa: S324 (Redis' script id)
