"""The real JavaScript clients, installed from their registry and pointed at a gateway unchanged.

    python3 -m infra.clients        # installs them (once per lockfile); prints where

What it guarantees:
- The clients are pinned by tests/clients/js/package-lock.json and installed by `npm ci` once
  per lockfile into a cache outside the clone (SC_CLIENTS_CACHE, default
  ~/.cache/spend-ceiling/clients-js-<digest>): the Claude Code and Codex binaries alone are
  about 800 MB, too much to fetch on every CI run. An exclusive lock per entry means two test
  workers never fill one entry; an entry is used only once `npm ci` finished (`.complete`).
- Each client is pointed at a gateway as its own documentation says a team would, with the base
  URL and the key and nothing else that changes what it sends (docs/clients.md). What is set
  beyond that only keeps the run on loopback and off the user's machine: a fresh home per run,
  and telemetry, error reports, update checks and plugin syncs off.
- Nothing here talks to a provider: the scripts and CLIs reach only the URL they are given.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from infra.deploy_build import npm_installed

ROOT = Path(__file__).resolve().parent.parent
JS_DIR = ROOT / "tests" / "clients" / "js"
# Far above what a clean `npm ci` of these packages takes (about 30 s here, 800 MB); past it,
# something is hanging.
NPM_CI_TIMEOUT_S = 1200
OUTPUT_TAIL_CHARS = 6000

# Claude Code: no telemetry, no error reports, no self-update, nothing else a run would send
# beyond the model calls (its documented switches).
CLAUDE_QUIET_ENV = {
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_AUTOUPDATER": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
}
# Codex's config.toml beyond its base URL: no update check, no analytics, no OpenTelemetry
# export, and no plugin marketplace sync (without it, every start runs `git ls-remote
# https://github.com/openai/plugins.git`). Keys from openai/codex's config schema.
CODEX_QUIET_CONFIG = """\
check_for_update_on_startup = false

[analytics]
enabled = false

[otel]
exporter = "none"
metrics_exporter = "none"
trace_exporter = "none"

[features]
plugins = false
"""


class ClientsInstallError(Exception):
    """The pinned clients could not be installed; says why."""


def cache_base() -> Path:
    """Where the clients' cache entries sit, the JavaScript ones here and the Python ones
    (infra/py_clients.py): SC_CLIENTS_CACHE, else spend-ceiling under the user's cache."""
    if explicit := os.environ.get("SC_CLIENTS_CACHE"):
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "spend-ceiling"


def ensure_js_clients() -> Path:
    """The node_modules of tests/clients/js/package-lock.json, installed once per lockfile."""
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            raise ClientsInstallError(
                f"{tool} is required (Node.js 20+): apt-get install nodejs npm")
    return npm_installed(cache_base(), "clients-js", JS_DIR, _npm_ci)


def _npm_ci(home: Path) -> None:
    # Install scripts run: Claude Code's puts its native binary in place.
    try:
        done = subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=home,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, timeout=NPM_CI_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise ClientsInstallError(
            f"npm ci (clients): no result after {NPM_CI_TIMEOUT_S} s") from exc
    if done.returncode != 0:
        raise ClientsInstallError(
            f"npm ci (clients) exited with {done.returncode}:\n"
            f"{done.stdout[-OUTPUT_TAIL_CHARS:]}")


def stage_scripts(node_modules: Path, dest: Path) -> Path:
    """A directory holding the .mjs scripts beside a link to `node_modules`: Node resolves an
    ES module's imports from the script's own directory (NODE_PATH does not apply), and the clone
    is never written to."""
    dest.mkdir(parents=True, exist_ok=True)
    for script in JS_DIR.glob("*.mjs"):
        shutil.copyfile(script, dest / script.name)
    link = dest / "node_modules"
    if not link.exists():
        link.symlink_to(node_modules, target_is_directory=True)
    return dest


def base_env(home: Path) -> dict[str, str]:
    """What every client run starts from: the PATH and a fresh HOME, nothing inherited that
    could point a client elsewhere (a developer's OPENAI_BASE_URL, proxies, keys)."""
    home.mkdir(parents=True, exist_ok=True)
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
            "LANG": "C.UTF-8"}


def ai_sdk_env(home: Path, gateway_url: str, key: str) -> dict[str, str]:
    """The AI SDK's default providers read these: `@ai-sdk/openai` OPENAI_BASE_URL (with /v1)
    and OPENAI_API_KEY, `@ai-sdk/anthropic` ANTHROPIC_BASE_URL (with /v1) and
    ANTHROPIC_API_KEY, `@ai-sdk/google` GOOGLE_GENERATIVE_AI_API_KEY; its base URL (with
    /v1beta), which it reads from no variable, ai_sdk.mjs passes to createGoogle from
    GOOGLE_GENERATIVE_AI_BASE_URL."""
    return {**base_env(home), "OPENAI_BASE_URL": f"{gateway_url}/v1", "OPENAI_API_KEY": key,
            "ANTHROPIC_BASE_URL": f"{gateway_url}/v1", "ANTHROPIC_API_KEY": key,
            "GOOGLE_GENERATIVE_AI_BASE_URL": f"{gateway_url}/v1beta",
            "GOOGLE_GENERATIVE_AI_API_KEY": key}


def claude_env(home: Path, gateway_url: str, key: str) -> dict[str, str]:
    """Claude Code: ANTHROPIC_BASE_URL without /v1 (as the anthropic SDK takes it) and
    ANTHROPIC_API_KEY; its config in a fresh directory."""
    return {**base_env(home), **CLAUDE_QUIET_ENV, "CLAUDE_CONFIG_DIR": str(home / ".claude"),
            "ANTHROPIC_BASE_URL": gateway_url, "ANTHROPIC_API_KEY": key}


def codex_env(home: Path, gateway_url: str, key: str) -> dict[str, str]:
    """Codex: the key as CODEX_API_KEY (what `codex exec` reads; it sends no key at all given
    only OPENAI_API_KEY), the base URL in $CODEX_HOME/config.toml as `openai_base_url` (Codex
    0.171 does not read OPENAI_BASE_URL from the environment)."""
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(
        f'openai_base_url = "{gateway_url}/v1"\n{CODEX_QUIET_CONFIG}')
    return {**base_env(home), "CODEX_HOME": str(codex_home), "CODEX_API_KEY": key}


def main() -> None:
    try:
        print(ensure_js_clients())
    except ClientsInstallError as exc:
        sys.exit(str(exc))


if __name__ == "__main__":
    main()
