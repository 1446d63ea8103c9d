#!/usr/bin/env bash
# The main job: show the ceiling holding across many instances (and failing without a shared
# ledger). Installs what is missing first. Everything runs on 127.0.0.1 and stops by itself.
set -euo pipefail
cd "$(dirname "$0")/.."
source infra/setup.sh
exec .venv/bin/python -m infra.demo "$@"
