#!/usr/bin/env bash
# Sets up (if needed) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
exec python -m pytest -q "$@"
