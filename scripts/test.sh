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
# NOTE: each worker's in-process engines run the kernels' OpenMP threads on both cores, so two workers put four
# threads on two cores, and OpenMP's default spin between parallel regions then holds a core the other worker's
# threads wait for. Its threads wait as a served engine's do (engine/engine_process.py, ENGINE_PROCESS_ENV).
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}" GOMP_SPINCOUNT="${GOMP_SPINCOUNT:-10000}"
exec python -m pytest -q -n "${HARPOON_TEST_WORKERS:-2}" --dist loadfile "$@"
