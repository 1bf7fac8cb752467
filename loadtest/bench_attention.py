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


def measure_prefill(ops: object, prompt: int, repeats: int, dtype: torch.dtype) -> dict[str, float]:
    """A fresh causal prompt of ``prompt`` tokens, per layer: the decode kernel serving one
    row per prompt token (row j attends to j + 1 positions, as the cpp backend runs a
    prefill chunk), against torch's ``scaled_dot_product_attention`` (is_causal, the torch
    backend's path for a fresh prompt) on the same K and V, contiguous."""
    import torch.nn.functional as F

    blocks = -(-prompt // BLOCK)
    shape = (blocks + 1, BLOCK, KV_HEADS, HEAD_DIM)
    caches = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(LAYERS)]
    table = torch.randperm(blocks + 1)[:blocks].to(torch.int32)
    tables = table.expand(prompt, blocks).contiguous()
    lens = torch.arange(1, prompt + 1, dtype=torch.int32)
    q = torch.randn(prompt, HEADS, HEAD_DIM)
    dense = []
    for k, v in caches:  # [1, Hkv, T, D], as the torch backend lays a fresh prompt out
        rows = table.long()[:, None] * BLOCK + torch.arange(BLOCK)
        flat = rows.flatten()[:prompt]
        dense.append(tuple(c.view(-1, KV_HEADS, HEAD_DIM)[flat].float().transpose(0, 1)[None]
                           for c in (k, v)))  # fmt: skip
    qd = q.transpose(0, 1)[None]

    def kernel() -> float:
        start = time.perf_counter()
        for k, v in caches:
            ops.paged_decode_attention(q, k, v, tables, lens, HEAD_DIM**-0.5, 0)  # type: ignore[attr-defined]
        return time.perf_counter() - start

    def sdpa() -> float:
        start = time.perf_counter()
        for k, v in dense:
            F.scaled_dot_product_attention(qd, k, v, is_causal=True, scale=HEAD_DIM**-0.5,
                                           enable_gqa=True)  # fmt: skip
        return time.perf_counter() - start

    kernel(), sdpa()  # warm-up
    times_k, times_s = [], []
    for _ in range(repeats):  # alternated
        times_k.append(kernel())
        times_s.append(sdpa())
    return {"prompt": prompt, "kernel_us_per_layer": min(times_k) / LAYERS * 1e6,
            "sdpa_us_per_layer": min(times_s) / LAYERS * 1e6}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="1x100,1x230,1x500,1x1000,1x2000,16x170",
                        help="BATCHxCONTEXT, comma-separated")  # fmt: skip
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--kv-dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--prefill", default="",
                        help="PROMPT,...: also fresh prompts of these lengths, the decode kernel "
                        "against scaled_dot_product_attention")  # fmt: skip
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
    for prompt in (int(x) for x in args.prefill.split(",") if x):
        r = measure_prefill(ops, prompt, args.repeats, getattr(torch, args.kv_dtype))
        print(f"prefill {prompt:>5} tokens: kernel {r['kernel_us_per_layer']:8.1f} us/layer, "
              f"sdpa {r['sdpa_us_per_layer']:8.1f} us/layer, kernel / sdpa "
              f"{r['kernel_us_per_layer'] / r['sdpa_us_per_layer']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
