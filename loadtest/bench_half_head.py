"""A checkpoint's float output head on the CPU (common/models/quant/half.py): SmolLM2's tied
49152 x 576 table as bfloat16 and as float16, 16 rows interleaved, against torch's float32
GEMM on the same values, per row count M of a decode step.

- ``bf16``: kernels/cpu/fp8_matmul.cpp's ``half_x16_matmul`` on bfloat16 weights: x rounded
  to bfloat16, vdpbf16ps where the CPU has AVX512-BF16 (else FMAs on the rounded x);
- ``f16``: the same kernel on float16 weights: float32 x, FMAs (no instruction multiplies
  float16 pairs on these CPUs), i.e. the work the bfloat16 head did before vdpbf16ps;
- ``fp32 gemm``: the weights upcast once to float32 (113 MB) and torch's F.linear, the
  reference both are tested against (tests/kernels/test_fp8_matmul.py).

It prints ms per call, weight GB/s and each path's speed-up over ``f16``. Run it on a quiet
machine:

    .venv/bin/python loadtest/bench_half_head.py [--rows 1,8,16] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable

import common.openmp  # noqa: F401  (before torch, run as a script too: OpenMP's wait policy)

# isort: split
import torch
import torch.nn.functional as F

from common.models.quant.half import HalfWeight
from kernels.cpu import quant as cpu_quant

HEAD_SHAPE = (49152, 576)  # SmolLM2-135M's vocabulary x hidden size


def best_ms(call: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` calls after three warm-ups, in ms."""
    for _ in range(3):
        call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def measure(rows: list[int], repeats: int) -> list[dict[str, float | int | str]]:
    torch.manual_seed(0)
    n, k = HEAD_SHAPE
    weight = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    heads = {"bf16": HalfWeight.of(weight), "f16": HalfWeight.of(weight.to(torch.float16))}
    dense = weight.float()
    results: list[dict[str, float | int | str]] = []
    for m in rows:
        x = torch.randn(m, k)
        timings = {
            name: best_ms(functools.partial(cpu_quant.half_x16_matmul, x, head.packed, head.n), repeats)
            for name, head in heads.items()
        }
        timings["fp32 gemm"] = best_ms(functools.partial(F.linear, x, dense), repeats)
        for name, ms in timings.items():
            held = dense.numel() * (4 if name == "fp32 gemm" else 2)
            results.append({
                "rows": m, "path": name, "ms": round(ms, 3),
                "gb_per_s": round(held / ms / 1e6, 1),
                "vs_f16": round(timings["f16"] / ms, 2),
            })  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,16", help="row counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    results = measure([int(r) for r in args.rows.split(",")], args.repeats)
    print(f"{'rows':>4}  {'path':<10} {'ms':>7} {'GB/s':>6} {'x f16':>6}")
    for r in results:
        print(f"{r['rows']:>4}  {r['path']:<10} {r['ms']:>7.3f} {r['gb_per_s']:>6} {r['vs_f16']:>6}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"shape": HEAD_SHAPE, "rows": results}, out, indent=1)


if __name__ == "__main__":
    main()
