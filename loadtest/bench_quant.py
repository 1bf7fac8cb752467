"""Quantized matmuls on the CPU: every path on the default model's shapes, same run.

For each row count M (1 = a decode step of one sequence, 16 = sixteen sequences, 256 = a
prefill chunk) it times the projections of all 30 decoder layers (q/k/v fused, o, gate/up
fused, down; distinct weights per layer, so they stream from memory as in a real step) and
the output head, for:

- ``fp32``: float32 weights and torch's GEMM (what ``--quantization none`` reads);
- ``q4 cpp a16`` / ``a8``: kernels/cpu/quant_matmul.cpp on Q4 weights (group 32, the head in
  Q8_0 as in the shipped GGUF), x quantized to 16- or 8-bit codes inside;
- ``q4 x16`` / ``q8 x16``: kernels/cpu/quant_x16.cpp on the same weights in the x16 layout
  (16 rows interleaved; int16 codes of x; only where the CPU has AVX-512 BW / VL and VNNI),
  which the engine takes there at every row count; ``... x16 a8`` with int8 codes of x per
  32 (``--quant-act-bits 8``: vpdpbusd);
- ``q5_0 kq a16`` / ``a8``: kernels/cpu/kquant_x16.cpp on GGUF Q5_0 weights (what most of
  SmolLM2's Q4_K_M file holds, its 576-wide rows being no multiple of 256), the head Q8_0 x16
  at the same activation bits;
- ``q8 cpp a16`` / ``a8``: the same kernels on per-channel int8 weights (``--quantization
  int8``);
- ``q4 torch``: torch's ``_weight_int4pack_mm_for_cpu`` (bfloat16 activations);
- ``q8 torch``: torch's ``_weight_int8pack_mm`` (per-channel int8, bfloat16 activations);
- ``q4 dense``: dequantize each Q4 weight in chunks, then torch's float32 GEMM (the path
  common/models/quant/linear.py takes from DENSE_MIN_ROWS rows).

It prints ms per step, weight bytes read per ms (GB/s) and each path's speed-up over fp32;
the crossover of ``q4 cpp`` and ``q4 dense`` sets DENSE_MIN_ROWS. Variants of the kernel
tried and dropped (measured the same way, A/B in one process): float32 activations with the
codes converted per element (about 2x slower at M = 1); a reduction of 8 sub-blocks per
scale multiply with hadd (1.4-1.7x slower); a software prefetch of the next rows (no gain).
Run it on a quiet machine:

    .venv/bin/python loadtest/bench_quant.py [--rows 1,4,16,32,48,64,256] [--threads 2]
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable, Sequence

import common.openmp  # noqa: F401  (before torch, run as a script too: OpenMP's wait policy)

# isort: split
import torch

from common.models.quant.kquants import read_kq_x16
from common.models.quant.linear import PackedMatmul, QuantCompute, _dense_in_chunks
from common.models.quant.weights import Q4Weight, Q8Weight, QuantWeight
from kernels.cpu import quant as cpu_quant
from kernels.cpu.kquant import KQx16, kq_x16_matmul

# SmolLM2-135M: hidden 576, 9 query / 3 kv heads of 64, MLP 1536, vocab 49152, 30 layers.
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K)
HEAD_SHAPE = (49152, 576)
NUM_LAYERS = 30

Matmul = Callable[[torch.Tensor], torch.Tensor]


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``repeats`` calls after a warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def packed_kernel(weight: Q4Weight | Q8Weight, act_bits: int) -> Matmul:
    """The C++ kernel at every M (no switch to the dense path)."""
    if isinstance(weight, Q4Weight):
        return lambda x: cpu_quant.q4_matmul(
            x, weight.qweight, weight.scales, weight.mins, weight.group_size, act_bits
        )
    return lambda x: cpu_quant.q8_matmul(x, weight.qweight, weight.scales, weight.group_size,
                                         act_bits)  # fmt: skip


def x16_kernel(weight: Q4Weight | Q8Weight, act_bits: int = 16) -> Matmul:
    """The x16 kernel (the weight repacked once)."""
    packed, n = weight.to_x16(), weight.shape[0]
    if isinstance(packed, Q4Weight):
        return lambda x: cpu_quant.q4x16_matmul(
            x, packed.qweight, packed.scales, packed.mins, packed.group_size, n, act_bits
        )
    return lambda x: cpu_quant.q8x16_matmul(x, packed.qweight, packed.scales,
                                            packed.group_size, n, act_bits)  # fmt: skip


def q5_0_weight(w: torch.Tensor) -> KQx16:
    """``w`` quantized to GGUF Q5_0 by the gguf package, read into the KQx16 layout."""
    from gguf import GGMLQuantizationType, quants

    raw = quants.quantize(w.numpy(), GGMLQuantizationType.Q5_0)
    return read_kq_x16("Q5_0", raw, w.shape[0], w.shape[1])


def _float_matmul(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return x @ weight.t()


class Path:
    """One way to run a step's matmuls: one function per weight, and the bytes they read."""

    def __init__(self, fns: list[Matmul], num_bytes: int) -> None:
        self.fns = fns
        self.num_bytes = num_bytes

    def step(self, inputs: dict[int, torch.Tensor]) -> None:
        shapes = LAYER_SHAPES * NUM_LAYERS + [HEAD_SHAPE]
        for fn, (_, k) in zip(self.fns, shapes, strict=True):
            fn(inputs[k])


