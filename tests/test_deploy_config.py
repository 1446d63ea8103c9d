"""The deployment files describe the app as it is."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_requirements_txt_matches_pyproject() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = [line.strip() for line in (ROOT / "requirements.txt").read_text().splitlines()]
    assert [x for x in lines if x and not x.startswith("#")] == project["dependencies"]


def test_vercel_routes_everything_to_the_entry_and_ships_the_scripts() -> None:
    config = json.loads((ROOT / "vercel.json").read_text())
    (entry,) = config["functions"]
    assert (ROOT / entry).exists()
    assert "lua" in config["functions"][entry]["includeFiles"]
    # `routes`, not `rewrites`: rewrites apply after the filesystem, so any uploaded file (lua/,
    # core/, requirements.txt) would be served as it is before the app saw the path.
    assert config["routes"] == [{"src": "/(.*)", "dest": "/api/index"}]
    assert "rewrites" not in config


def test_serverless_handler_resolves_and_the_package_has_the_scripts() -> None:
    text = (ROOT / "serverless.yml").read_text()
    handler = next(x.split(":", 1)[1].strip() for x in text.splitlines()
                   if x.strip().startswith("handler:"))
    module, _, attr = handler.rpartition(".")
    assert (ROOT / f"{module}.py").exists()
    assert f"{attr} = " in (ROOT / f"{module}.py").read_text()
    assert '- "lua/**"' in text
