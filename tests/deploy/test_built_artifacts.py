"""The artifacts as built for Vercel and Lambda, run with Python 3.12 against a real Redis.

Each run is one warm instance: the handler the artifact's own configuration names, loaded from
the artifact alone (python3.12 -S: no site-packages, PYTHONPATH as the platform sets it), sent
the same scenario one invocation after another: health is ok, an admin budget and a key are
made, a reservation of the whole ceiling is admitted and settled, and one more micro-dollar is
refused with 402. Then a few more health checks, and the Redis connections the instance opened
are counted: a warm instance reuses its pool.

The last tests break a copy of the config or of an artifact on purpose (a route that misses the
function, a lua/ script left out, a handler that does not resolve) and show that the checks or
the run fail.
"""

from __future__ import annotations

import json
import shutil
import uuid
import zipfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

from infra import deploy_build
from infra.redis_server import RedisServer
from tests.api.conftest import ADMIN_TOKEN
from tests.deploy.conftest import (
    ROOT,
    connections_received,
    lambda_env,
    run_driver,
    vercel_env,
)

pytestmark = [pytest.mark.deploy, pytest.mark.slow]

# health, budget, key, reserve the whole ceiling, settle it, reserve 1 more, then health x4
EXPECTED_STATUSES = [200, 200, 201, 201, 200, 402, 200, 200, 200, 200]
# The instance's own pool: one connection, and one more if a command ran while it was busy.
CONNECTIONS_NEW_MAX = 2


def new_tag() -> str:
    return f"org:d{uuid.uuid4().hex[:10]}"


def assert_scenario(result: dict[str, Any]) -> None:
    answers = result["answers"]
    assert [status for status, _ in answers] == EXPECTED_STATUSES, answers
    health = answers[0][1]
    assert health["status"] == "ok", health
    assert health["version"] == version("spend-ceiling"), health
    refused = answers[5][1]["error"]
    assert refused["code"] == "budget_exceeded", refused
    assert result["python"] == [3, 12]
    # Nothing came from outside the artifact and the interpreter's own library.
    assert result["modules_outside"] == [], result["modules_outside"]


def test_lambda_package_answers_api_gateway_v2_events(
    artifacts: deploy_build.Artifacts, lambda_root: Path, python312: Path,
    redis_server: RedisServer,
) -> None:
    function = artifacts.lambda_
    assert function is not None
    env = lambda_env(function, lambda_root, redis_server.url, ADMIN_TOKEN)
    before = connections_received(redis_server)
    result = run_driver(python312, "lambda", function.handler, cwd=lambda_root, env=env,
                        tag=new_tag(), admin_token=ADMIN_TOKEN)
    opened = connections_received(redis_server) - before - 1  # -1: the count's own connection
    assert_scenario(result)
    assert Path(result["core"]).parent.parent == lambda_root
    assert Path(result["lua_dir"]) == lambda_root / "lua"
    assert opened <= CONNECTIONS_NEW_MAX, f"{opened} connections for one warm instance"


def test_vercel_function_answers_launcher_events(
    artifacts: deploy_build.Artifacts, python312: Path, redis_server: RedisServer
) -> None:
    function = artifacts.vercel
    assert function is not None
    spec = f"{function.handler_module}.{function.handler_attr}"
    env = vercel_env(function, redis_server.url, ADMIN_TOKEN)
    before = connections_received(redis_server)
    result = run_driver(python312, "vercel-event", spec, cwd=function.func_dir, env=env,
                        tag=new_tag(), admin_token=ADMIN_TOKEN)
    opened = connections_received(redis_server) - before - 1
    assert_scenario(result)
    # The function's own copy of the sources, next to its lua/, not one installed in _vendor.
    assert Path(result["core"]).parent.parent == function.func_dir
    assert Path(result["lua_dir"]) == function.func_dir / "lua"
    assert opened <= CONNECTIONS_NEW_MAX, f"{opened} connections for one warm instance"


