#!/usr/bin/env bash
# Two revisions of Harpoon served in turn on the same workload, one server at a time, alternated A B B A A B ...:
#   bash loadtest/revisions.sh OUT_DIR REV_A REV_B [ROUNDS]      (ROUNDS: runs of each revision, default 2)
# Each revision serves from a worktree of its own (made once under OUT_DIR, then reused), through this checkout's
# .venv (`python -m server` in the worktree takes the worktree's packages and builds its C kernels). Env: SWEEP
# (default 1,16,64), NUM_PROMPTS (16), INPUT_LEN (128), OUTPUT_LEN (128), HARPOON_ARGS (serve flags, both revisions).
# The table merges every run: a revision's spread over its own runs is the noise the other's difference is read
# against. Why alternate: these machines drift 5-50% within minutes, so a difference between two runs taken one
# after the other says as much about the minute as about the revisions.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "$1"); A=$2; B=$3; ROUNDS=${4:-2}
PY=$PWD/.venv/bin/python
ARGS=(--num-prompts "${NUM_PROMPTS:-16}" --input-len "${INPUT_LEN:-128}" --output-len "${OUTPUT_LEN:-128}"
      --sweep-concurrency "${SWEEP:-1,16,64}" --no-progress)
mkdir -p "$OUT"
tree_of() { echo "$OUT/tree-$(echo "$1" | tr -c 'A-Za-z0-9\n' _)"; }
for rev in "$A" "$B"; do
    [ -d "$(tree_of "$rev")" ] || git worktree add -q --detach "$(tree_of "$rev")" "$rev"
done
saved=()
run() {  # label, revision, round
    local log="$OUT/$1-$3.log" pid
    # shellcheck disable=SC2086
    (cd "$(tree_of "$2")" && exec setsid "$PY" -m server --port 8000 ${HARPOON_ARGS:-}) > "$log" 2>&1 &
    pid=$!
    trap 'kill $pid 2>/dev/null || true' EXIT
    "$PY" -m loadtest.serve --base-url http://127.0.0.1:8000 --label "$1-$3" "${ARGS[@]}" --save "$OUT/$1-$3.json"
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    sleep 3
    saved+=("$OUT/$1-$3.json")
}
for round in $(seq 1 "$ROUNDS"); do
    if [ $((round % 2)) = 1 ]; then order=("a $A" "b $B"); else order=("b $B" "a $A"); fi
    for pair in "${order[@]}"; do run "${pair%% *}" "${pair#* }" "$round"; done
done
"$PY" -m loadtest.serve --merge "${saved[@]}" | tee "$OUT/table.md"
