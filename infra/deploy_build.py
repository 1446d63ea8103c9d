"""Build the Vercel output and the Lambda package locally, as the platforms build them; check them.

    python3 -m infra.deploy_build                  # both; prints where the artifacts are
    python3 -m infra.deploy_build --only lambda    # or --only vercel

What it guarantees:
- The work tree is never written to. `vercel build` writes pyproject.toml, uv.lock and
  .python-version next to the sources and `serverless package` writes .serverless/, so each
  build runs in a staging copy under `.run/deploy/` (gitignored) of the files git would commit
  (tracked, plus untracked files that are not ignored): a dirty tree is built as it stands, and
  a clean clone builds the same thing as CI.
- The Vercel staging copy holds only what `vercel deploy` uploads (.vercelignore applied), so the
  builder sees what it sees on Vercel. Built in the work tree it would find pyproject.toml, which
  is never uploaded, and build something Vercel never would.
- The tooling is pinned: the CLIs by deploy/package-lock.json (`npm ci`), uv and cfn-lint by
  TOOL_PINS. Each pin set is installed once into a cache outside the clone
  (SC_DEPLOY_CACHE, default ~/.cache/spend-ceiling/deploy), because `npm ci` alone is the
  slowest step of a build and CI starts from a fresh clone every run.
- A build whose inputs (staged files, pins) have not changed is not redone.
- No network but the package registries: `vercel build` runs against a placeholder project
  (.vercel/project.json written into the staging copy), `serverless package` needs no AWS
  account or credentials (AWS_* is removed from its environment).
- Both builds use Python 3.12, which both platforms run: a python3.12 on PATH, or pyenv's, or
  SC_PYTHON312.

After building, `check_vercel` and `check_lambda` read the artifacts back: routes reach the
function and serve no file, the handler is where the config says, every lua/ script is inside,
and nothing from tests/, infra/ or bench/ is. tests/deploy/ runs the artifacts themselves.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON_VERSION = (3, 12)
PYTHON_RUNTIME = "python3.12"
# uv: the Vercel Python builder installs with it; cfn-lint: lints the CloudFormation templates.
TOOL_PINS = ("uv==0.13.9", "cfn-lint==1.58.0")
# Findings in what serverless v3 generates that we cannot change from serverless.yml.
CFN_LINT_IGNORED = {
    "W3005": "serverless v3's HTTP API route both Refs its integration and DependsOn it",
}
# Local placeholder ids: `vercel build` reads the project settings from here instead of asking
# Vercel's API. Written into the staging copy only: committed at the root, it would link real
# `vercel deploy` runs to a project that does not exist.
VERCEL_PROJECT = {
    "projectId": "prj_spendceilinglocalbuild0000",
    "orgId": "team_spendceilinglocalbuild000",
    "settings": {
        "framework": None,
        "devCommand": None,
        "installCommand": None,
        "buildCommand": None,
        "outputDirectory": None,
        "rootDirectory": None,
        "nodeVersion": "20.x",
    },
}
SERVERLESS_SERVICE = "spend-ceiling"
# Top-level names that must never be shipped: they are not the service.
NEVER_SHIPPED = (".ci", ".env", "bench", "deploy", "infra", "locustfiles", "node_modules", "tests")
# Paths that must all reach the function and none a static file: the app answers every path,
# including its own 404s, and no file of the project is ever served as it is.
ROUTE_PROBES = (
    "/", "/health", "/health/live", "/v1/reservations", "/v1/admin/budgets/org:acme",
    "/v1/chat/completions", "/.env", "/lua/reserve.lua", "/core/money.py", "/requirements.txt",
    "/pyproject.toml", "/tests/conftest.py", "/api/index", "/api/index.py",
    "/api/lambda_handler", "/README.md",
)
VERCEL_FUNCTION = "api/index"

# Far above what a clean `npm ci` and each build take on a slow machine; past these, something
# is hanging.
NPM_CI_TIMEOUT_S = 1200
PIP_TIMEOUT_S = 600
# A cache entry (one lockfile's whole node_modules) unused this long is deleted.
CACHE_UNUSED_S_MAX = 7 * 24 * 3600
BUILD_TIMEOUT_S = 900
LINT_TIMEOUT_S = 300
OUTPUT_TAIL_CHARS = 6000


class DeployBuildError(Exception):
    """A build could not run or did not produce what the platform would deploy; says why."""


class DeployCheckFailed(DeployBuildError):
    """An artifact was built, but it is not what it must be (a route, a file, the handler)."""


@dataclass(frozen=True)
class Tools:
    python312: Path
    bin_dir: Path  # only python3.12 and uv: what the builders look up on PATH
    node_bin: Path  # node_modules/.bin of the pinned CLIs
    cfn_lint: Path  # in a 3.12 venv of TOOL_PINS

    def env(self, base: Mapping[str, str]) -> dict[str, str]:
        path = os.pathsep.join([str(self.bin_dir), base.get("PATH", os.defpath)])
        return {**base, "PATH": path}


@dataclass(frozen=True)
class VercelFunction:
    output_dir: Path
    func_dir: Path
    handler_module: str
    handler_attr: str
    environment: dict[str, str]
    runtime: str


@dataclass(frozen=True)
class LambdaFunction:
    serverless_dir: Path
    zip_path: Path
    handler: str
    runtime: str
    environment: dict[str, str]


@dataclass(frozen=True)
class Artifacts:
    vercel: VercelFunction | None
    lambda_: LambdaFunction | None
    seconds: dict[str, float]


# ---- running tools ---------------------------------------------------------------------------


def run(args: Sequence[str | Path], *, cwd: Path, env: Mapping[str, str] | None = None,
        timeout_s: float, what: str) -> str:
    """Run a tool; its output comes back, or a DeployBuildError with the tail of it."""
    try:
        done = subprocess.run(
            [str(a) for a in args], cwd=cwd, env=dict(env) if env is not None else None,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, timeout=timeout_s, check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise DeployBuildError(f"{what}: no result after {timeout_s:.0f} s") from exc
    except FileNotFoundError as exc:
        raise DeployBuildError(f"{what}: {args[0]} not found") from exc
    if done.returncode != 0:
        raise DeployBuildError(
            f"{what} exited with {done.returncode}:\n{done.stdout[-OUTPUT_TAIL_CHARS:]}"
        )
    return done.stdout


def cache_dir() -> Path:
    if explicit := os.environ.get("SC_DEPLOY_CACHE"):
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "spend-ceiling" / "deploy"


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path`, so two builds never fill one cache entry at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def used(entry: Path) -> Path:
    """Mark a cache entry as used now, and delete its siblings that have not been for a week."""
    prefix = entry.name.rsplit("-", 1)[0] + "-"
    now = time.time()
    with contextlib.suppress(FileNotFoundError):
        os.utime(entry)
    for other in entry.parent.glob(f"{prefix}*"):
        if other.is_dir() and other != entry and now - other.stat().st_mtime > CACHE_UNUSED_S_MAX:
            shutil.rmtree(other, ignore_errors=True)
            other.with_suffix(".lock").unlink(missing_ok=True)
    return entry


def filled_once(home: Path, fill: Callable[[Path], None]) -> Path:
    """The cache entry `home`, filled by `fill(home)` unless an earlier fill finished, and
    marked used (`used`). Only a finished fill leaves `.complete`: what a fill cut short left
    is deleted and filled again. Locked, so two processes never fill one entry at once."""
    with locked(home.with_suffix(".lock")):
        if not (home / ".complete").exists():
            shutil.rmtree(home, ignore_errors=True)
            home.mkdir(parents=True)
            fill(home)
            (home / ".complete").touch()
    return used(home)


def npm_installed(cache: Path, prefix: str, package_dir: Path,
                  npm_ci: Callable[[Path], None]) -> Path:
    """The node_modules of `package_dir`'s package.json and package-lock.json, installed by
    `npm_ci` (run in the entry) once per pair of files, in an entry of `cache` named `prefix`
    and their digest."""
    manifest = (package_dir / "package.json").read_bytes()
    lock = (package_dir / "package-lock.json").read_bytes()

    def fill(home: Path) -> None:
        (home / "package.json").write_bytes(manifest)
        (home / "package-lock.json").write_bytes(lock)
        npm_ci(home)

    return filled_once(cache / f"{prefix}-{digest([manifest, lock])}", fill) / "node_modules"


def digest(parts: Iterable[bytes]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return h.hexdigest()[:16]


def find_python312() -> Path:
    """A Python 3.12 interpreter: SC_PYTHON312, python3.12 on PATH, or pyenv's."""
    candidates = [os.environ.get("SC_PYTHON312", ""), shutil.which("python3.12") or ""]
    pyenv_root = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    candidates += sorted(glob.glob(f"{pyenv_root}/versions/3.12.*/bin/python3.12"), reverse=True)
    for candidate in filter(None, candidates):
        probe = subprocess.run(
            [candidate, "-c", "import sys; print(sys.version_info[:2] == (3, 12), sys.executable)"],
            capture_output=True, text=True, check=False, timeout=30,
        )
        ok, _, executable = probe.stdout.strip().partition(" ")
        if probe.returncode == 0 and ok == "True":
            return Path(executable)
    raise DeployBuildError(
        "Python 3.12 is required to build the deploy artifacts (both platforms run 3.12): put "
        "python3.12 on PATH, install it with pyenv, or set SC_PYTHON312"
    )


