"""Every code reference in the README and docs/ names something that exists: the files they name,
the names they give beside a file, the environment variables and the modules they run. A doc
that outlives a rename fails here, not in a reader's hands."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "lua" / "README.md"]
# A file named in backticks: a path below the repository's top level.
FILE = re.compile(r"`((?:api|core|lua|infra|tests|bench|locustfiles|deploy|docs|\.ci)/"
                  r"[\w./-]+\.(?:py|lua|sh|json|md|toml|yml|yaml|png|txt))`")
# A name given beside a file: `core/prices/table.py` `NAME` (or `NAME(...)`).
NAMED = re.compile(r"`([\w/.-]+\.(?:py|lua))`\s+`([A-Za-z_][\w.]*)")
ENV = re.compile(r"`((?:CEILING|UPSTASH|KV|REDIS)_[A-Z0-9_]+)`")
MODULE = re.compile(r"python -m ((?:bench|infra|api|core)(?:\.\w+)+)")
SOURCES = [*ROOT.glob("api/**/*.py"), *ROOT.glob("core/**/*.py"), *ROOT.glob("infra/**/*.py"),
           *ROOT.glob("lua/*.lua"), ROOT / "serverless.yml", ROOT / "vercel.json",
           *ROOT.glob("infra/*.sh")]


def text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_files_and_names_a_doc_gives_exist(doc: Path) -> None:
    body = text(doc)
    missing = [f for f in FILE.findall(body) if not (ROOT / f).exists()]
    assert not missing, f"{doc.name} names files that do not exist: {missing}"
    unnamed = []
    for file, name in NAMED.findall(body):
        path = ROOT / file
        if path.exists() and name.split(".")[0] not in text(path):
            unnamed.append(f"{file} {name}")
    assert not unnamed, f"{doc.name} names what its file does not have: {unnamed}"
    modules = [m for m in MODULE.findall(body)
               if not (ROOT / (m.replace(".", "/") + ".py")).exists()
               and not (ROOT / m.replace(".", "/") / "__main__.py").exists()]
    assert not modules, f"{doc.name} runs modules that do not exist: {modules}"


def test_every_environment_variable_a_doc_names_is_read() -> None:
    code = "\n".join(text(p) for p in SOURCES if p.exists())
    named = {v for doc in DOCS for v in ENV.findall(text(doc))}
    unread = sorted(v for v in named if v not in code)
    assert not unread, f"the docs name variables no code reads: {unread}"


def test_no_doc_or_source_cites_an_issue_or_a_file_outside_the_repository() -> None:
    cited = re.compile(r"CONTRACT\.md|\b[Ii]ssues? \d+\b|\(issue \d+")
    places = [*DOCS, *ROOT.glob("api/**/*.py"), *ROOT.glob("core/**/*.py"),
              *ROOT.glob("lua/*.lua")]
    found = [f"{p.relative_to(ROOT)}:{i}" for p in places
             for i, line in enumerate(text(p).splitlines(), 1) if cited.search(line)]
    assert not found, f"cites an issue or CONTRACT.md: {found}"
