"""The x16 kernels' 8-bit tiles of 16 rows on AMX against the same kernels on AVX-512 alone
(kernels/cpu/quant_x16.cpp ``x16_wide_i8_amx`` / ``x16_wide_i8``), on SmolLM2's shapes: a
layer's projections (Q4, as the shipped Q4_1 file holds them) and the 49152 x 576 Q8_0 head,
per row count M. Both paths give the same bits (tests/kernels/test_amx.py); this measures
their speed in one process, alternating, the weights hot in cache for the layer shapes and
streamed for the head.

    .venv/bin/python loadtest/bench_amx.py [--rows 16,32,64] [--repeats 50] [--json out.json]

Needs a CPU with AMX (amx_tile, amx_int8) that Linux lets use it; run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import common.openmp  # noqa: F401  (before torch, run as a script too: OpenMP's wait policy)

# isort: split
import torch

from kernels.cpu import quant as cpu_quant

# name, N, K, format: SmolLM2-135M's shapes
SHAPES = [
    ("qkv", 960, 576, "q4"),
    ("gate_up", 3072, 576, "q4"),
    ("down", 576, 1536, "q4"),
    ("head", 49152, 576, "q8"),
]


def matmul_of(n: int, k: int, fmt: str, gen: torch.Generator) -> Callable[[torch.Tensor], torch.Tensor]:
    if fmt == "q4":
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        scales = (0.02 + 0.2 * torch.rand(n, k // 32, generator=gen)).half()
        mins = (-8 * scales.float() + 0.3 * torch.randn(n, k // 32, generator=gen)).half()
        packed, s, m = cpu_quant.pack_q4_x16(cpu_quant.pack_q4_codes(codes), scales, mins)
        return lambda x: cpu_quant.q4x16_matmul(x, packed, s, m, 32, n, 8)
    codes8 = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales8 = (0.001 + 0.02 * torch.rand(n, k // 32, generator=gen)).half()
    packed8, s8 = cpu_quant.pack_q8_x16(codes8, scales8)
    return lambda x: cpu_quant.q8x16_matmul(x, packed8, s8, 32, n, 8)


def ms_per_call(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, repeats: int) -> float:
    fn(x)
    start = time.perf_counter()
    for _ in range(repeats):
        fn(x)
    return (time.perf_counter() - start) / repeats * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="16,32,64")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3, help="alternations; the best of each path")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not cpu_quant.has_x16() or not cpu_quant.amx_available():
        raise SystemExit("no AMX int8 tiles here (or the kernel refused them)")
    gen = torch.Generator().manual_seed(0)
    results = []
    print(f"{'shape':>8} {'N x K':>12} {'M':>4} {'AVX-512 ms':>11} {'AMX ms':>8} {'ratio':>6}")
    try:
        for name, n, k, fmt in SHAPES:
            fn = matmul_of(n, k, fmt, gen)
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, generator=gen)
                best = {False: float("inf"), True: float("inf")}
                for _ in range(args.rounds):
                    for on in (False, True):
                        cpu_quant.set_amx(on)
                        best[on] = min(best[on], ms_per_call(fn, x, args.repeats))
                ratio = best[False] / best[True]
                results.append({"shape": name, "n": n, "k": k, "format": fmt, "rows": m,
                                "avx512_ms": best[False], "amx_ms": best[True], "ratio": ratio})  # fmt: skip
                print(f"{name:>8} {f'{n} x {k}':>12} {m:>4} {best[False]:11.3f} {best[True]:8.3f} {ratio:5.2f}x",
                      flush=True)  # fmt: skip
    finally:
        cpu_quant.set_amx(True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
