#!/usr/bin/env bash
# Harpoon and vLLM-CPU side by side on this machine, one engine running at a time, same loadtest settings:
#   bash loadtest/side_by_side.sh [OUT_DIR]      (default results/side_by_side)
# Needs the peer set up once: bash $PEERS/setup_vllm.sh (PEERS defaults to ../shared/peers).
# Env: SWEEP (default 1,4,16,64), NUM_PROMPTS (16), INPUT_LEN (128), OUTPUT_LEN (128), HARPOON_ARGS (extra serve flags).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/side_by_side}
PEERS=${PEERS:-../shared/peers}
PY=.venv/bin/python
ARGS=(--num-prompts "${NUM_PROMPTS:-16}" --input-len "${INPUT_LEN:-128}" --output-len "${OUTPUT_LEN:-128}"
      --sweep-concurrency "${SWEEP:-1,4,16,64}" --no-progress)
mkdir -p "$OUT"

# shellcheck disable=SC2086
setsid .venv/bin/harpoon serve --port 8000 ${HARPOON_ARGS:-} > "$OUT/harpoon_server.log" 2>&1 &
HARPOON_PID=$!
trap 'kill $HARPOON_PID 2>/dev/null || true' EXIT
$PY -m loadtest.serve --base-url http://127.0.0.1:8000 --label harpoon "${ARGS[@]}" --save "$OUT/harpoon.json"
kill "$HARPOON_PID"; wait "$HARPOON_PID" 2>/dev/null || true
sleep 3

bash "$PEERS/start_vllm.sh"
$PY -m loadtest.serve --base-url http://127.0.0.1:8100 --label vllm-cpu "${ARGS[@]}" --save "$OUT/vllm.json" \
    || { bash "$PEERS/stop_server.sh" /tmp/peer-vllm.pid; exit 1; }
bash "$PEERS/stop_server.sh" /tmp/peer-vllm.pid

$PY -m loadtest.serve --merge "$OUT/harpoon.json" "$OUT/vllm.json" --plot-dir "$OUT" | tee "$OUT/table.md"
