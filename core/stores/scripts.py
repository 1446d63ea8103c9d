"""The lua/ scripts as the server runs them: one function library, or one script each.

A server runs every statement of a script on every call, and defining a function costs it as
much as a few commands: the library the scripts make (`library`: the generated prelude of
core/stores/wire.py, lua/lib.lua, then each script as a function, FCALL) defines them once,
when a server loads it. A server without functions (before Redis 7) runs each as a script of its
own (`script`, EVALSHA), built from its own file and what it uses, and no more.

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
    """One ledger operation: as a script of its own (`source`, known to the server by `sha1`),
    and as `function` of the library, when it is one of the library's."""

    name: str
    source: str
    sha1: str
    function: str | None = None


@dataclass(frozen=True)
class Library:
    """Every ledger operation, as functions of one library named for its text (`digest`), so
    that two versions of the code never call each other's."""

    digest: str
    source: str

    @property
    def name(self) -> str:
        return f"spend_ceiling_{self.digest}"

    def function(self, operation: str) -> str:
        return f"sc_{self.digest}_{operation}"


# A top-level statement of the prelude or lib.lua: 'local NAME ...' or 'local function NAME'
# at the start of a line, with the comment lines right above it.
_STATEMENT = re.compile(r"^local (?:function )?([A-Za-z_]\w*)", re.MULTILINE)
_NAME = re.compile(r"[A-Za-z_]\w*")
_COMMENT = re.compile(r"--.*$", re.MULTILINE)
# Starts the line of a script after which its general case runs (`assembled`).
GENERAL_CASE = "-- The general case"
# Hex digits of the library's digest in its name and its functions' names: 48 bits, so that two
# versions deployed against one ledger share a name with a chance of one in 10**14.
LIBRARY_DIGEST_HEX = 12


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


def _parts() -> list[tuple[str, str]]:
    lib = lua_dir().joinpath("lib.lua").read_text(encoding=SCRIPT_ENCODING)
    return [*((n, text + "\n") for chunk in prelude() for n, text in statements(chunk)),
            *statements(lib)]


def _own(name: str) -> str:
    return lua_dir().joinpath(f"{name}.lua").read_text(encoding=SCRIPT_ENCODING)


def names() -> tuple[str, ...]:
    """Every ledger operation: a file of lua/ but lib.lua."""
    return tuple(sorted(
        entry.name.removesuffix(".lua") for entry in lua_dir().iterdir()
        if entry.name.endswith(".lua") and entry.name != "lib.lua"
    ))


@cache
def library() -> Library:
    """The prelude and lib.lua's statements, defined once when a server loads the library,
    then every operation as a function of (KEYS, ARGV), as a script has them."""
    parts = _parts()
    body = "".join(text for _, text in parts)
    digest = hashlib.sha1(  # noqa: S324 (a name, not a secret)
        (body + "".join(_own(n) for n in names())).encode()).hexdigest()[:LIBRARY_DIGEST_HEX]
    made = Library(digest, "")
    functions = "".join(
        f"\nredis.register_function('{made.function(n)}', function(KEYS, ARGV)\n"
        f"{_own(n)}\nend)\n" for n in names()
    )
    return Library(digest, f"#!lua name={made.name}\n{body}{functions}")


@cache
def script(name: str) -> Script:
    """One ledger operation: its own file, after the statements of the generated prelude
    (core/stores/wire.py) and lua/lib.lua that it uses, and its function in the library. The
    text depends only on this version's code, so every instance of a version sends a script
    under the same SHA-1 and calls the same function."""
    source = f"-- ==== {name}.lua, with what it uses ====\n{assembled(_parts(), _own(name))}"
    sha1 = hashlib.sha1(source.encode()).hexdigest()  # noqa: S324 (Redis' script id)
    return Script(name, source, sha1, library().function(name))


def function_missing(message: str) -> bool:
    """Whether a server's error says it does not know the function called: a server that never
    loaded this version's library (a new one, one FUNCTION FLUSH emptied, a cluster node that
    took the slot over)."""
    return "function not found" in message.lower()


def functions_unknown(message: str) -> bool:
    """Whether a server's error says it has no functions at all (Redis before 7.0)."""
    lowered = message.lower()
    return "unknown command" in lowered and "fcall" in lowered


def library_exists(message: str) -> bool:
    """Whether FUNCTION LOAD failed only because another instance loaded the library first."""
    return "already exists" in message.lower()
