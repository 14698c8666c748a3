#!/usr/bin/env bash
# Sets up llama.cpp's server (llama-cpp-python, built from source with this machine's compiler) as a side-by-side
# peer for GGUF models, in /tmp/venv-llamacpp. Idempotent; the build takes ~10 minutes on 2 cores.
#   bash loadtest/llama_cpp_setup.sh
#   /tmp/venv-llamacpp/bin/python -m llama_cpp.server --model FILE --port 8200 --n_threads 2 --n_ctx 4096
# NOTE: llama-cpp-python's server answers one request at a time (its own lock), so at 16 clients it is compared as
# it is served, and said so beside the figures. LLAMA_CMAKE_ARGS overrides the build flags: on an AMX Xeon the
# native build has crashed in its AMX matmul; "-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON" ran there.
set -euo pipefail
PY=${PYTHON:-python3}
VENV=/tmp/venv-llamacpp
[ -x $VENV/bin/python ] || $PY -m venv $VENV
if ! $VENV/bin/python -c "import llama_cpp.server" 2>/dev/null; then
  CMAKE_ARGS="${LLAMA_CMAKE_ARGS:--DGGML_NATIVE=ON}" $VENV/bin/pip install -q --no-cache-dir \
    "llama-cpp-python[server]==0.3.36"
fi
$VENV/bin/python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