def ensure_node_tools(root: Path) -> Path:
    """The pinned CLIs of deploy/package-lock.json, installed once per lockfile (npm ci)."""
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            raise DeployBuildError(f"{tool} is required (Node.js 20): apt-get install nodejs npm")

    def npm_ci(home: Path) -> None:
        run(["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=home,
            timeout_s=NPM_CI_TIMEOUT_S, what="npm ci (deploy tooling)")

    return npm_installed(cache_dir(), "npm", root / "deploy", npm_ci) / ".bin"


def ensure_tools(root: Path) -> Tools:
    python312 = find_python312()
    node_bin = ensure_node_tools(root)
    home = cache_dir() / f"tools-{digest([str(python312).encode(), *map(str.encode, TOOL_PINS)])}"
    venv = home / "venv"
    with locked(home.with_suffix(".lock")):
        if not (home / ".complete").exists():
            shutil.rmtree(home, ignore_errors=True)
            run([python312, "-m", "venv", venv], cwd=root, timeout_s=PIP_TIMEOUT_S,
                what="python3.12 -m venv (deploy tools)")
            run([venv / "bin" / "python", "-m", "pip", "install", "-q",
                 "--disable-pip-version-check", *TOOL_PINS],
                cwd=root, timeout_s=PIP_TIMEOUT_S, what="pip install " + " ".join(TOOL_PINS))
            bin_dir = home / "bin"
            bin_dir.mkdir()
            (bin_dir / "uv").symlink_to(venv / "bin" / "uv")
            (bin_dir / "python3.12").symlink_to(python312)
            (home / ".complete").touch()
    used(home)
    return Tools(python312=python312, bin_dir=home / "bin", node_bin=node_bin,
                 cfn_lint=venv / "bin" / "cfn-lint")


# ---- staging ---------------------------------------------------------------------------------


def repo_files(root: Path) -> list[str]:
    """What git would commit: tracked files and untracked ones that are not ignored."""
    out = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
              timeout_s=60, what="git ls-files")
    return sorted({f for f in out.split("\0") if f and (root / f).is_file()})


