"""The wheel as a team installs it, run outside the checkout against a real Redis.

The wheel is built from what git would commit (as `pip install git+<repo>` builds it), installed
into a new venv in a temporary directory, and its `ceiling serve` is started there, with nothing
of the checkout on its path: the admin API makes a budget and a key, and a reservation is
admitted with 201. A module left out of the wheel fails the start; the scripts left out fail the
reservation.

The runtime dependencies come from the package index pip uses here, once: they are installed
into a venv in a cache outside the checkout, keyed on the wheel's own Requires-Dist and the
interpreter, and each run's new venv sees them through a .pth file. The wheel itself, built
fresh each run, is installed into the new venv alone.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
import zipfile
from collections.abc import Iterator
from email.parser import Parser
from pathlib import Path
from typing import Any

import httpx
import pytest

from core import __version__
from infra import deploy_build
from infra.processes import free_port, stop, wait_ready
from infra.redis_server import RedisServer
from tests.api.conftest import ADMIN_TOKEN

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
# The product the wheel carries: every file git tracks under these directories, nothing else.
PRODUCT_DIRS = ("api", "core", "lua")
# Building the wheel, or installing the dependencies the first time, ends long before this;
# past it, pip is hanging.
PIP_TIMEOUT_S = 600
# `ceiling serve` imports FastAPI and answers /health/live within seconds; 30 s is broken.
SERVE_START_TIMEOUT_S = 30.0
CLI_TIMEOUT_S = 60
# What any process of the installed wheel gets from this one's environment: no PYTHONPATH, no
# VIRTUAL_ENV, no CEILING_* or REDIS_* of the test session.
ENV_KEPT = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")


def wheel_cache_dir() -> Path:
    if explicit := os.environ.get("SC_WHEEL_CACHE"):
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "spend-ceiling" / "wheel"


def pip(*args: str | Path, what: str) -> str:
    """This interpreter's pip, with the configuration (index, constraints) it has here."""
    return deploy_build.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                            cwd=ROOT, timeout_s=PIP_TIMEOUT_S, what=what)


def site_packages(venv: Path) -> Path:
    found = subprocess.run(
        [venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, timeout=CLI_TIMEOUT_S, check=True,
    )
    return Path(found.stdout.strip())


def requires_dist(wheel: Path) -> list[str]:
    """The wheel's runtime requirements, from its own METADATA (no extras)."""
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(archive.read(name).decode())
    return sorted(r for r in metadata.get_all("Requires-Dist") or [] if "extra ==" not in r)


def dependencies_venv(requirements: list[str]) -> Path:
    """A venv holding the wheel's runtime dependencies and nothing of spend-ceiling, installed
    once per set of requirements and interpreter."""
    interpreter = f"{sys.version} {sys.base_prefix}"
    key = deploy_build.digest([interpreter.encode(), *(r.encode() for r in requirements)])
    home = wheel_cache_dir() / f"deps-{key}"
    venv = home / "venv"
    with deploy_build.locked(home.with_suffix(".lock")):
        if not (home / ".complete").exists():
            shutil.rmtree(home, ignore_errors=True)
            home.mkdir(parents=True)
            deploy_build.run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=home,
                             timeout_s=PIP_TIMEOUT_S, what="python -m venv (dependencies)")
            pip("--python", venv / "bin" / "python", "install", "-q", *requirements,
                what="pip install (the wheel's dependencies)")
            (home / ".complete").touch()
    deploy_build.used(home)
    return venv


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from a copy of what git would commit (no stale build/ in the tree)."""
    work = tmp_path_factory.mktemp("wheel-build")
    deploy_build.stage(ROOT, deploy_build.repo_files(ROOT), work / "src")
    pip("wheel", "-q", "--no-deps", "--wheel-dir", work / "dist", work / "src",
        what="pip wheel")
    (built,) = (work / "dist").glob("spend_ceiling-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new venv outside the checkout with the wheel installed, its dependencies layered in."""
    deps = dependencies_venv(requires_dist(wheel))
    venv = tmp_path_factory.mktemp("wheel-venv") / "venv"
    deploy_build.run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=venv.parent,
                     timeout_s=PIP_TIMEOUT_S, what="python -m venv")
    (site_packages(venv) / "spend_ceiling_test_dependencies.pth").write_text(
        f"{site_packages(deps)}\n")
    python = venv / "bin" / "python"
    pip("--python", python, "install", "-q", "--no-deps", "--no-index", wheel,
        what="pip install (the wheel)")
    # The layered dependencies satisfy every requirement the wheel declares.
    pip("--python", python, "check", what="pip check")
    return venv


