"""The deploy artifacts, built once per session as the platforms build them, and a way to run them.

The build (infra/deploy_build.py) is redone only when its inputs changed, so a second session
costs seconds. A missing Python 3.12, Node.js or registry is an error here, not a skip: CI must
not pass without having run the artifacts.
"""

from __future__ import annotations

import json
import os
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import pytest

from infra import deploy_build
from infra.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]
DRIVER = (Path(__file__).parent / "driver.py").read_text()
# One warm instance answers the whole scenario in a few seconds; a minute is a hang.
DRIVER_TIMEOUT_S = 120


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "deploy: builds the Vercel output and the Lambda package, and runs them"
    )


@pytest.fixture(scope="session")
def python312() -> Path:
    return deploy_build.find_python312()


@pytest.fixture(scope="session")
def artifacts() -> deploy_build.Artifacts:
    return deploy_build.build(ROOT, log=True)


@pytest.fixture(scope="session")
def lambda_root(artifacts: deploy_build.Artifacts, tmp_path_factory: pytest.TempPathFactory
                ) -> Path:
    """The Lambda zip unpacked, as /var/task holds it."""
    assert artifacts.lambda_ is not None
    root = tmp_path_factory.mktemp("lambda-task")
    with zipfile.ZipFile(artifacts.lambda_.zip_path) as archive:
        archive.extractall(root)
    return root


def base_env() -> dict[str, str]:
    """What any process gets: no PYTHON*, no virtualenv, nothing of this test session's."""
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "SYSTEMROOT")
    return {k: os.environ[k] for k in keep if k in os.environ}


def lambda_env(function: deploy_build.LambdaFunction, task_root: Path, redis_url: str,
               admin_token: str) -> dict[str, str]:
    """The function's environment from its template, the service's settings, and what AWS's
    python3.12 runtime sets."""
    return {
        **base_env(),
        **function.environment,
        "REDIS_URL": redis_url,
        "CEILING_ADMIN_TOKEN": admin_token,
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EXECUTION_ENV": "AWS_Lambda_python3.12",
        "AWS_LAMBDA_FUNCTION_NAME": "spend-ceiling-dev-api",
        "AWS_LAMBDA_FUNCTION_MEMORY_SIZE": "512",
        "AWS_LAMBDA_FUNCTION_VERSION": "$LATEST",
        "LAMBDA_TASK_ROOT": str(task_root),
        "_HANDLER": function.handler,
        "TZ": ":UTC",
        "PYTHONPATH": str(task_root),
        # /var/task is read-only: no bytecode is written there.
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def vercel_env(function: deploy_build.VercelFunction, redis_url: str, admin_token: str
               ) -> dict[str, str]:
    """The function's .vc-config.json environment (PYTHONPATH=_vendor), the service's settings,
    and what Vercel sets."""
    return {
        **base_env(),
        "VERCEL": "1",
        "VERCEL_ENV": "preview",
        "VERCEL_REGION": "iad1",
        "AWS_REGION": "us-east-1",
        "AWS_LAMBDA_FUNCTION_NAME": "spend-ceiling-api-index",
        "LAMBDA_TASK_ROOT": str(function.func_dir),
        "REDIS_URL": redis_url,
        "CEILING_ADMIN_TOKEN": admin_token,
        **function.environment,
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def run_driver(python312: Path, mode: str, spec: str, *, cwd: Path, env: dict[str, str],
               tag: str, admin_token: str) -> dict[str, Any]:
    """tests/deploy/driver.py in a Python 3.12 process (no site-packages: -S) in the artifact."""
    done = subprocess.run(
        [str(python312), "-S", "-c", DRIVER, mode, spec, tag, admin_token], cwd=cwd, env=env,
        capture_output=True, text=True, timeout=DRIVER_TIMEOUT_S, check=False,
    )
    if done.returncode != 0:
        raise AssertionError(f"the {mode} driver exited with {done.returncode}:\n"
                             f"{done.stderr[-4000:]}\n{done.stdout[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    result["stderr"] = done.stderr
    return result


def connections_received(redis_server: RedisServer) -> int:
    import redis

    client = redis.Redis.from_url(redis_server.url)
    try:
        return int(client.info("stats")["total_connections_received"])
    finally:
        client.close()