def vercel_upload(root: Path, files: Sequence[str]) -> list[str]:
    """The files `vercel deploy` uploads: .vercelignore applied, as gitignore patterns.

    git evaluates the patterns (negations and directory rules included); a file is kept when no
    pattern matches it or the last match is a negation (`!`).
    """
    ignore = root / ".vercelignore"
    if not ignore.is_file():
        raise DeployBuildError(".vercelignore is missing: every file would be uploaded and served")
    done = subprocess.run(
        ["git", "-c", f"core.excludesFile={ignore}", "check-ignore", "--no-index", "--stdin",
         "-z", "-v", "-n"],
        cwd=root, input="\0".join(files).encode(), capture_output=True, timeout=60, check=False,
    )
    if done.returncode not in (0, 1):
        raise DeployBuildError(f"git check-ignore failed: {done.stderr.decode()[-2000:]}")
    fields = done.stdout.split(b"\0")
    kept = []
    for i in range(0, len(fields) - 3, 4):
        pattern, path = fields[i + 2].decode(), fields[i + 3].decode()
        if pattern == "" or pattern.startswith("!"):
            kept.append(path)
    return sorted(kept)


def stage(root: Path, files: Sequence[str], dest: Path) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    for name in files:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, target)


def inputs_digest(root: Path, files: Sequence[str], *extra: str) -> str:
    parts = [x.encode() for x in extra]
    for name in files:
        parts += [name.encode(), (root / name).read_bytes()]
    return digest(parts)