def test_vercel_function_serves_over_the_ipc_protocol(
    artifacts: deploy_build.Artifacts, python312: Path, redis_server: RedisServer
) -> None:
    function = artifacts.vercel
    assert function is not None
    env = vercel_env(function, redis_server.url, ADMIN_TOKEN)
    before = connections_received(redis_server)
    result = run_driver(python312, "vercel-ipc", function.handler_module, cwd=function.func_dir,
                        env=env, tag=new_tag(), admin_token=ADMIN_TOKEN)
    opened = connections_received(redis_server) - before - 1
    assert_scenario(result)
    # The launcher reported every request's start and end to the platform, and no crash.
    assert result["ipc_started"] == result["ipc_ended"] == result["requests"], result
    assert result["ipc_errors"] == 0
    assert opened <= CONNECTIONS_NEW_MAX, f"{opened} connections for one warm instance"


def test_nothing_but_the_service_is_shipped(artifacts: deploy_build.Artifacts) -> None:
    assert artifacts.vercel is not None
    assert artifacts.lambda_ is not None
    func_dir = artifacts.vercel.func_dir
    shipped = {p.name for p in func_dir.iterdir()}
    assert shipped >= {"api", "core", "lua", "_vendor"}
    assert not shipped & {"tests", "infra", "bench", "deploy", "README.md", ".env"}
    assert not (func_dir / "api" / "lambda_handler.py").exists()
    # The builder's own pyproject.toml, made from requirements.txt; ours is never uploaded.
    assert 'name = "app"' in (func_dir / "pyproject.toml").read_text()
    # No file of the project is served as it is: the static output is unreachable.
    config = json.loads((artifacts.vercel.output_dir / "config.json").read_text())
    assert config["routes"][0] == {"src": "^/(.*)$", "dest": f"/{deploy_build.VERCEL_FUNCTION}"}
    with zipfile.ZipFile(artifacts.lambda_.zip_path) as archive:
        top = {name.split("/", 1)[0] for name in archive.namelist()}
    assert {"api", "core", "lua", "mangum", "fastapi", "redis"} <= top
    assert not top & {"tests", "infra", "bench", "deploy", "locustfiles", ".ci"}


# ---- broken on purpose -----------------------------------------------------------------------


def staged_vercel_copy(tmp_path: Path) -> Path:
    stage = tmp_path / "vercel"
    deploy_build.stage(ROOT, deploy_build.vercel_upload(ROOT, deploy_build.repo_files(ROOT)),
                       stage)
    return stage


BROKEN_ROUTES = {
    # A typo in the destination: every path misses the function.
    "dest_typo": {"routes": [{"src": "/(.*)", "dest": "/api/indx"}]},
    # `rewrites` apply after the filesystem: lua/, core/ and requirements.txt are served as files.
    "rewrites": {"rewrites": [{"source": "/(.*)", "destination": "/api/index"}]},
}


@pytest.mark.parametrize("broken", sorted(BROKEN_ROUTES))
def test_a_vercel_route_that_misses_the_function_fails_the_check(
    artifacts: deploy_build.Artifacts, tmp_path: Path, broken: str
) -> None:
    stage = staged_vercel_copy(tmp_path)
    config = json.loads((stage / "vercel.json").read_text())
    config.pop("routes")
    config.update(BROKEN_ROUTES[broken])
    (stage / "vercel.json").write_text(json.dumps(config))
    output = deploy_build.vercel_build(stage, deploy_build.ensure_tools(ROOT))
    with pytest.raises(deploy_build.DeployCheckFailed, match="do not reach api/index"):
        deploy_build.check_vercel(output, ROOT)


def broken_lambda_copy(artifacts: deploy_build.Artifacts, tmp_path: Path, *,
                       drop: str | None = None, handler: str | None = None) -> Path:
    """A copy of .serverless/ with a file left out of the zip, or another handler in the
    template: what a bad `package.patterns` or `handler:` in serverless.yml would build."""
    assert artifacts.lambda_ is not None
    source = artifacts.lambda_.serverless_dir
    copy = tmp_path / ".serverless"
    copy.mkdir()
    for template in source.glob("cloudformation-template-*.json"):
        text = template.read_text()
        if handler is not None:
            text = text.replace(json.dumps(artifacts.lambda_.handler), json.dumps(handler))
        (copy / template.name).write_text(text)
    zip_name = artifacts.lambda_.zip_path.name
    with zipfile.ZipFile(source / zip_name) as old, \
            zipfile.ZipFile(copy / zip_name, "w", zipfile.ZIP_DEFLATED) as new:
        for item in old.infolist():
            if item.filename != drop:
                new.writestr(item, old.read(item))
    return copy


