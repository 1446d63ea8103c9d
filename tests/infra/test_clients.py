"""The clients' cache: one `npm ci` per lockfile, whoever asks and however many at once.

A fake `npm` on PATH stands in for the registry: it counts its runs and takes a moment, so two
workers that ask together would both run it unless the entry's lock holds one back.
"""

from __future__ import annotations

import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from infra import clients

# Long enough that a second worker asks while the first is still installing.
FAKE_NPM_CI_S = 0.5
WORKERS = 4

FAKE_NPM = f"""#!/bin/sh
echo run >> "$FAKE_NPM_RUNS"
sleep {FAKE_NPM_CI_S}
mkdir -p node_modules/.bin
"""


@pytest.fixture
def fake_npm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    npm = bin_dir / "npm"
    npm.write_text(FAKE_NPM)
    npm.chmod(npm.stat().st_mode | stat.S_IXUSR)
    runs = tmp_path / "npm-runs"
    monkeypatch.setenv("FAKE_NPM_RUNS", str(runs))
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("SC_CLIENTS_CACHE", str(tmp_path / "cache"))
    return runs


def test_workers_asking_at_once_share_one_install(fake_npm: Path, tmp_path: Path) -> None:
    with ThreadPoolExecutor(WORKERS) as pool:
        found = set(pool.map(lambda _: clients.ensure_js_clients(), range(WORKERS)))
    [node_modules] = found
    assert node_modules.parent.parent == tmp_path / "cache"
    assert node_modules.parent.name.startswith("clients-js-")
    assert fake_npm.read_text().splitlines() == ["run"]
    assert clients.ensure_js_clients() == node_modules
    assert fake_npm.read_text().splitlines() == ["run"]


def test_an_unfinished_install_is_redone(fake_npm: Path) -> None:
    node_modules = clients.ensure_js_clients()
    (node_modules.parent / ".complete").unlink()
    assert clients.ensure_js_clients() == node_modules
    assert fake_npm.read_text().splitlines() == ["run", "run"]


def test_the_scripts_run_beside_the_cached_modules(tmp_path: Path) -> None:
    modules = tmp_path / "node_modules"
    modules.mkdir()
    staged = clients.stage_scripts(modules, tmp_path / "staged")
    assert (staged / "ai_sdk.mjs").read_text() == (clients.JS_DIR / "ai_sdk.mjs").read_text()
    assert (staged / "node_modules").resolve() == modules
