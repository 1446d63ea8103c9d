"""Who may import whom, across the repository's top-level directories."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The repository's own Python outside bench/ (build outputs and venvs hold other projects').
SOURCE_DIRS = ("api", "core", "infra", "locustfiles", "tests")


def imported_roots(tree: ast.Module) -> set[str]:
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_nothing_outside_bench_imports_bench() -> None:
    """bench/ holds entry points that measure; the product, its harnesses (infra/) and its
    tests import none of them, so a benchmark can change without changing what ships."""
    found = []
    paths = [*ROOT.glob("*.py"), *(p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py"))]
    for path in sorted(paths):
        if "bench" in imported_roots(ast.parse(path.read_text(), str(path))):
            found.append(str(path.relative_to(ROOT)))
    assert found == []
