#!/usr/bin/env bash
# The main job: set up, start the whole stack on this machine (redis-server, block store,
# prefill and decode workers, gateway), answer a real prompt through the gateway, stop.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --system
PROMPT="${1:-What is the capital of France? Answer in one sentence.}"
.venv/bin/pdserve up --detach
trap '.venv/bin/pdserve down' EXIT
.venv/bin/pdserve generate --max-tokens 64 "$PROMPT"
.venv/bin/pdserve status
