# Sourced by infra/test.sh and infra/demo.sh: install what a fresh Linux machine is missing.
# Idempotent and quiet when everything is there already.

_sudo() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# redis-server: the ledger the tests and the demo run against. faketime: the clock-skew tests
# move instance clocks with libfaketime.
if ! command -v redis-server >/dev/null 2>&1 || ! command -v faketime >/dev/null 2>&1; then
  echo "setup: installing redis-server and faketime (apt-get)" >&2
  _sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive _sudo apt-get install -y -qq redis-server redis-tools faketime \
    >/dev/null
fi

# tests/deploy builds the Vercel and Lambda artifacts with the pinned CLIs of deploy/ (Node.js)
# and Python 3.12 (pyenv's on this machine kind; infra/deploy_build.py finds it).
if ! command -v npm >/dev/null 2>&1; then
  echo "setup: installing nodejs and npm (apt-get)" >&2
  _sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive _sudo apt-get install -y -qq nodejs npm >/dev/null
fi

# strace: tests/clients/test_js_clients.py checks that Claude Code and Codex reach nothing but
# the gateway on loopback.
if ! command -v strace >/dev/null 2>&1; then
  echo "setup: installing strace (apt-get)" >&2
  _sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive _sudo apt-get install -y -qq strace >/dev/null
fi

# chromium: tests/api/test_dashboard.py opens the spend page in a real headless browser
# (Playwright drives Debian's package; it downloads no browser of its own).
if ! command -v chromium >/dev/null 2>&1; then
  echo "setup: installing chromium (apt-get)" >&2
  _sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive _sudo apt-get install -y -qq chromium >/dev/null
fi

PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "setup: Python >= 3.11 is required (found $("$PYTHON" --version 2>&1))" >&2
  exit 1
fi
stamp=.venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)
if [ ! -f "$stamp" ]; then
  echo "setup: creating .venv and installing dependencies" >&2
  "$PYTHON" -m venv .venv
  # uv (from PyPI) downloads, installs and byte-compiles the dependencies in parallel where pip
  # does one at a time; pip's install was most of a clean CI run outside pytest. uv reads PyPI,
  # not pip's configuration, so where uv cannot be installed pip does the install as configured.
  if .venv/bin/pip install -q uv >/dev/null 2>&1; then
    .venv/bin/uv pip install --python .venv/bin/python -q --compile-bytecode -e ".[dev]"
  else
    .venv/bin/pip install -q --upgrade pip >/dev/null
    .venv/bin/pip install -q -e ".[dev]"
  fi
  rm -f .venv/.installed-*
  touch "$stamp"
fi
