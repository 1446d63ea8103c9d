#!/usr/bin/env bash
# The whole test suite from a fresh Linux machine: installs what is missing, then lint, types
# and tests. The tests start their own redis-server processes on free loopback ports and stop
# them by pid. CI runs exactly this (.ci/run). pytest's "no tests ran" (exit 5) fails the run.
# pytest runs in parallel workers (pytest-xdist; pyproject's addopts): pass `-n 0` to run it in
# one process.
set -euo pipefail
cd "$(dirname "$0")/.."
source infra/setup.sh
# ruff, mypy and pip-audit (known vulnerabilities in the installed dependencies; a package index
# without vulnerability data makes it skip packages, and it says so) run beside pytest, at the
# lowest CPU priority: they take the cores pytest leaves idle while its workers wait on the
# servers they started, instead of running before it. Any of them failing fails the run once
# pytest is done; a run cut short stops them by pid.
checks_log=$(mktemp)
nice -n 19 bash -c '
  status=0
  .venv/bin/pip-audit --skip-editable --progress-spinner off >"$1.audit" 2>&1 &
  audit_pid=$!
  .venv/bin/ruff check . >"$1.lint" 2>&1 || status=1
  .venv/bin/mypy >>"$1.lint" 2>&1 || status=1
  wait "$audit_pid" || { echo "pip-audit failed" >>"$1.audit"; status=1; }
  cat "$1.audit" "$1.lint"; rm -f "$1.audit" "$1.lint"
  exit "$status"
' checks "$checks_log" >"$checks_log" 2>&1 &
checks_pid=$!
trap 'pkill -P "$checks_pid" 2>/dev/null || true; kill "$checks_pid" 2>/dev/null || true
      rm -f "$checks_log" "$checks_log.audit" "$checks_log.lint"' EXIT
pytest_status=0
.venv/bin/pytest "$@" || pytest_status=$?
checks_status=0
wait "$checks_pid" || checks_status=$?
cat "$checks_log"
if [ "$checks_status" != 0 ]; then
  echo "ruff, mypy or pip-audit failed (above)" >&2
  exit 1
fi
exit "$pytest_status"
