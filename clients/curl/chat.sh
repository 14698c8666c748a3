#!/usr/bin/env bash
# A chat completion through the model's chat template.
BASE_URL=${BASE_URL:-http://127.0.0.1:8000}
API_KEY=${API_KEY:-}
MODEL=${MODEL:-SmolLM2-135M-Instruct}
curl -sS "$BASE_URL/v1/chat/completions" \
  -H "Content-Type: application/json" \
  ${API_KEY:+-H "Authorization: Bearer $API_KEY"} \
  -d "{\"model\": \"$MODEL\", \"messages\": [{\"role\": \"user\", \"content\": \"${1:-What is the capital of France?}\"}],
       \"max_tokens\": 64, \"temperature\": 0}"
echo
