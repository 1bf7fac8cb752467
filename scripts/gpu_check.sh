#!/usr/bin/env bash
# The GPU check, prepared to run in one go (at most 10 minutes) on a CUDA machine that has
# PyTorch, Triton and transformers but no network: it needs nothing from the repo's venv.
#   1. the Triton kernel tests, compiled for the GPU (TRITON_INTERPRET=0), bfloat16 cases too;
#   2. loadtest/gpu_check.py: the engine's greedy parity with transformers on CUDA, then its
#      decode (1, 16, 64 requests) and prefill (512, 2000 tokens) figures.
# Everything goes to OUT_DIR (default $OUT, else ./gpu-check): env.txt, kernel_tests.txt,
# gpu_check.txt and gpu_check.json. Exit status: 0 when both parts passed.
#
#   bash scripts/gpu_check.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-check}}"
mkdir -p "$out"
python="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_INTERPRET=0

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  "$python" -c 'import torch, triton, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "transformers", transformers.__version__)'
} >"$out/env.txt" 2>&1
cat "$out/env.txt"

# The kernels' own tests (the C++ CPU kernels' tests are left out: they build a CPU extension).
kernel_tests=(tests/kernels/test_kv_pack.py tests/kernels/test_kv_quant.py
  tests/kernels/test_kv_write.py tests/kernels/test_paged_decode_attention.py
  tests/kernels/test_paged_prefill_attention.py tests/kernels/test_rms_norm.py
  tests/kernels/test_rotary.py tests/kernels/test_triton_engine.py)
timeout 330 "$python" -m pytest -q -p no:cacheprovider -o addopts= "${kernel_tests[@]}" \
  >"$out/kernel_tests.txt" 2>&1
kernels=$?
tail -n 5 "$out/kernel_tests.txt"

timeout 240 "$python" -m loadtest.gpu_check --out "$out" 2>"$out/gpu_check.log"
engine=$?
[[ $engine == 0 ]] || tail -n 20 "$out/gpu_check.log"

echo "kernel tests: exit $kernels; engine check: exit $engine (files in $out)"
[[ $kernels == 0 && $engine == 0 ]]
