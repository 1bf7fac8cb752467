#!/usr/bin/env bash
# A/B of torch's CPU threads per worker on this machine: the same `pdserve bench serve` run
# against `pdserve up --prefill 2 --decode 2` with the cores shared out among the workers
# (the default) and with torch's default in each (--threads-per-worker 0: every core in
# every worker). Prints both runs and the ratios.
#
#   bash loadtest/threads_ab.sh [RESULT_DIR] [extra bench serve flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-loadtest/results/threads}
shift || true
mkdir -p "$out"
pdserve=.venv/bin/pdserve
for arm in shared every-core; do
  flags=()
  if [ "$arm" = every-core ]; then flags=(--threads-per-worker 0); fi
  port=$(.venv/bin/python -c 'from pdserve.cli.launcher import free_port; print(free_port())')
  export PDSERVE_RUN_DIR="$out/stack-$arm"
  $pdserve up --detach --port "$port" --prefill 2 --decode 2 --kv-cache-memory 256MiB "${flags[@]}"
  trap '$pdserve down >/dev/null' EXIT
  $pdserve bench serve --port "$port" --label "$arm" --dataset-name random \
    --random-input-len 256 --random-output-len 64 --num-prompts 40 --request-rate 1 \
    --seed 7 --unique-cache-salt --disable-tqdm --save-result --result-dir "$out" \
    --result-filename "$arm.json" "$@"
  $pdserve down
  trap - EXIT
done
.venv/bin/python - "$out" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
a, b = (json.loads((out / f"{arm}.json").read_text()) for arm in ("shared", "every-core"))
print(f"\n{'':24}{'shared':>12}{'every core':>12}{'ratio':>8}")
for key, better in (("request_throughput", max), ("output_throughput", max),
                    ("median_ttft_ms", min), ("p99_ttft_ms", min), ("median_tpot_ms", min),
                    ("p99_tpot_ms", min), ("p99_itl_ms", min)):
    x, y = float(a[key]), float(b[key])
    ratio = (x / y if better is max else y / x) if min(x, y) > 0 else float("nan")
    print(f"{key:24}{x:12.2f}{y:12.2f}{ratio:7.2f}x")
print("ratio > 1: shared threads better")
PY
