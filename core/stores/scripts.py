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
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from importlib.resources.abc import Traversable
from typing import Any

from core.errors import LedgerUnavailable
from core.stores import keys
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
        return f"{LIBRARY_PREFIX}{self.digest}"

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
# What every version's library is named by: this, then its digest.
LIBRARY_PREFIX = "spend_ceiling_"
# The libraries of other versions kept however long ago they were loaded: the most recently
# recorded ones (prune_libraries), this instance's own among them. A rolling deploy runs two
# versions against one ledger at once.
LIBRARIES_RECENT_KEPT = 2
# And every library recorded within this long, however many: a deploy, and a rollback after it,
# find the libraries their instances still call, for a day.
LIBRARY_RETENTION_MS = 24 * 3_600_000


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


# -- the libraries of other versions ---------------------------------------------------------

Execute = Callable[..., Awaitable[Any]]
"""One command to the ledger's Redis, and its reply (a Transport's `execute`)."""


async def prune_libraries(execute: Execute, own: str,
                          ledger_time_ms: Callable[[], Awaitable[int]]) -> tuple[str, ...]:
    """Delete the function libraries of versions of the code that no longer run, when the first
    instance of a version opens the ledger; the names deleted.

    Each version loads a library of its own (`library`, named for its text) and nothing else
    deletes one, so a Redis would keep one per deploy for good. The registry
    (keys.LIBRARIES_KEY) holds, for each library, when the first instance of its version opened
    the ledger, by the ledger's time; a library loaded by a version that kept no registry counts
    from when it is first seen here (as just before `own`). An instance whose library is not
    recorded deletes every `spend_ceiling_*` library but its own, the LIBRARIES_RECENT_KEPT most
    recently recorded and those recorded within LIBRARY_RETENTION_MS, then records its own
    (last: an instance that fails before that leaves the work to the next one). Every other
    instance reads one score and does nothing more: a version prunes once, not on every start.

    Deleting a library that a running version still calls costs that version a load, never a
    call: a call that finds its function missing loads its version's library again and is made
    again (core/stores/redis.py and upstash.py `run`, as every version with a library does). The
    two versions of a rolling deploy never delete each other's (each is among the two most
    recent), so two versions taking turns leave at most LIBRARIES_RECENT_KEPT libraries once
    the others' retention has passed; more versions than that, running together for longer than
    the retention, make each other reload, once per first instance of a version whose record
    was pruned.
    """
    if await execute("ZSCORE", keys.LIBRARIES_KEY, own) is not None:
        return ()
    now_ms = await ledger_time_ms()
    try:
        listed = _library_names(
            await execute("FUNCTION", "LIST", "LIBRARYNAME", LIBRARY_PREFIX + "*"))
    except LedgerUnavailable:
        listed = set()  # a server without functions (before Redis 7.0) has none to delete
    recorded = _scores(await execute("ZRANGE", keys.LIBRARIES_KEY, "0", "-1", "WITHSCORES"))
    unseen = listed - recorded.keys() - {own}
    recorded |= dict.fromkeys(unseen, now_ms - 1)
    recorded[own] = now_ms
    recent = sorted(recorded, key=lambda name: (recorded[name], name))[-LIBRARIES_RECENT_KEPT:]
    kept = {own, *recent, *(n for n, at in recorded.items() if at > now_ms - LIBRARY_RETENTION_MS)}
    gone = sorted(recorded.keys() - kept)
    deleted = []
    for name in gone:
        if name in listed:
            try:
                await execute("FUNCTION", "DELETE", name)
                deleted.append(name)
            except LedgerUnavailable:
                pass  # another instance deleted it first
    if gone:
        await execute("ZREM", keys.LIBRARIES_KEY, *gone)
    if unseen:
        await execute("ZADD", keys.LIBRARIES_KEY, "NX",
                      *(part for name in sorted(unseen) for part in (str(now_ms - 1), name)))
    await execute("ZADD", keys.LIBRARIES_KEY, str(now_ms), own)
    return tuple(deleted)


def _library_names(listed: Any) -> set[str]:
    """The names in a FUNCTION LIST reply: a map per library (redis-py), or its fields and
    values in turn (RESP2 as the Upstash REST API passes it on)."""
    names = set()
    for entry in listed or ():
        fields = entry if isinstance(entry, dict) else dict(zip(entry[::2], entry[1::2],
                                                               strict=True))
        name = str(fields.get("library_name", ""))
        if name.startswith(LIBRARY_PREFIX):
            names.add(name)
    return names


def _scores(reply: Any) -> dict[str, int]:
    """ZRANGE ... WITHSCORES as {member: score}: pairs (RESP3), or members and scores in turn."""
    items = list(reply or ())
    pairs = items if items and isinstance(items[0], list | tuple) else zip(
        items[::2], items[1::2], strict=True)
    return {str(member): int(float(score)) for member, score in pairs}
