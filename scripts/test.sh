#!/usr/bin/env bash
# Sets up (if needed) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
# Two workers, each taking whole files (a module's server or model is made once): the suite is ~1.2 cores of work on
# one worker, much of it single-threaded Python, so on a 2-core machine two took it from 14-16 to ~13 minutes.
# HARPOON_TEST_WORKERS=0 runs it in this process alone.
exec python -m pytest -q -n "${HARPOON_TEST_WORKERS:-2}" --dist loadfile "$@"
