#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in one go: the Triton kernels natively, the engine against transformers on the
# GPU, the kernel benchmark, and a serving sweep of the default model (bfloat16).
#   bash scripts/gpu_check.sh [OUT_DIR]        (default results/gpu)
# Env: PY (default python3), SWEEP (1,16,64,256), INPUT_LEN (128), OUTPUT_LEN (128), STEPS (what to run, default
# "tests bench serve offline"), TESTS (the test files of the tests step), SERVE_ARGS (more server flags, e.g.
# --enforce-eager), LABEL (the sweep's label, default harpoon-gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/gpu}
PY=${PY:-python3}
STEPS=${STEPS:-tests bench serve offline}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
status=0

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"

if [[ " $STEPS " == *" tests "* ]]; then
    TESTS=${TESTS:-tests/test_kernels.py tests/test_fused_ops.py tests/test_gpu.py tests/test_structured_output.py}
    # shellcheck disable=SC2086
    $PY -m pytest -q -p no:cacheprovider -rs -s $TESTS 2>&1 \
        | tee "$OUT/tests.log" || status=1
fi
if [[ " $STEPS " == *" bench "* ]]; then
    $PY -m loadtest.lab.decode_kernel --save "$OUT/kernels_bench.json" 2>&1 | tee "$OUT/kernels_bench.md" || status=1
fi
if [[ " $STEPS " == *" serve "* ]]; then
    # shellcheck disable=SC2086
    setsid $PY -m server --port 8000 ${SERVE_ARGS:-} > "$OUT/server.log" 2>&1 &
    pid=$!
    for _ in $(seq 180); do
        curl -sf http://127.0.0.1:8000/health > /dev/null && break
        kill -0 "$pid" 2> /dev/null || { tail -20 "$OUT/server.log"; exit 1; }
        sleep 1
    done
    $PY -m loadtest.serve --base-url http://127.0.0.1:8000 --label "${LABEL:-harpoon-gpu}" --num-prompts 16 \
        --input-len "${INPUT_LEN:-128}" --output-len "${OUTPUT_LEN:-128}" --sweep-concurrency "${SWEEP:-1,16,64,256}" \
        --no-progress --save "$OUT/serve.json" 2>&1 | tee "$OUT/serve.md" || status=1
    # the sweep's step-time histogram and the rest, to tell a long engine step from a stall outside the engine
    curl -sf http://127.0.0.1:8000/metrics > "$OUT/metrics.txt" || status=1
    kill "$pid"; wait "$pid" 2>/dev/null
fi
if [[ " $STEPS " == *" offline "* ]]; then
    $PY -m loadtest.offline --part throughput --num-seqs 256 --save "$OUT/offline.json" 2>&1 | tee "$OUT/offline.md" \
        || status=1
fi
exit $status
