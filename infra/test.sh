#!/usr/bin/env bash
# The whole test suite from a fresh Linux machine: installs what is missing, then lint, types
# and tests. The tests start their own redis-server processes on free loopback ports and stop
# them by pid. CI runs exactly this (.ci/run). pytest's "no tests ran" (exit 5) fails the run.
# pytest runs in parallel workers (pytest-xdist; pyproject's addopts): pass `-n 0` to run it in
# one process.
set -euo pipefail
cd "$(dirname "$0")/.."
source infra/setup.sh
# Known vulnerabilities in the installed dependencies; fails the run when one is found. (A package
# index without vulnerability data makes pip-audit skip packages: it says so in its output.) It
# waits on the network for most of its run, so it runs while ruff and mypy use the CPU.
audit_log=$(mktemp)
.venv/bin/pip-audit --skip-editable --progress-spinner off >"$audit_log" 2>&1 &
audit_pid=$!
# A failed lint or type check ends the run: pip-audit is stopped by its pid, not left behind.
trap 'kill "$audit_pid" 2>/dev/null || true; rm -f "$audit_log"' EXIT
.venv/bin/ruff check .
.venv/bin/mypy
audit_status=0
wait "$audit_pid" || audit_status=$?
cat "$audit_log"
if [ "$audit_status" != 0 ]; then
  echo "pip-audit failed (exit $audit_status)" >&2
  exit "$audit_status"
fi
.venv/bin/pytest "$@"
