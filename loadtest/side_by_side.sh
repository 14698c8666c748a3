#!/usr/bin/env bash
# Harpoon and vLLM-CPU side by side on this machine, one engine running at a time, same loadtest settings:
#   bash loadtest/side_by_side.sh [OUT_DIR]      (default results/side_by_side)
# Needs the peer set up once: bash $PEERS/setup_vllm.sh (PEERS defaults to ../shared/peers).
# Env: SWEEP (default 1,4,16,64), NUM_PROMPTS (16), INPUT_LEN (128), OUTPUT_LEN (128), HARPOON_ARGS (extra serve flags).
# VARIANTS measures more Harpoon settings in the same run, one server each, e.g.
#   VARIANTS='r3=--prefill-tokens-per-decode 3;b512=--max-num-batched-tokens 512' bash loadtest/side_by_side.sh
# (label=flags, ';'-separated); each gets its own rows. vLLM runs once per dtype in VLLM_DTYPES (default
# "float32 bfloat16"); the table ends with the fastest Harpoon run against the fastest vLLM run at each point.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/side_by_side}
PEERS=${PEERS:-../shared/peers}
PY=.venv/bin/python
ARGS=(--num-prompts "${NUM_PROMPTS:-16}" --input-len "${INPUT_LEN:-128}" --output-len "${OUTPUT_LEN:-128}"
      --sweep-concurrency "${SWEEP:-1,4,16,64}" --no-progress)
mkdir -p "$OUT"

LABELS=()
run_harpoon() {  # label, extra serve flags (word-split on purpose)
    # shellcheck disable=SC2086
    setsid .venv/bin/harpoon serve --port 8000 $2 > "$OUT/$1_server.log" 2>&1 &
    HARPOON_PID=$!
    trap 'kill $HARPOON_PID 2>/dev/null || true' EXIT
    $PY -m loadtest.serve --base-url http://127.0.0.1:8000 --label "$1" "${ARGS[@]}" --save "$OUT/$1.json"
    kill "$HARPOON_PID"; wait "$HARPOON_PID" 2>/dev/null || true
    LABELS+=("$1")
    sleep 3
}
run_harpoon harpoon "${HARPOON_ARGS:-}"
IFS=';' read -ra EXTRA <<< "${VARIANTS:-}"
for variant in "${EXTRA[@]}"; do
    [[ $variant == *=* ]] || { echo "VARIANTS entries are label=flags, got: $variant" >&2; exit 2; }
    run_harpoon "harpoon-${variant%%=*}" "${variant#*=}"
done

VLLM_FILES=()
for dtype in ${VLLM_DTYPES:-float32 bfloat16}; do  # its fp32 and the bf16 its CPU docs recommend
    VLLM_DTYPE=$dtype bash "$PEERS/start_vllm.sh"
    $PY -m loadtest.serve --base-url http://127.0.0.1:8100 --label "vllm-cpu-$dtype" "${ARGS[@]}" \
        --save "$OUT/vllm-$dtype.json" || { bash "$PEERS/stop_server.sh" /tmp/peer-vllm.pid; exit 1; }
    bash "$PEERS/stop_server.sh" /tmp/peer-vllm.pid
    VLLM_FILES+=("$OUT/vllm-$dtype.json")
    sleep 3
done

HARPOON_FILES=()
for label in "${LABELS[@]}"; do HARPOON_FILES+=("$OUT/$label.json"); done
# every row, ratios of the first Harpoon run against each, best against best, and Harpoon's step profiles
$PY -m loadtest.serve --merge "${HARPOON_FILES[@]}" "${VLLM_FILES[@]}" --best-of harpoon vllm --plot-dir "$OUT" \
    | tee "$OUT/table.md"
