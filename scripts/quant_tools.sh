#!/usr/bin/env bash
# The quantization tools the tests run to make their checkpoints (issue 30), each in a venv
# of its own under $PDSERVE_CACHE/venvs, since each pins a transformers other than the
# engine's: llm-compressor (compressed-tensors checkpoints) and AutoAWQ (AWQ). Installed from
# scripts/<tool>.lock (--no-deps, torch pinned to the CPU build); a venv whose lock is
# unchanged is kept. (gptqmodel needs torch 2.14.1, a 6 GB CUDA build here: the GPTQ test
# files are committed instead; loadtest/baselines/make_gptq_awq_files.py says how.)
#   bash scripts/quant_tools.sh          make or check the venvs (about 2 minutes the first time)
#   bash scripts/quant_tools.sh --lock   refresh the locks from a fresh resolution
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
venvs="${PDSERVE_CACHE:-$HOME/.cache/pdserve}/venvs"
pip_in() { "$1/bin/python" -m pip install --quiet --disable-pip-version-check "${@:2}"; }

# tool -> what a fresh resolution asks for, and the modules that must import
declare -A WANT=(
  [llmcompressor]="llmcompressor==0.14.0.1"
  [autoawq]="autoawq==0.2.9 transformers==4.51.3"
)
declare -A IMPORTS=([llmcompressor]="llmcompressor, compressed_tensors" [autoawq]="awq, transformers")

for tool in llmcompressor autoawq; do
  lock="scripts/$tool.lock"
  if [[ "${1:-}" == "--lock" ]]; then
    scratch=$(mktemp -d)
    "$PYTHON" -m venv "$scratch/venv"
    pip_in "$scratch/venv" "torch==2.13.0"
    # shellcheck disable=SC2086  # the specs are words
    pip_in "$scratch/venv" ${WANT[$tool]}
    {
      echo "# $tool's own venv (scripts/quant_tools.sh installs these with --no-deps): a tool that"
      echo "# makes the tests' quantized checkpoints. Written by scripts/quant_tools.sh --lock."
      "$scratch/venv/bin/python" -m pip freeze --disable-pip-version-check \
        | sed -E 's/^torch==([0-9.]+)\+cpu$/torch==\1/'
    } > "$lock"
    rm -rf "$scratch"
    echo "$lock: $(grep -vc '^#' "$lock") packages"
    continue
  fi
  venv="$venvs/$tool"
  stamp=$(sha256sum "$lock" | cut -c1-16)
  if [[ -f "$venv/.lock-stamp" && "$(cat "$venv/.lock-stamp")" == "$stamp" ]]; then
    continue
  fi
  rm -rf "$venv"
  mkdir -p "$venvs"
  "$PYTHON" -m venv "$venv"
  pip_in "$venv" "torch==2.13.0"
  pip_in "$venv" --no-deps -r "$lock"
  "$venv/bin/python" -c "import ${IMPORTS[$tool]}"
  echo "$stamp" > "$venv/.lock-stamp"
  echo "quant tools: $venv ready"
done
