#!/usr/bin/env bash
# A plain completion. BASE_URL and API_KEY may be set in the environment.
BASE_URL=${BASE_URL:-http://127.0.0.1:8000}
API_KEY=${API_KEY:-}
MODEL=${MODEL:-SmolLM2-135M-Instruct}
curl -sS "$BASE_URL/v1/completions" \
  -H "Content-Type: application/json" \
  ${API_KEY:+-H "Authorization: Bearer $API_KEY"} \
  -d "{\"model\": \"$MODEL\", \"prompt\": \"${1:-The capital of France is}\", \"max_tokens\": 16, \"temperature\": 0}"
echo
