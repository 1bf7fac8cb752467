"""Quantized matmuls on the CPU: every path on the default model's 30 layers, same run.

For each row count M (1 = a decode step of one sequence, 16 = sixteen sequences, 256 = a
prefill chunk) it times the projections of all 30 decoder layers (q/k/v fused, o, gate/up
fused, down; distinct weights per layer, so they stream from memory as in a real step) and
the output head, for:

- ``fp32``: the float32 weights and torch's GEMM (what ``--quantization none`` reads);
- ``q4 cpp`` / ``q8 cpp``: kernels/cpu/quant_matmul.cpp on packed weights;
- ``q4 torch``: torch's ``_weight_int4pack_mm_for_cpu`` (bfloat16 activations);
- ``q8 torch``: torch's ``_weight_int8pack_mm`` (per-channel int8, bfloat16 activations);
- ``q4 dense``: dequantize the packed weight, then torch's float32 GEMM (the large-M path).

It prints ms per step, the weight bytes read per ms (GB/s) and each path's ratio to fp32;
the crossover between ``q4 cpp`` and ``q4 dense`` sets common/models/quant/linear.py's
DENSE_MIN_ROWS. Run it on a quiet machine:

    .venv/bin/python loadtest/bench_quant.py [--rows 1,4,16,64,256] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from common.models.quant.linear import PackedMatmul, QuantCompute, _dense_in_chunks
from common.models.quant.weights import Q4Weight, Q8Weight

# SmolLM2-135M: hidden 576, 9 query / 3 kv heads of 64, MLP 1536, vocab 49152, 30 layers.
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K)
HEAD_SHAPE = (49152, 576)
NUM_LAYERS = 30


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``repeats`` calls after two warm-ups."""
    fn()
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="1,4,16,32,48,64,256", help="row counts M")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    floats = [[torch.randn(n, k) * 0.02 for n, k in LAYER_SHAPES] for _ in range(NUM_LAYERS)]
    head = torch.randn(*HEAD_SHAPE) * 0.02
    q4 = [[Q4Weight.quantize(w, 32) for w in layer] for layer in floats]
    q8_head = Q8Weight.quantize_per_channel(head)
    q8 = [[Q8Weight.quantize_per_channel(w) for w in layer] for layer in floats]
    paths: dict[str, tuple[list[Callable[[torch.Tensor], torch.Tensor]], int]] = {}

    def add(name: str, layers: list, head_fn: Callable | None, num_bytes: int) -> None:
        fns = [fn for layer in layers for fn in layer]
        if head_fn is not None:
            fns.append(head_fn)
        paths[name] = (fns, num_bytes)

    fp32_bytes = sum(w.numel() * 4 for layer in floats for w in layer) + head.numel() * 4
    add("fp32", [[(lambda x, w=w: x @ w.t()) for w in layer] for layer in floats],
        lambda x: x @ head.t(), fp32_bytes)  # fmt: skip
    q4_bytes = sum(w.num_bytes for layer in q4 for w in layer) + q8_head.num_bytes
    q8_bytes = sum(w.num_bytes for layer in q8 for w in layer) + q8_head.num_bytes
    head_cpp = PackedMatmul(q8_head, QuantCompute("cpp"))
    head_torch = PackedMatmul(q8_head, QuantCompute("torch"))
    add("q4 cpp", [[PackedMatmul(w, QuantCompute("cpp")) for w in layer] for layer in q4], head_cpp, q4_bytes)
    add("q4 torch", [[PackedMatmul(w, QuantCompute("torch")) for w in layer] for layer in q4], head_torch,
        q4_bytes)  # fmt: skip
    add("q4 dense", [[(lambda x, w=w: _dense_in_chunks(x, w)) for w in layer] for layer in q4],
        head_cpp, q4_bytes)  # fmt: skip
    add("q8 cpp", [[PackedMatmul(w, QuantCompute("cpp")) for w in layer] for layer in q8], head_cpp, q8_bytes)
    add("q8 torch", [[PackedMatmul(w, QuantCompute("torch")) for w in layer] for layer in q8], head_torch,
        q8_bytes)  # fmt: skip

    results: dict[str, dict[str, float]] = {}
    print(f"threads {torch.get_num_threads()}; 30 layers' projections + the output head")
    for m in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(m, k) for k in (576, 1536)}
        row: dict[str, float] = {}
        for name, (fns, num_bytes) in paths.items():
            if name == "q4 dense" and m < 16:
                continue

            def step(fns: list = fns) -> None:
                for fn, (n, k) in zip(fns, (LAYER_SHAPES * NUM_LAYERS) + [HEAD_SHAPE], strict=True):
                    fn(xs[k])

            seconds = timed(step, args.repeats)
            row[name] = seconds * 1e3
            results[f"M={m}"] = row
        base = row["fp32"]
        cells = [
            f"{name} {ms:6.1f} ms ({paths[name][1] / ms / 1e6:4.1f} GB/s, {base / ms:4.2f}x)"
            for name, ms in row.items()
        ]
        print(f"M={m:4d}: " + "; ".join(cells))
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
