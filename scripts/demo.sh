#!/usr/bin/env bash
# The main job: set up, start the whole stack on this machine (redis-server, block store,
# prefill and decode workers, gateway), answer a real prompt through the gateway, stop.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --system
PROMPT="${1:-What is the capital of France? Answer in one sentence.}"
# One prefill and one decode worker, the disaggregated stack (on a 2-core machine the
# default is a decode worker alone, which prefills locally: README, "Using it").
.venv/bin/pdserve up --detach --prefill 1 --decode 1
trap '.venv/bin/pdserve down' EXIT
.venv/bin/pdserve generate --max-tokens 64 "$PROMPT"
.venv/bin/pdserve status
