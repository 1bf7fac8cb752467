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


def measure_prefill(prefix: int, chunk: int, repeats: int, dtype: torch.dtype) -> dict[str, float]:
    """One prefill chunk of ``chunk`` tokens after ``prefix`` cached ones (0: a fresh prompt),
    per layer, through the cpp attention backend both ways it attends prompt tokens
    (prefill_attention kernel: one decode query per token; sdpa: the torch backend's
    scaled_dot_product_attention, over the chunk's own K/V when fresh, else over the
    gathered context), the K/V write included in both."""
    from common.engine.attention.base import AttentionBatch, LayerKV
    from common.engine.attention.cpp_backend import CppAttentionBackend

    total = prefix + chunk
    blocks = -(-total // BLOCK)
    shape = (blocks + 1, BLOCK, KV_HEADS, HEAD_DIM)
    caches = [LayerKV(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype))
              for _ in range(LAYERS)]  # fmt: skip
    table = torch.randperm(blocks + 1)[:blocks].to(torch.int32)
    positions = torch.arange(prefix, total)
    batch = AttentionBatch(
        slot_mapping=table.long()[positions // BLOCK] * BLOCK + positions % BLOCK,
        num_decode_tokens=0, decode_block_tables=torch.empty(0, blocks, dtype=torch.int32),
        decode_seq_lens=torch.empty(0, dtype=torch.int32), prefill_block_tables=table[None],
        prefill_query_start_loc=torch.tensor([0, chunk], dtype=torch.int32),
        prefill_seq_lens=torch.tensor([total], dtype=torch.int32), max_decode_seq_len=0,
        prefill_query_lens_host=[chunk], prefill_seq_lens_host=[total],
    )  # fmt: skip
    q = torch.randn(chunk, HEADS, HEAD_DIM)
    k, v = torch.randn(chunk, KV_HEADS, HEAD_DIM), torch.randn(chunk, KV_HEADS, HEAD_DIM)
    backends = {mode: CppAttentionBackend(None, mode) for mode in ("kernel", "sdpa")}

    def layers(backend: CppAttentionBackend) -> float:
        start = time.perf_counter()
        metadata = backend.prepare(batch, BLOCK)
        for kv in caches:
            backend.forward(q, k, v, kv, metadata, HEAD_DIM**-0.5)
        return time.perf_counter() - start

    for backend in backends.values():  # warm-up
        layers(backend)
    times: dict[str, list[float]] = {mode: [] for mode in backends}
    for _ in range(repeats):  # alternated
        for mode, backend in backends.items():
            times[mode].append(layers(backend))
    return {"prefix": prefix, "chunk": chunk,
            "kernel_us_per_layer": min(times["kernel"]) / LAYERS * 1e6,
            "sdpa_us_per_layer": min(times["sdpa"]) / LAYERS * 1e6}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="1x100,1x230,1x500,1x1000,1x2000,16x170",
                        help="BATCHxCONTEXT, comma-separated")  # fmt: skip
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--kv-dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--prefill", default="",
                        help="CHUNK or PREFIX+CHUNK,...: also prefill chunks (fresh, or after "
                        "PREFIX cached tokens) through the cpp backend's two ways of attending "
                        "prompt tokens: the decode kernel and SDPA")  # fmt: skip
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
    for case in (x for x in args.prefill.split(",") if x):
        prefix, _, chunk = case.rpartition("+")
        r = measure_prefill(int(prefix or 0), int(chunk), args.repeats,
                            getattr(torch, args.kv_dtype))  # fmt: skip
        print(f"prefill {case:>10} tokens: kernel {r['kernel_us_per_layer']:8.1f} us/layer, "
              f"sdpa {r['sdpa_us_per_layer']:8.1f} us/layer, kernel / sdpa "
              f"{r['kernel_us_per_layer'] / r['sdpa_us_per_layer']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