def tool_env(tools: Tools) -> dict[str, str]:
    """The builders' environment: no AWS account, no telemetry, no interpreter downloads."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("AWS_", "VERCEL_", "SLS_", "SERVERLESS_", "PYTHON", "VIRTUAL_ENV",
                                 "UV_"))}
    return tools.env({
        **base,
        "VERCEL_TELEMETRY_DISABLED": "1",
        "SLS_TELEMETRY_DISABLED": "1",
        "SLS_NOTIFICATIONS_MODE": "off",
        "UV_PYTHON_DOWNLOADS": "never",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    })


# ---- the builds ------------------------------------------------------------------------------


def vercel_build(stage_dir: Path, tools: Tools) -> Path:
    """`vercel build --standalone` in a staged project; the Build Output API directory."""
    (stage_dir / ".vercel").mkdir(parents=True, exist_ok=True)
    (stage_dir / ".vercel" / "project.json").write_text(json.dumps(VERCEL_PROJECT, indent=2))
    shutil.rmtree(stage_dir / ".vercel" / "output", ignore_errors=True)
    run([tools.node_bin / "vercel", "build", "--standalone", "--yes",
         "--global-config", stage_dir / ".vercel" / "global"],
        cwd=stage_dir, env=tool_env(tools), timeout_s=BUILD_TIMEOUT_S, what="vercel build")
    output = stage_dir / ".vercel" / "output"
    if not (output / "config.json").is_file():
        # The CLI exits 0 having built nothing when it has no project settings.
        raise DeployBuildError(f"vercel build wrote no {output / 'config.json'}")
    return output


def serverless_package(stage_dir: Path, tools: Tools) -> Path:
    """`serverless package` in a staged project, then cfn-lint on its templates."""
    shutil.rmtree(stage_dir / ".serverless", ignore_errors=True)
    # serverless-python-requirements keys its cache on requirements.txt alone: a change to the
    # pip arguments or slim patterns in serverless.yml would reuse a stale install.
    requirements_cache = cache_dir() / (
        f"requirements-{digest([(stage_dir / 'serverless.yml').read_bytes()])}"
    )
    requirements_cache.mkdir(parents=True, exist_ok=True)
    env = {**tool_env(tools), "SC_PYTHON_REQUIREMENTS_CACHE": str(used(requirements_cache))}
    run([tools.node_bin / "serverless", "package"], cwd=stage_dir, env=env,
        timeout_s=BUILD_TIMEOUT_S, what="serverless package")
    out = stage_dir / ".serverless"
    templates = sorted(out.glob("cloudformation-template-*.json"))
    if not (out / f"{SERVERLESS_SERVICE}.zip").is_file() or len(templates) != 2:
        raise DeployBuildError(f"serverless package did not write the zip and two templates: {out}")
    cfn_lint(templates, tools)
    return out


def cfn_lint(templates: Sequence[Path], tools: Tools) -> None:
    run([tools.cfn_lint, "--ignore-checks", *CFN_LINT_IGNORED, "--",
         *templates], cwd=templates[0].parent, env=tool_env(tools), timeout_s=LINT_TIMEOUT_S,
        what="cfn-lint")


def build(root: Path = ROOT, *, out: Path | None = None, vercel: bool = True,
          lambda_: bool = True, log: bool = False) -> Artifacts:
    """Both artifacts (or those asked for), rebuilt only when their inputs changed; checked."""
    out = out or root / ".run" / "deploy"
    started = time.monotonic()
    tools = ensure_tools(root)
    seconds: dict[str, float] = {"tools": time.monotonic() - started}
    files = repo_files(root)
    pins = [*TOOL_PINS, (root / "deploy" / "package-lock.json").read_text(), str(tools.python312)]
    built_vercel = built_lambda = None
    if vercel:
        upload = vercel_upload(root, files)
        stamp = out / "vercel.built"
        key = inputs_digest(root, upload, *pins)
        output = out / "vercel" / ".vercel" / "output"
        started = time.monotonic()
        if not (stamp.is_file() and stamp.read_text() == key and output.is_dir()):
            stamp.unlink(missing_ok=True)
            stage(root, upload, out / "vercel")
            vercel_build(out / "vercel", tools)
            stamp.write_text(key)
        seconds["vercel"] = time.monotonic() - started
        built_vercel = check_vercel(output, root)
    if lambda_:
        # Never-shipped directories stay out of the staging copy, so that editing a test does not
        # rebuild the package; a pattern in serverless.yml that reached for them would fail
        # check_lambda anyway.
        packable = [f for f in files if f.split("/", 1)[0] not in NEVER_SHIPPED]
        stamp = out / "lambda.built"
        key = inputs_digest(root, packable, *pins)
        output = out / "lambda" / ".serverless"
        started = time.monotonic()
        if not (stamp.is_file() and stamp.read_text() == key and output.is_dir()):
            stamp.unlink(missing_ok=True)
            stage(root, packable, out / "lambda")
            serverless_package(out / "lambda", tools)
            stamp.write_text(key)
        seconds["lambda"] = time.monotonic() - started
        built_lambda = check_lambda(output, root)
    if log:
        for name, took in seconds.items():
            print(f"deploy_build: {name} in {took:.1f} s", file=sys.stderr)
    return Artifacts(built_vercel, built_lambda, seconds)


# ---- reading the artifacts back --------------------------------------------------------------


def _lua_scripts(root: Path) -> dict[str, bytes]:
    """The `lua` package as the service reads it: the scripts and the marker that makes them
    package data (core/stores/scripts.py finds them with importlib.resources)."""
    package = root / "lua"
    return {p.name: p.read_bytes()
            for p in sorted([package / "__init__.py", *package.glob("*.lua")])}


ROUTE_KEYS = {"src", "dest", "status", "check", "continue", "headers", "handle"}


def _substitute(dest: str, match: re.Match[str]) -> str:
    """`$1`-style references in a route's dest, as Vercel expands them."""
    return re.sub(r"\$(\d+)", lambda ref: match.group(int(ref.group(1))) or "", dest)


