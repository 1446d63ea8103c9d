"""Who may import whom, across the repository's top-level directories and the layers.

    api/          may import core (not core/stores: it gets a store from core/backends.py)
    core/         the domain: imports no api/, no web framework, no HTTP client, and the
                  stores only where they are composed (COMPOSITION): none reads their
                  layout (an export's body is the store's, core/stores/operations.py)
    core/stores/  adapters: may import core and its backends' clients (STORE_CLIENTS)
    lua/          data: read with importlib.resources, never imported as code
    infra/, tests/, bench/, locustfiles/   may import anything; nothing but bench/ imports bench/

Imports are read with `ast`, every one of them (inside functions and TYPE_CHECKING blocks too):
a lazy import is still a dependency."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The repository's own Python outside bench/ (build outputs and venvs hold other projects').
SOURCE_DIRS = ("api", "core", "infra", "locustfiles", "tests")
# Web frameworks, servers and HTTP clients: the api layer's, never the domain's.
WEB = frozenset({"starlette", "fastapi", "httpx", "aiohttp", "uvicorn", "mangum"})
# Harnesses, tests and measurements: nothing that ships imports them.
NOT_SHIPPED = frozenset({"infra", "tests", "bench", "locustfiles"})
# The backends' client libraries, which only the adapters in core/stores/ speak (httpx is the
# Upstash REST client there, and the provider's client in api/).
STORE_CLIENTS = frozenset({"redis", "fakeredis", "httpx"})
STORES = "core.stores"
# Where core makes stores: the one module that picks a backend and builds its store and
# catalogue (core/backends.py); every other caller takes the protocols of core/ledger.py.
COMPOSITION = {"core/backends.py": frozenset({STORES})}


def imported_modules(tree: ast.Module) -> set[str]:
    """Every module a file imports, by its full dotted name; `from a import b` counts as both
    `a` and `a.b` (b may be a module)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = "." * node.level + node.module
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names if a.name != "*")
    return found


def imported_roots(tree: ast.Module) -> set[str]:
    return {m.split(".")[0] for m in imported_modules(tree) if not m.startswith(".")}


def sources(*dirs: str) -> Iterator[tuple[str, set[str]]]:
    """(path from the root, modules it imports) for every Python file under `dirs`."""
    for d in dirs:
        for path in sorted((ROOT / d).rglob("*.py")):
            yield (path.relative_to(ROOT).as_posix(),
                   imported_modules(ast.parse(path.read_text(), str(path))))


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_nothing_outside_bench_imports_bench() -> None:
    """bench/ holds entry points that measure; the product, its harnesses (infra/) and its
    tests import none of them, so a benchmark can change without changing what ships."""
    found = []
    paths = [*ROOT.glob("*.py"), *(p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py"))]
    for path in sorted(paths):
        if "bench" in imported_roots(ast.parse(path.read_text(), str(path))):
            found.append(str(path.relative_to(ROOT)))
    assert found == []


def test_the_product_uses_absolute_imports() -> None:
    """So that every rule below sees the module an import names."""
    found = [(path, m) for path, mods in sources("api", "core", "lua") for m in mods
             if m.startswith(".")]
    assert found == []


def test_what_ships_imports_no_harness_test_or_benchmark() -> None:
    found = [(path, m) for path, mods in sources("api", "core", "lua") for m in mods
             if m.split(".")[0] in NOT_SHIPPED]
    assert found == []


def test_core_imports_no_api_and_no_web_framework() -> None:
    """The domain runs the same under the HTTP API, the CLI and a test; it knows no request."""
    found = []
    for path, mods in sources("core"):
        for m in mods:
            root = m.split(".")[0]
            if root == "api" or (root in WEB and not (
                    path.startswith("core/stores/") and root in STORE_CLIENTS)):
                found.append((path, m))
    assert found == []


def test_backend_clients_are_spoken_only_in_core_stores() -> None:
    found = [(path, m) for path, mods in sources("api", "core") for m in mods
             if m.split(".")[0] in STORE_CLIENTS - {"httpx"}
             and not path.startswith("core/stores/")]
    assert found == []


def test_core_imports_the_stores_only_where_it_composes_them() -> None:
    """A caller takes the store protocols it uses (core/ledger.py), so no caller depends on an
    adapter: only the composition points make stores."""
    found = []
    for path, mods in sources("core"):
        if path.startswith("core/stores/"):
            continue
        for m in sorted(mods):
            if not _under(m, STORES) or m == STORES:
                continue
            allowed = COMPOSITION.get(path, frozenset())
            if not any(_under(m, a) for a in allowed):
                found.append((path, m))
    assert found == []


@pytest.mark.parametrize("path", sorted(COMPOSITION))
def test_every_listed_composition_point_exists_and_imports_the_stores(path: str) -> None:
    """The lists above name what is there, not what once was."""
    mods = dict(sources("core"))[path]
    assert any(_under(m, STORES) and m != STORES for m in mods)


def test_api_imports_core_but_not_the_stores() -> None:
    """The API gets its store from core/backends.py, as every other caller does."""
    found = [(path, m) for path, mods in sources("api") for m in mods if _under(m, STORES)]
    assert found == []


def test_lua_is_data() -> None:
    """lua/ holds scripts, read with importlib.resources (core/stores/scripts.py): its one Python
    file makes it a package and imports nothing, and no Python imports it as code."""
    py = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "lua").rglob("*.py"))
    assert py == ["lua/__init__.py"]
    assert dict(sources("lua"))["lua/__init__.py"] == set()
    found = [(path, m) for path, mods in sources(*SOURCE_DIRS, "bench") for m in mods
             if m.split(".")[0] == "lua"]
    assert found == []
