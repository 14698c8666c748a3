#!/usr/bin/env bash
# A streamed completion: server-sent events, one "data: {...}" per chunk, then "data: [DONE]".
BASE_URL=${BASE_URL:-http://127.0.0.1:8000}
API_KEY=${API_KEY:-}
MODEL=${MODEL:-SmolLM2-135M-Instruct}
curl -sS -N "$BASE_URL/v1/completions" \
  -H "Content-Type: application/json" \
  ${API_KEY:+-H "Authorization: Bearer $API_KEY"} \
  -d "{\"model\": \"$MODEL\", \"prompt\": \"${1:-Once upon a time}\", \"max_tokens\": 32, \"stream\": true,
       \"stream_options\": {\"include_usage\": true}}"