def resolve_route(config: Mapping[str, object], output: Path, path: str) -> tuple[str, str]:
    """Where the Build Output API routes of `config` send `path`: ("function", name),
    ("static", file), ("status", code) or ("miss", path).

    The subset of Vercel's routing that `vercel build` writes for this project: phases split by
    `handle`, regex `src`, `$n` substitution in `dest`, `status`, `check` and `continue`. A route
    using anything else fails the check rather than being guessed at.
    """
    routes = config.get("routes", [])
    if not isinstance(routes, list):
        raise DeployCheckFailed(f"config.json routes is not a list: {routes!r}")

    def filesystem(p: str) -> tuple[str, str] | None:
        name = p.split("?", 1)[0].strip("/")
        if (output / "functions" / f"{name}.func").is_dir():
            return ("function", name)
        if name and (output / "static" / name).is_file():
            return ("static", name)
        return None

    for route in routes:
        unknown = set(route) - ROUTE_KEYS
        if unknown:
            raise DeployCheckFailed(f"route {route} uses {sorted(unknown)}: extend resolve_route")
        if "handle" in route:
            if route["handle"] == "filesystem":
                if hit := filesystem(path):
                    return hit
                continue
            break  # the error / miss phases: nothing matched in the main phases
        match = re.match(route["src"], path)
        if not match:
            continue
        if "dest" in route:
            path = _substitute(route["dest"], match)
        if "status" in route and "dest" not in route:
            return ("status", str(route["status"]))
        if route.get("continue"):
            continue
        return filesystem(path) or ("miss", path)
    return ("miss", path)


