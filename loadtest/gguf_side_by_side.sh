#!/usr/bin/env bash
# Harpoon and llama.cpp's C++ server (llama-server) side by side on GGUF files, one server running at a time, the
# same loadtest settings:
#   bash loadtest/gguf_side_by_side.sh [OUT_DIR] [FILE.gguf ...]    (default results/gguf_side_by_side; the
#                                                                   random-weight Llama-3.2-1B as Q4_K_M and Q8_0)
# Needs llama-server built once: bash loadtest/llama_cpp_setup.sh. Env: SWEEP (default 1,16), NUM_PROMPTS (16),
# INPUT_LEN (128), OUTPUT_LEN (128), MAX_MODEL_LEN (2048: each sequence's context on both sides), HARPOON_ARGS, or
# HARPOON_VARIANTS: Harpoon once per variant, "label=args" separated by ";" (e.g. "default=;exact=--quantized-matmul
# exact"). Harpoon serves every point of the sweep from one start; llama-server is started for each point with
# --parallel set to its concurrency (slots of MAX_MODEL_LEN each), --cont-batching and --threads set to the cores,
# as its users run it for that load.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/gguf_side_by_side}
shift || true
PY=.venv/bin/python
LLAMA_SERVER=${LLAMA_SERVER:-$(bash loadtest/llama_cpp_setup.sh)}
CONTEXT=${MAX_MODEL_LEN:-2048}
FILES=("$@")
if [ ${#FILES[@]} -eq 0 ]; then
    for quant in q4_k_m q8_0; do FILES+=("$($PY -m loadtest.models --shape llama-3.2-1b --quant $quant | cut -d' ' -f1)"); done
fi
ARGS=(--num-prompts "${NUM_PROMPTS:-16}" --input-len "${INPUT_LEN:-128}" --output-len "${OUTPUT_LEN:-128}"
      --no-progress)
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
        setsid .venv/bin/harpoon serve --port 8000 --model "$file" --max-model-len "$CONTEXT" ${variant#*=} \
            > "$OUT/$name-$label.log" 2>&1 &
        pid=$!
        trap 'kill $pid 2>/dev/null || true' EXIT
        $PY -m loadtest.serve --base-url http://127.0.0.1:8000 --label "$label-$name" "${ARGS[@]}" \
            --sweep-concurrency "${SWEEP:-1,16}" --save "$OUT/$name-$label.json"
        stop $pid
        saved+=("$OUT/$name-$label.json")
    done
    IFS=',' read -r -a points <<< "${SWEEP:-1,16}"
    for c in "${points[@]}"; do
        setsid "$LLAMA_SERVER" --model "$file" --host 127.0.0.1 --port 8200 --threads "$(nproc)" --parallel "$c" \
            --cont-batching --ctx-size $((CONTEXT * c)) > "$OUT/$name-llama-server-c$c.log" 2>&1 &
        pid=$!
        trap 'kill $pid 2>/dev/null || true' EXIT
        for _ in $(seq 1 600); do curl -sf http://127.0.0.1:8200/health >/dev/null && break; sleep 1; done
        $PY -m loadtest.serve --base-url http://127.0.0.1:8200 --label "llama-server-$name" "${ARGS[@]}" \
            --sweep-concurrency "$c" --save "$OUT/$name-llama-server-c$c.json"
        stop $pid
        saved+=("$OUT/$name-llama-server-c$c.json")
    done
    $PY -m loadtest.serve --merge "${saved[@]}" | tee "$OUT/$name.md"
done
