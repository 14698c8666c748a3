#!/usr/bin/env bash
# Sets up (if needed) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
# Two workers, each taking whole files (a module's server or model is made once). Much of the suite is single-threaded
# Python: on a 2-core machine two workers took 13:03-13:49 (five passing runs), one 14:27 back to back on one commit.
# HARPOON_TEST_WORKERS=0 runs it in this process alone.
exec python -m pytest -q -n "${HARPOON_TEST_WORKERS:-2}" --dist loadfile "$@"
