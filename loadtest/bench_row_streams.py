"""A lone row's matmuls with its weights read in 4 runs a thread against 1
(``kernels.cpu.quant.set_row_streams``), the two alternated in one process: 30 layers of
SmolLM2-135M's four projections (fused q/k/v 960 x 576, o 576 x 576, gate/up 3072 x 576,
down 576 x 1536) per weight type, distinct random weights per layer, and before every step
``--evict-mb`` of other memory read, so the weights come from DRAM as in a decode step.
Both arms give the same bits (checked first); it prints each arm's median step.

    .venv/bin/python loadtest/bench_row_streams.py --types q4_0,q4_1,Q6_K,Q5_0 --act-bits 8

A type is ``q4_0`` / ``q4_1`` / ``q8_0`` (the x16 layouts: symmetric Q4, Q4 with mins, Q8) or
a KQx16 type (``Q4_K``, ``Q6_K``, ``Q5_0``, ...); K-quants whose blocks are 256 wide take
only the down projection (576 is not a multiple of 256). Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# isort: split
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.cpu import quant as cpu_quant
from kernels.cpu.kquant import kq_x16_matmul
from loadtest.bench_kquant import random_weight

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
X16_TYPES = ("q4_0", "q4_1", "q8_0")


def x16_layers(type_name: str, layers: int, act_bits: int, gen: torch.Generator) -> tuple[list[Callable[[], torch.Tensor]], int]:
    """One closure per matmul of the x16 layouts, and the bytes they read."""
    calls: list[Callable[[], torch.Tensor]] = []
    total = 0
    xs = {k: torch.randn(1, k, generator=gen) for _, k in SHAPES}
    for _ in range(layers):
        for n, k in SHAPES:
            scales = (torch.rand(n, k // 32, generator=gen) * 0.01 + 0.001).half()
            x = xs[k]
            if type_name == "q8_0":
                codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
                packed, lanes = cpu_quant.pack_q8_x16(codes, scales)
                total += packed.numel() + lanes.numel() * 2
                calls.append(partial(cpu_quant.q8x16_matmul, x, packed, lanes, 32, n, act_bits))
                continue
            codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
            mins = scales.float().mul(-8).half() if type_name == "q4_0" else (torch.rand(n, k // 32, generator=gen) * -0.01).half()
            packed, lanes, held = cpu_quant.pack_q4_x16(codes, scales, mins)
            total += packed.numel() + (lanes.numel() + held.numel()) * 2
            calls.append(partial(cpu_quant.q4x16_matmul, x, packed, lanes, held, 32, n, act_bits))
    return calls, total


def kq_layers(type_name: str, layers: int, act_bits: int, gen: torch.Generator) -> tuple[list[Callable[[], torch.Tensor]], int]:
    from common.models.quant.kquants import KQUANT_TYPES

    per_block = KQUANT_TYPES[type_name][0]
    shapes = [(n, k) for n, k in SHAPES if k % per_block == 0]
    xs = {k: torch.randn(1, k, generator=gen) for _, k in shapes}
    calls: list[Callable[[], torch.Tensor]] = []
    total = 0
    for i in range(layers):
        for s, (n, k) in enumerate(shapes):
            w = random_weight(type_name, n, k, seed=10 * i + s)
            held = [*w.planes, *(t for t in (w.d, w.sc, w.dmin, w.m) if t is not None)]
            total += sum(t.numel() * t.element_size() for t in held)
            calls.append(partial(kq_x16_matmul, xs[k], w, act_bits))
    return calls, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", default="q4_0,q4_1,q8_0,Q6_K,Q5_0")
    parser.add_argument("--act-bits", type=int, default=8)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6, help="alternations of the two arms")
    parser.add_argument("--steps", type=int, default=8, help="steps an arm per round")
    parser.add_argument("--evict-mb", type=int, default=96)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    other = torch.ones(args.evict_mb << 18, dtype=torch.int32)
    print(f"{args.layers} layers of one row, {args.threads} threads, {args.act_bits}-bit codes, "
          f"{args.evict_mb} MB read before each step; median step, ms")  # fmt: skip
    for type_name in args.types.split(","):
        gen = torch.Generator().manual_seed(0)
        build = x16_layers if type_name in X16_TYPES else kq_layers
        calls, total = build(type_name, args.layers, args.act_bits, gen)
        cpu_quant.set_row_streams(True)
        runs = [c() for c in calls]
        cpu_quant.set_row_streams(False)
        one = [c() for c in calls]
        assert all(torch.equal(a, b) for a, b in zip(runs, one, strict=True)), "the arms' bits differ"
        times: dict[bool, list[float]] = {True: [], False: []}
        try:
            for r in range(args.rounds):
                for on in (True, False) if r % 2 == 0 else (False, True):
                    cpu_quant.set_row_streams(on)
                    for _ in range(args.steps):
                        other.sum()
                        start = time.perf_counter()
                        for c in calls:
                            c()
                        times[on].append(time.perf_counter() - start)
        finally:
            cpu_quant.set_row_streams(True)
        arms = {on: statistics.median(t) for on, t in times.items()}
        print(f"{type_name}: {total / 1e6:.1f} MB, 4 runs {arms[True] * 1e3:.2f} "
              f"({total / arms[True] / 1e9:.1f} GB/s), 1 run {arms[False] * 1e3:.2f} "
              f"({total / arms[False] / 1e9:.1f} GB/s), ratio {arms[False] / arms[True]:.2f}",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