def unpacked(serverless_dir: Path, tmp_path: Path) -> Path:
    root = tmp_path / "task"
    with zipfile.ZipFile(serverless_dir / f"{deploy_build.SERVERLESS_SERVICE}.zip") as archive:
        archive.extractall(root)
    return root


def test_a_lua_script_missing_from_the_package_fails_the_check_and_the_run(
    artifacts: deploy_build.Artifacts, tmp_path: Path, python312: Path,
    redis_server: RedisServer,
) -> None:
    broken = broken_lambda_copy(artifacts, tmp_path, drop="lua/settle.lua")
    with pytest.raises(deploy_build.DeployCheckFailed, match=r"lacks lua/settle\.lua"):
        deploy_build.check_lambda(broken, ROOT)
    assert artifacts.lambda_ is not None
    task = unpacked(broken, tmp_path)
    result = run_driver(python312, "lambda", artifacts.lambda_.handler, cwd=task,
                        env=lambda_env(artifacts.lambda_, task, redis_server.url, ADMIN_TOKEN),
                        tag=new_tag(), admin_token=ADMIN_TOKEN)
    statuses = [status for status, _ in result["answers"]]
    assert statuses != EXPECTED_STATUSES
    assert statuses[4] == 500, result["answers"][4]  # the settle: its script is not there


def test_a_lua_script_missing_from_the_vercel_function_fails_the_check(
    artifacts: deploy_build.Artifacts, tmp_path: Path
) -> None:
    assert artifacts.vercel is not None
    output = tmp_path / "output"
    shutil.copytree(artifacts.vercel.output_dir, output, symlinks=True)
    (output / "functions" / "api" / "index.func" / "lua" / "reserve.lua").unlink()
    with pytest.raises(deploy_build.DeployCheckFailed, match=r"lacks lua/reserve\.lua"):
        deploy_build.check_vercel(output, ROOT)


def test_a_handler_module_that_is_not_in_the_package_fails_the_check(
    artifacts: deploy_build.Artifacts, tmp_path: Path
) -> None:
    broken = broken_lambda_copy(artifacts, tmp_path, handler="api/lambda.handler")
    with pytest.raises(deploy_build.DeployCheckFailed, match=r"no api/lambda\.py"):
        deploy_build.check_lambda(broken, ROOT)


def test_a_handler_attribute_that_does_not_resolve_fails_the_run(
    artifacts: deploy_build.Artifacts, tmp_path: Path, python312: Path,
    redis_server: RedisServer,
) -> None:
    broken = broken_lambda_copy(artifacts, tmp_path, handler="api/lambda_handler.handle")
    function = deploy_build.check_lambda(broken, ROOT)  # the module is there...
    assert function.handler == "api/lambda_handler.handle"
    task = unpacked(broken, tmp_path)
    with pytest.raises(AssertionError, match="has no attribute 'handle'"):  # ...its `handle` not
        run_driver(python312, "lambda", function.handler, cwd=task,
                   env=lambda_env(function, task, redis_server.url, ADMIN_TOKEN),
                   tag=new_tag(), admin_token=ADMIN_TOKEN)


def test_the_route_check_reads_the_routing_it_is_given(tmp_path: Path) -> None:
    """resolve_route on a hand-made output: filesystem first serves a file, a route first
    reaches the function, and a route key it does not know fails instead of being guessed."""
    (tmp_path / "functions" / "api" / "index.func").mkdir(parents=True)
    (tmp_path / "static" / "lua").mkdir(parents=True)
    (tmp_path / "static" / "lua" / "reserve.lua").write_text("-- script")
    rewrite = {"src": "^(?:/(.*))$", "dest": "/api/index", "check": True}
    files_first = {"routes": [{"handle": "filesystem"}, rewrite]}
    assert deploy_build.resolve_route(files_first, tmp_path, "/lua/reserve.lua") == (
        "static", "lua/reserve.lua")
    assert deploy_build.resolve_route(files_first, tmp_path, "/health") == ("function", "api/index")
    route_first = {"routes": [{"src": "^/(.*)$", "dest": "/api/index"}, {"handle": "filesystem"}]}
    assert deploy_build.resolve_route(route_first, tmp_path, "/lua/reserve.lua") == (
        "function", "api/index")
    with pytest.raises(deploy_build.DeployCheckFailed, match="extend resolve_route"):
        deploy_build.resolve_route({"routes": [{"src": "/(.*)", "has": []}]}, tmp_path, "/")
