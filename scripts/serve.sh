#!/usr/bin/env bash
# Sets up (if needed) and starts the OpenAI-compatible server on the default model (or pass --model ...).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/harpoon serve "$@"
