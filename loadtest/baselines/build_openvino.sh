#!/usr/bin/env bash
# OpenVINO GenAI, the baseline of loadtest/bench_openvino.py, in a venv of its own outside the
# repo (not part of CI), and the default model exported for it by optimum-intel, as a user
# who serves SmolLM2 with OpenVINO on a CPU would export it:
#   int4  weights int4 symmetric, group 32, every layer (--ratio 1.0): what the issue measured
#   int8  weights int8 per channel (asymmetric, optimum-intel's int8 default)
# Activations and the KV cache stay as OpenVINO's CPU plugin chooses at run time.
#
#   bash loadtest/baselines/build_openvino.sh      # prints the venv's python when done
#
# OPENVINO_CACHE (default ~/.cache/pdserve/openvino) holds the venv and the exported models;
# a second run finds them and returns at once. OPENVINO_GENAI_VERSION pins openvino-genai
# (default: the newest). torch is pinned to the CPU build (an unpinned one pulls CUDA), and
# torchvision is removed after: its build does not match torch 2.13 and breaks optimum's
# import.
set -euo pipefail
cd "$(dirname "$0")/../.."

cache="${OPENVINO_CACHE:-$HOME/.cache/pdserve/openvino}"
venv="$cache/venv"
python="${PYTHON:-python3}"
model="${MODEL:-$(.venv/bin/python -c 'from common.models.default_model import resolve_model; print(resolve_model(None))')}"

if [[ ! -x "$venv/bin/python" ]] || ! "$venv/bin/python" -c "import openvino_genai, optimum.intel, nncf" 2>/dev/null; then
  rm -rf "$venv"
  mkdir -p "$cache"
  "$python" -m venv "$venv"
  pip_in() { "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@"; }
  pip_in "torch==2.13.0"
  pip_in "torch==2.13.0" "openvino-genai${OPENVINO_GENAI_VERSION:+==$OPENVINO_GENAI_VERSION}" \
    optimum-intel nncf
  "$venv/bin/python" -m pip uninstall --quiet --yes torchvision 2>/dev/null || true
  "$venv/bin/python" -c "import openvino_genai, optimum.intel, nncf"
  "$venv/bin/python" -m pip freeze --disable-pip-version-check > "$cache/venv.freeze"
fi

export_model() {  # name, optimum-cli's weight flags...
  local out="$cache/models/$1"
  shift
  if [[ -f "$out/openvino_model.xml" && -f "$out/openvino_tokenizer.xml" ]]; then
    return
  fi
  rm -rf "$out"
  "$venv/bin/optimum-cli" export openvino --model "$model" --task text-generation-with-past \
    "$@" "$out" >"$out.log" 2>&1 || { tail -n 30 "$out.log" >&2; exit 1; }
}
mkdir -p "$cache/models"
export_model int4 --weight-format int4 --sym --group-size 32 --ratio 1.0
export_model int8 --weight-format int8
echo "$venv/bin/python"
