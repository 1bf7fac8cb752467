"""Paged decode attention on the CPU (kernels/cpu's ``paged_decode_attention``): time per layer
for one sequence at several context lengths and for 16 sequences, on the default model's
heads (9 query heads, 3 kv heads, head dim 64), KV (float32, or ``--kv-dtype float16`` /
``bfloat16``) in blocks of 16 slots at shuffled places in the cache, as the block table
scatters a real context.

Each measurement cycles over 30 layers' caches (distinct memory, as a decode step reads
them), so K and V come from memory, not from a cache level a single layer would fit in. It
prints microseconds per layer, milliseconds per 30 layers (a step's attention) and the bytes
of K and V read per second. Run it on a quiet machine:

    .venv/bin/python loadtest/bench_attention.py [--cases 1x100,1x1000,16x170] [--threads 2] \
        [--kv-dtype float16]
"""

from __future__ import annotations

import argparse
import time

import common.openmp  # noqa: F401  (before torch, run as a script too: OpenMP's wait policy)

# isort: split
import torch

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30


def measure(
    ops: object, batch: int, context: int, repeats: int, dtype: torch.dtype
) -> dict[str, float]:
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = batch * blocks_per_seq + 1
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    caches = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(LAYERS)]
    order = torch.randperm(num_blocks)[: batch * blocks_per_seq]
    tables = order.view(batch, blocks_per_seq).to(torch.int32).contiguous()
    lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(batch, HEADS, HEAD_DIM)
    attend = ops.paged_decode_attention  # type: ignore[attr-defined]

    def step() -> float:
        start = time.perf_counter()
        for k, v in caches:
            attend(q, k, v, tables, lens, HEAD_DIM**-0.5, 0)
        return time.perf_counter() - start

    step()  # warm-up: threads, scratch buffers
    best = min(step() for _ in range(repeats))
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * dtype.itemsize
    return {
        "batch": batch, "context": context, "us_per_layer": best / LAYERS * 1e6,
        "ms_per_step": best * 1e3, "gb_s": kv_bytes * LAYERS / best / 1e9,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="1x100,1x230,1x500,1x1000,1x2000,16x170",
                        help="BATCHxCONTEXT, comma-separated")  # fmt: skip
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--kv-dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    args = parser.parse_args()
    from kernels.cpu import load

    ops = load()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"{args.threads} threads; heads {HEADS}/{KV_HEADS}, head dim {HEAD_DIM}, block {BLOCK}, "
          f"{LAYERS} layers; {args.kv_dtype} KV; AVX-512 path: {bool(ops.has_x16())}")  # fmt: skip
    for case in args.cases.split(","):
        batch, context = (int(x) for x in case.split("x"))
        r = measure(ops, batch, context, args.repeats, getattr(torch, args.kv_dtype))
        print(f"{batch:>3} x {context:>5} positions: {r['us_per_layer']:7.1f} us/layer, "
              f"{r['ms_per_step']:6.2f} ms/step, K+V {r['gb_s']:5.1f} GB/s")  # fmt: skip


if __name__ == "__main__":
    main()