def clean_env(**extra: str) -> dict[str, str]:
    return {**{k: os.environ[k] for k in ENV_KEPT if k in os.environ}, **extra}


def test_the_wheel_carries_every_product_file_and_nothing_else(wheel: Path) -> None:
    tracked = {f for f in deploy_build.repo_files(ROOT) if f.split("/", 1)[0] in PRODUCT_DIRS}
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = next(archive.read(n).decode() for n in names
                            if n.endswith(".dist-info/entry_points.txt"))
    shipped = {n for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert sorted(tracked - shipped) == [], "left out of the wheel"
    assert sorted(shipped - tracked) == [], "in the wheel but not the product"
    assert wheel.name == f"spend_ceiling-{__version__}-py3-none-any.whl"
    assert "ceiling = api.cli:main" in entry_points


def test_the_installed_wheel_imports_from_its_venv(venv: Path, tmp_path: Path) -> None:
    probe = (
        "import json, importlib.resources, api.cli, api.index, core.stores.scripts as s\n"
        "s.script('reserve')\n"
        "print(json.dumps({'api': api.cli.__file__, 'core': s.__file__,"
        " 'lua': str(importlib.resources.files('lua'))}))\n"
    )
    done = subprocess.run([venv / "bin" / "python", "-c", probe], cwd=tmp_path, env=clean_env(),
                          capture_output=True, text=True, timeout=CLI_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr
    where = json.loads(done.stdout)
    installed = site_packages(venv)
    assert Path(where["api"]) == installed / "api" / "cli.py"
    assert Path(where["core"]) == installed / "core" / "stores" / "scripts.py"
    assert Path(where["lua"]) == installed / "lua"


@pytest.fixture
def served(venv: Path, redis_server: RedisServer, tmp_path: Path) -> Iterator[str]:
    """`ceiling serve` of the installed wheel, run from a directory outside the checkout."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    env = clean_env(REDIS_URL=redis_server.url, CEILING_ADMIN_TOKEN=ADMIN_TOKEN)
    with log.open("wb") as out:
        process = subprocess.Popen(
            [venv / "bin" / "ceiling", "serve", "--host", "127.0.0.1", "--port", str(port)],
            cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        with httpx.Client(timeout=1.0) as client:

            def live() -> bool:
                try:
                    return client.get(f"{url}/health/live").status_code == 200
                except httpx.HTTPError:
                    return False

            try:
                wait_ready(process, live, timeout_s=SERVE_START_TIMEOUT_S,
                           what=f"the wheel's ceiling serve on port {port}")
            except RuntimeError as exc:
                raise AssertionError(f"{exc}:\n{log.read_text()[-4000:]}") from exc
        yield url
    finally:
        if process.poll() is None:  # not reaped already: its pid is still this process's
            stop(process)  # by pid: the process this fixture started


def key_body(client: httpx.Client, budget_id: str) -> dict[str, Any]:
    """A key that may reserve: with the sidecar role where the server has roles, as the
    server's own schema of the key body says."""
    schema = client.get("/openapi.json").json()
    ref = schema["paths"]["/v1/admin/keys"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]["$ref"]
    fields = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"]
    return {"budget_id": budget_id, **({"roles": ["sidecar"]} if "roles" in fields else {})}


def test_the_installed_ceiling_serves_a_reservation(
    venv: Path, served: str, redis_server: RedisServer, tmp_path: Path
) -> None:
    budget_id = f"org:w{uuid.uuid4().hex[:10]}"
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    with httpx.Client(base_url=served, timeout=10.0) as client:
        made = client.put(f"/v1/admin/budgets/{budget_id}", headers=admin, json={
            "limits": [{"period": "total", "ceiling_micros": 1_000_000}]})
        assert made.status_code == 200, made.text
        key = client.post("/v1/admin/keys", headers=admin, json=key_body(client, budget_id))
        assert key.status_code == 201, key.text
        reserved = client.post(
            "/v1/reservations", json={"amount_micros": 250_000},
            headers={"Authorization": f"Bearer {key.json()['api_key']}"},
        )
        assert reserved.status_code == 201, reserved.text
    # The wheel's own CLI reads the ledger the scripts wrote: the reservation holds its amount.
    shown = subprocess.run(
        [venv / "bin" / "ceiling", "budgets", "show", budget_id], cwd=tmp_path,
        env=clean_env(REDIS_URL=redis_server.url), capture_output=True, text=True,
        timeout=CLI_TIMEOUT_S, check=False,
    )
    assert shown.returncode == 0, shown.stderr
    (leg,) = json.loads(shown.stdout)["periods"]
    assert (leg["reserved_micros"], leg["remaining_micros"]) == (250_000, 750_000)