def check_vercel(output: Path, root: Path = ROOT) -> VercelFunction:
    """The Vercel output is deployable: every path reaches the function, no file is served as it
    is, the function runs python3.12 with its handler, every lua/ script and its dependencies,
    and nothing that is not the service."""
    config_path = output / "config.json"
    if not config_path.is_file():
        raise DeployCheckFailed(f"{config_path} is missing: vercel build built nothing")
    config = json.loads(config_path.read_text())
    misrouted = {}
    for probe in ROUTE_PROBES:
        hit = resolve_route(config, output, probe)
        if hit != ("function", VERCEL_FUNCTION):
            misrouted[probe] = hit
    if misrouted:
        raise DeployCheckFailed(f"paths that do not reach {VERCEL_FUNCTION}: {misrouted}")
    func_dir = output / "functions" / f"{VERCEL_FUNCTION}.func"
    vc_config = json.loads((func_dir / ".vc-config.json").read_text())
    if vc_config.get("runtime") != PYTHON_RUNTIME:
        raise DeployCheckFailed(
            f"the function runs {vc_config.get('runtime')}, not {PYTHON_RUNTIME}"
        )
    module, _, attr = vc_config["handler"].rpartition(".")
    if not (func_dir / f"{module.replace('.', '/')}.py").is_file():
        raise DeployCheckFailed(f"the handler {vc_config['handler']} is not in {func_dir}")
    _check_shipped("the Vercel function", {p.name for p in func_dir.iterdir()}, func_dir,
                   lambda name: (func_dir / name).read_bytes() if (func_dir / name).is_file()
                   else None, root)
    vendor = func_dir / str(vc_config.get("environment", {}).get("PYTHONPATH", "_vendor"))
    shadowing = sorted(p for p in ("api", "core", "lua") if (vendor / p).exists())
    if shadowing:
        raise DeployCheckFailed(
            f"{vendor} holds {shadowing}: the project itself was installed as a dependency, so "
            "which copy is imported depends on sys.path order (is pyproject.toml uploaded?)"
        )
    return VercelFunction(output, func_dir, module, attr,
                          dict(vc_config.get("environment", {})), vc_config["runtime"])


def check_lambda(serverless_dir: Path, root: Path = ROOT) -> LambdaFunction:
    """The Lambda package is deployable: the template's handler is a module in the zip, the
    runtime is python3.12, every lua/ script is in the zip, and nothing that is not the service."""
    template_path = serverless_dir / "cloudformation-template-update-stack.json"
    resources = json.loads(template_path.read_text())["Resources"]
    functions = [r for r in resources.values() if r["Type"] == "AWS::Lambda::Function"]
    if len(functions) != 1:
        raise DeployCheckFailed(f"expected one Lambda function in {template_path}, not "
                                f"{len(functions)}")
    props = functions[0]["Properties"]
    zip_path = serverless_dir / Path(props["Code"]["S3Key"]).name
    if props["Runtime"] != PYTHON_RUNTIME:
        raise DeployCheckFailed(f"the function runs {props['Runtime']}, not {PYTHON_RUNTIME}")
    with zipfile.ZipFile(zip_path) as archive:
        names = set(archive.namelist())
        module = props["Handler"].rpartition(".")[0]
        if f"{module}.py" not in names:
            raise DeployCheckFailed(f"the handler {props['Handler']}: no {module}.py in {zip_path}")
        top = {n.split("/", 1)[0] for n in names}
        _check_shipped("the Lambda package", top, zip_path,
                       lambda name: archive.read(name) if name in names else None, root)
    variables = props.get("Environment", {}).get("Variables", {})
    return LambdaFunction(serverless_dir, zip_path, props["Handler"], props["Runtime"],
                          {k: str(v) for k, v in variables.items()})


def _check_shipped(what: str, top: set[str], where: Path, read: Callable[[str], bytes | None],
                   root: Path) -> None:
    never = sorted(n for n in top if n in NEVER_SHIPPED or n.startswith(".env"))
    if never:
        raise DeployCheckFailed(f"{what} ships {never}, which are not the service ({where})")
    for name, text in _lua_scripts(root).items():
        if read(f"lua/{name}") != text:
            raise DeployCheckFailed(f"{what} lacks lua/{name} as it is in the repo ({where})")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m infra.deploy_build", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("vercel", "lambda"))
    parser.add_argument("--out", type=Path, help="staging and output directory (.run/deploy)")
    args = parser.parse_args(argv)
    try:
        built = build(ROOT, out=args.out, vercel=args.only in (None, "vercel"),
                      lambda_=args.only in (None, "lambda"), log=True)
    except DeployBuildError as exc:
        print(f"deploy_build: {exc}", file=sys.stderr)
        return 1
    if built.vercel:
        print(f"vercel: {built.vercel.output_dir} (function {built.vercel.func_dir.name})")
    if built.lambda_:
        print(f"lambda: {built.lambda_.zip_path} (handler {built.lambda_.handler})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
