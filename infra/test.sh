#!/usr/bin/env bash
# The whole test suite from a fresh Linux machine: installs what is missing, then lint, types
# and tests. The tests start their own redis-server processes on free loopback ports and stop
# them by pid. CI runs exactly this (.ci/run). pytest's "no tests ran" (exit 5) fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."
source infra/setup.sh
.venv/bin/ruff check .
.venv/bin/mypy
# Known vulnerabilities in the installed dependencies; fails the run when one is found. (A package
# index without vulnerability data makes pip-audit skip packages: it says so in its output.)
.venv/bin/pip-audit --skip-editable --progress-spinner off
exec .venv/bin/pytest "$@"