def build_paths() -> dict[str, Path]:
    torch.manual_seed(0)
    floats = [torch.randn(n, k) * 0.02 for _ in range(NUM_LAYERS) for n, k in LAYER_SHAPES]
    head = torch.randn(*HEAD_SHAPE) * 0.02
    q4 = [Q4Weight.quantize(w, 32) for w in floats]
    q8 = [Q8Weight.quantize_per_channel(w) for w in floats]
    head_q8_0 = Q8Weight(  # the shipped file's head: Q8_0, a scale per 32
        torch.randint(-127, 128, HEAD_SHAPE, dtype=torch.int8),
        (torch.rand(HEAD_SHAPE[0], HEAD_SHAPE[1] // 32) * 0.001).half(), 32,
    )  # fmt: skip
    head_q8 = Q8Weight.quantize_per_channel(head)

    def weight_bytes(ws: Sequence[QuantWeight], h: QuantWeight) -> int:
        return sum(w.num_bytes for w in ws) + h.num_bytes

    dense = [*floats, head]
    paths = {"fp32": Path([functools.partial(_float_matmul, w) for w in dense],
                          sum(w.numel() * 4 for w in dense))}  # fmt: skip
    cpp_q4: list[Q4Weight | Q8Weight] = [*q4, head_q8_0]
    for bits in (16, 8):
        paths[f"q4 cpp a{bits}"] = Path(
            [packed_kernel(w, bits) for w in cpp_q4], weight_bytes(q4, head_q8_0)
        )
        paths[f"q8 cpp a{bits}"] = Path(
            [packed_kernel(w, bits) for w in [*q8, head_q8]], weight_bytes(q8, head_q8)
        )
    if cpu_quant.has_x16():
        for bits in (16, 8):
            tag = "" if bits == 16 else " a8"
            paths[f"q4 x16{tag}"] = Path(
                [x16_kernel(w, bits) for w in cpp_q4], weight_bytes(q4, head_q8_0)
            )
            paths[f"q8 x16{tag}"] = Path(
                [x16_kernel(w, bits) for w in [*q8, head_q8]], weight_bytes(q8, head_q8)
            )
        q5 = [q5_0_weight(w) for w in floats]
        q5_bytes = sum(w.num_bytes for w in q5) + head_q8_0.num_bytes
        for bits in (16, 8):
            paths[f"q5_0 kq a{bits}"] = Path(
                [functools.partial(kq_x16_matmul, w=w, act_bits=bits) for w in q5]
                + [x16_kernel(head_q8_0, bits)],
                q5_bytes,
            )
    torch_compute = QuantCompute("torch")
    torch_q4: list[QuantWeight] = [*q4, head_q8]
    torch_q8: list[QuantWeight] = [*q8, head_q8]
    paths["q4 torch"] = Path([PackedMatmul(w, torch_compute) for w in torch_q4],
                             weight_bytes(q4, head_q8))  # fmt: skip
    paths["q8 torch"] = Path([PackedMatmul(w, torch_compute) for w in torch_q8],
                             weight_bytes(q8, head_q8))  # fmt: skip
    paths["q4 dense"] = Path(
        [(lambda x, w=w: _dense_in_chunks(x, w)) for w in q4] + [packed_kernel(head_q8_0, 16)],
        weight_bytes(q4, head_q8_0),
    )
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="1,4,16,32,48,64,256", help="row counts M")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    paths = build_paths()
    results: dict[str, dict[str, float]] = {}
    print(f"{torch.get_num_threads()} threads; 30 layers' projections + the output head, ms")
    for m in [int(r) for r in args.rows.split(",")]:
        inputs = {k: torch.randn(m, k) for k in (576, 1536)}
        row: dict[str, float] = {}
        for name, path in paths.items():
            if name == "q4 dense" and m < 16:
                continue
            row[name] = timed(functools.partial(path.step, inputs), args.repeats) * 1e3
        results[f"M={m}"] = row
        base = row["fp32"]
        cells = [
            f"{name} {ms:.1f} ({paths[name].num_bytes / ms / 1e6:.1f} GB/s, {base / ms:.2f}x)"
            for name, ms in row.items()
        ]
        print(f"M={m}: " + "; ".join(cells))
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
