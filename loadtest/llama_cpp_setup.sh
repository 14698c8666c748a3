#!/usr/bin/env bash
# Builds llama.cpp's own C++ server, llama-server (what llama.cpp's and ollama's users run: continuous batching over
# --parallel slots), as a side-by-side peer for GGUF models. Its source ships inside llama-cpp-python's source
# distribution (vendor/llama.cpp), which the package index serves; built with this machine's compiler and CPU flags.
# Idempotent; ~10 minutes on 2 cores.
#   bash loadtest/llama_cpp_setup.sh          # prints the server's path
#   $LLAMA_SERVER --model FILE --port 8200 --threads 2 --parallel 16 --cont-batching --ctx-size 32768
# LLAMA_CMAKE_ARGS overrides the CPU flags (default -DGGML_NATIVE=ON): on an AMX Xeon the native build has crashed in
# its AMX matmul, and "-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON" ran there.
set -euo pipefail
VERSION=0.3.36
ROOT=${LLAMA_CPP_ROOT:-/tmp/llama.cpp}
SERVER=$ROOT/build/bin/llama-server
PY=${PYTHON:-python3}
if [ ! -x "$SERVER" ]; then
  mkdir -p "$ROOT"
  if [ ! -f "$ROOT/src/CMakeLists.txt" ]; then
    $PY -m pip download -q --no-deps --no-binary :all: -d "$ROOT/sdist" "llama-cpp-python==$VERSION"
    tar -xzf "$ROOT"/sdist/llama_cpp_python-"$VERSION".tar.gz -C "$ROOT/sdist"
    rm -rf "$ROOT/src"
    mv "$ROOT/sdist/llama_cpp_python-$VERSION/vendor/llama.cpp" "$ROOT/src"
  fi
  # shellcheck disable=SC2086
  cmake -S "$ROOT/src" -B "$ROOT/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON ${LLAMA_CMAKE_ARGS:--DGGML_NATIVE=ON} > "$ROOT/cmake.log"
  cmake --build "$ROOT/build" --target llama-server -j "$(nproc)" > "$ROOT/build.log"
fi
"$SERVER" --version 2>&1 | head -2 >&2
echo "$SERVER"
