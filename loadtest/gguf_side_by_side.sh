#!/usr/bin/env bash
# Harpoon and llama.cpp's server side by side on GGUF files, one server running at a time, same loadtest settings:
#   bash loadtest/gguf_side_by_side.sh [OUT_DIR] [FILE.gguf ...]    (default results/gguf_side_by_side; the
#                                                                   random-weight Llama-3.2-1B as Q4_K_M and Q8_0)
# Needs llama.cpp set up once: bash loadtest/llama_cpp_setup.sh. Env: SWEEP (default 1,16), NUM_PROMPTS (16),
# INPUT_LEN (128), OUTPUT_LEN (128), HARPOON_ARGS, or HARPOON_VARIANTS: Harpoon once per variant, "label=args"
# separated by ";" (e.g. "exact=;int8=--quantized-matmul int8"). NOTE: llama-cpp-python's server takes one request at a time, so
# its c16 row is that server as its users have it (with --interrupt_requests False: by default a new request cuts
# the stream in flight).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/gguf_side_by_side}
shift || true
PY=.venv/bin/python
LLAMA=/tmp/venv-llamacpp/bin/python
FILES=("$@")
if [ ${#FILES[@]} -eq 0 ]; then
    for quant in q4_k_m q8_0; do FILES+=("$($PY -m loadtest.models --shape llama-3.2-1b --quant $quant | cut -d' ' -f1)"); done
fi
ARGS=(--num-prompts "${NUM_PROMPTS:-16}" --input-len "${INPUT_LEN:-128}" --output-len "${OUTPUT_LEN:-128}"
      --sweep-concurrency "${SWEEP:-1,16}" --no-progress)
mkdir -p "$OUT"
stop() { kill "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true; sleep 3; }
for file in "${FILES[@]}"; do
    name=$(basename "$file" .gguf)
    saved=()
    IFS=';' read -r -a variants <<< "${HARPOON_VARIANTS:-harpoon=${HARPOON_ARGS:-}}"
    for variant in "${variants[@]}"; do
        label=${variant%%=*}
        [ "$label" = harpoon ] || label=harpoon-$label
        # shellcheck disable=SC2086
        setsid .venv/bin/harpoon serve --port 8000 --model "$file" --max-model-len 2048 ${variant#*=} \
            > "$OUT/$name-$label.log" 2>&1 &
        pid=$!
        trap 'kill $pid 2>/dev/null || true' EXIT
        $PY -m loadtest.serve --base-url http://127.0.0.1:8000 --label "$label-$name" "${ARGS[@]}" \
            --save "$OUT/$name-$label.json"
        stop $pid
        saved+=("$OUT/$name-$label.json")
    done
    setsid $LLAMA -m llama_cpp.server --model "$file" --port 8200 --n_threads "$(nproc)" --n_ctx 2048 \
        --interrupt_requests False \
        > "$OUT/$name-llama-cpp.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 300); do curl -sf http://127.0.0.1:8200/v1/models >/dev/null && break; sleep 1; done
    $PY -m loadtest.serve --base-url http://127.0.0.1:8200 --label "llama-cpp-$name" "${ARGS[@]}" \
        --save "$OUT/$name-llama-cpp.json"
    stop $pid
    $PY -m loadtest.serve --merge "${saved[@]}" "$OUT/$name-llama-cpp.json" | tee "$OUT/$name.md"
done
