"""Benchmark kernels/ against their torch references and torch's fused attention.

    python -m loadtest.bench_kernels                 # on a CUDA machine
    python -m loadtest.bench_kernels --cpu-smoke     # tiny shapes on Triton's CPU interpreter,
                                                     # to check the script itself (timings mean nothing)

Each row reports time, achieved bandwidth (the bytes the operation must move at least, over
its time) and that bandwidth as a fraction of (a) a device-to-device copy measured in the same
run and (b) the device's datasheet number when the device is known. Attention rows also report
TFLOP/s. torch's SDPA runs on dense (unpaged) K/V, so it shows what paging costs.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import common.openmp  # noqa: F401  (before torch, run as a script too: OpenMP's wait policy)

# isort: split
import torch
import torch.nn.functional as F

# int8 / fp8 KV codes (kernels.QUANT_DTYPES; kernels is imported late, see main)
QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)

# Datasheet HBM bandwidth, bytes/s, matched against torch.cuda.get_device_name().
NOMINAL_BANDWIDTH = [
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100 NVL", 3.9e12),
    ("H100", 3.35e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100", 1.555e12),
    ("L40S", 0.864e12),
]


@dataclass(frozen=True)
class Sizes:
    batch: int  # decode sequences
    context: int  # decode context tokens per sequence
    long_context: int  # one sequence, to exercise split-K
    prefill_seqs: int
    prefill_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_layers: int  # pack_kv
    pack_blocks: int
    hidden: int  # rms_norm
    tokens: int  # rms_norm, rotary, write_kv


GPU_SIZES = Sizes(32, 4096, 32768, 4, 1024, 32, 8, 128, 16, 24, 256, 4096, 8192)
SMOKE_SIZES = Sizes(2, 40, 300, 2, 20, 4, 2, 16, 4, 2, 3, 32, 8)


@dataclass
class Row:
    name: str
    impl: str
    time_s: float
    bytes_moved: float
    flops: float = 0.0


class Bench:
    """Times callables on one device and collects rows."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rows: list[Row] = []

    def time(self, fn: Callable[[], object]) -> float:
        """Seconds per call: median of triton's do_bench (L2 flushed between calls) on CUDA."""
        if self.device.type == "cuda":
            import triton.testing

            ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            return float(ms) * 1e-3
        fn()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def add(
        self, name: str, impl: str, fn: Callable[[], object], moved: float, flops: float = 0.0
    ) -> None:
        self.rows.append(Row(name, impl, self.time(fn), moved, flops))


def _copy_bandwidth(bench: Bench, num_bytes: int) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device=bench.device)
    dst = torch.empty_like(src)
    return 2 * num_bytes / bench.time(lambda: dst.copy_(src))  # read + write


def _nominal_bandwidth(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for key, bw in NOMINAL_BANDWIDTH if key in name), None)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _paged(
    sizes: Sizes, seq_lens: list[int], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """(k_cache, v_cache, block_tables, seq_lens): seq_lens tokens per sequence, shuffled blocks."""
    s = sizes.block_size
    blocks = [-(-n // s) for n in seq_lens]
    num_blocks = sum(blocks)
    shape = (num_blocks, s, sizes.num_kv_heads, sizes.head_dim)
    # Quantized codes of magnitude ~20 (with scale 1/16 below) dequantize to about unit size.
    magnitude = 20.0 if dtype in QUANT_DTYPES else 1.0
    k_cache = (magnitude * torch.randn(shape, device=device)).to(dtype)
    v_cache = (magnitude * torch.randn(shape, device=device)).to(dtype)
    ids = torch.randperm(num_blocks, device=device, dtype=torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=device)
    start = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = ids[start : start + n]
        start += n
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return k_cache, v_cache, tables, lens


def bench_decode(bench: Bench, sizes: Sizes, batch: int, context: int) -> None:
    from kernels.kv_quant import new_kv_scales
    from kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_ref

    device = bench.device
    hq, hkv, d = sizes.num_q_heads, sizes.num_kv_heads, sizes.head_dim
    name = f"decode B={batch} ctx={context}"
    flops = 4.0 * batch * hq * context * d
    q = torch.randn(batch, hq, d, device=device, dtype=torch.float16)
    for dtype in (torch.float16, torch.int8, torch.float8_e4m3fn):
        kc, vc, tables, lens = _paged(sizes, [context] * batch, dtype, device)
        scale = None
        if dtype in QUANT_DTYPES:
            scale = new_kv_scales(kc.shape[0], hkv, device).fill_(1 / 16)
        moved = 2 * kc.numel() * kc.element_size() + 2 * q.numel() * 2 + tables.numel() * 4
        args = (q, kc, vc, tables, lens, d**-0.5)
        tag = f"triton {_dtype_name(dtype)}"
        auto = partial(paged_decode_attention, *args, k_scale=scale, v_scale=scale)
        bench.add(name, f"{tag} auto-split", auto, moved, flops)
        one = partial(paged_decode_attention, *args, k_scale=scale, v_scale=scale, num_splits=1)
        bench.add(name, f"{tag} 1 split", one, moved, flops)
    kc, vc, tables, lens = _paged(sizes, [context] * batch, torch.float16, device)
    ref = partial(paged_decode_attention_ref, q, kc, vc, tables, lens, d**-0.5)
    moved = 2 * kc.numel() * 2 + 2 * q.numel() * 2
    bench.add(name, "torch reference fp16", ref, moved, flops)
    k = torch.randn(batch, hkv, context, d, device=device, dtype=torch.float16)  # dense
    v = torch.randn_like(k)
    q4 = q[:, :, None, :]  # [B, Hq, 1, D]
    sdpa = partial(F.scaled_dot_product_attention, q4, k, v, enable_gqa=True)
    bench.add(name, "torch SDPA dense fp16", sdpa, moved, flops)


def bench_prefill(bench: Bench, sizes: Sizes) -> None:
    from kernels.paged_prefill_attention import paged_prefill_attention, paged_prefill_attention_ref

    device = bench.device
    n, length = sizes.prefill_seqs, sizes.prefill_len
    hq, hkv, d = sizes.num_q_heads, sizes.num_kv_heads, sizes.head_dim
    kc, vc, tables, lens = _paged(sizes, [length] * n, torch.float16, device)
    q = torch.randn(n * length, hq, d, device=device, dtype=torch.float16)
    qsl = torch.arange(0, n * length + 1, length, dtype=torch.int32, device=device)
    name = f"prefill {n}x{length}"
    moved = 2 * q.numel() * 2 + 2 * kc.numel() * 2
    flops = 4.0 * n * hq * d * length * (length + 1) / 2  # causal: half the square
    args = (q, kc, vc, tables, qsl, lens, d**-0.5)
    bench.add(name, "triton fp16", partial(paged_prefill_attention, *args), moved, flops)
    bench.add(name, "torch reference", partial(paged_prefill_attention_ref, *args), moved, flops)
    qd = q.view(n, length, hq, d).transpose(1, 2)  # [n, Hq, len, D]
    k = torch.randn(n, hkv, length, d, device=device, dtype=torch.float16)
    v = torch.randn_like(k)
    sdpa = partial(F.scaled_dot_product_attention, qd, k, v, is_causal=True, enable_gqa=True)
    bench.add(name, "torch SDPA dense", sdpa, moved, flops)


def bench_elementwise(bench: Bench, sizes: Sizes) -> None:
    """rms_norm, rotary, write_kv (float and quantized), pack_kv."""
    import kernels as K

    device = bench.device
    t, hq, hkv, d = sizes.tokens, sizes.num_q_heads, sizes.num_kv_heads, sizes.head_dim
    s = sizes.block_size

    x = torch.randn(t, sizes.hidden, device=device, dtype=torch.float16)
    res, w = torch.randn_like(x), torch.randn_like(x[0])
    moved = 4 * x.numel() * 2  # x, residual in; out, new residual out
    name = f"rms_norm+residual T={t} H={sizes.hidden}"
    bench.add(name, "triton", partial(K.rms_norm, x, w, 1e-6, res), moved)
    bench.add(name, "torch reference", partial(K.rms_norm_ref, x, w, 1e-6, res), moved)

    q = torch.randn(t, hq, d, device=device, dtype=torch.float16)
    k = torch.randn(t, hkv, d, device=device, dtype=torch.float16)
    pos = torch.randint(0, 4096, (t,), device=device)
    cos_sin = torch.randn(4096, d, device=device)
    moved = 2 * (q.numel() + k.numel()) * 2 + t * d * 4
    bench.add(f"rotary T={t}", "triton", partial(K.apply_rotary, q, k, pos, cos_sin), moved)
    rotary_ref = partial(K.apply_rotary_ref, q, k, pos, cos_sin)
    bench.add(f"rotary T={t}", "torch reference", rotary_ref, moved)

    num_blocks = 2 * t // s + 1
    slots = torch.randperm(num_blocks * s, device=device)[:t].sort().values
    for dtype in (torch.float16, *QUANT_DTYPES):
        kc = torch.zeros(num_blocks, s, hkv, d, device=device).to(dtype)
        vc = torch.zeros_like(kc)
        ks = vs = None
        if dtype in QUANT_DTYPES:
            ks, vs = (
                K.new_kv_scales(num_blocks, hkv, device),
                K.new_kv_scales(num_blocks, hkv, device),
            )
        moved = 2 * k.numel() * (2 + kc.element_size())  # read fp16 k, v; write the cache
        name = f"write_kv T={t} {_dtype_name(dtype)}"
        bench.add(name, "triton", partial(K.write_kv, k, k, kc, vc, slots, ks, vs), moved)
        bench.add(
            name, "torch reference", partial(K.write_kv_ref, k, k, kc, vc, slots, ks, vs), moved
        )

    cache_blocks = max(4 * sizes.pack_blocks, 16)
    cache = torch.randn(
        sizes.num_layers, 2, cache_blocks, s, hkv, d, device=device, dtype=torch.float16
    )
    ids = torch.randperm(cache_blocks, device=device)[: sizes.pack_blocks]
    moved = 2 * sizes.pack_blocks * cache[:, :, 0].numel() * 2
    name = f"pack_kv n={sizes.pack_blocks} L={sizes.num_layers}"
    bench.add(name, "triton", partial(K.pack_kv, cache, ids), moved)
    bench.add(name, "torch reference", partial(K.pack_kv_ref, cache, ids), moved)


def _print(rows: list[Row], copy_bw: float, nominal: float | None) -> None:
    columns = ("kernel", "impl", "time_us", "GB/s", "%copy", "%nominal", "TFLOP/s")
    line = "{:<34} {:<32} {:>10} {:>8} {:>7} {:>9} {:>8}"
    print(line.format(*columns))
    for r in rows:
        bw = r.bytes_moved / r.time_s
        print(
            line.format(
                r.name,
                r.impl,
                f"{r.time_s * 1e6:.1f}",
                f"{bw / 1e9:.1f}",
                f"{100 * bw / copy_bw:.1f}%",
                f"{100 * bw / nominal:.1f}%" if nominal else "n/a",
                f"{r.flops / r.time_s / 1e12:.2f}" if r.flops else "",
            )
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="tiny shapes on the CPU interpreter"
    )
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        # Must be set before triton is imported (by kernels, below).
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device, sizes = torch.device("cpu"), SMOKE_SIZES
    elif torch.cuda.is_available():
        device, sizes = torch.device("cuda"), GPU_SIZES
    else:
        print("bench_kernels needs a CUDA device (or --cpu-smoke to check the script); skipping.")
        return 0
    torch.manual_seed(0)
    bench = Bench(device)
    copy_bw = _copy_bandwidth(bench, 1 << 30 if device.type == "cuda" else 1 << 20)
    nominal = _nominal_bandwidth(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    print(f"device: {name}   measured D2D copy: {copy_bw / 1e9:.0f} GB/s", end="")
    print(f"   nominal: {nominal / 1e9:.0f} GB/s" if nominal else "   nominal: unknown")
    bench_decode(bench, sizes, sizes.batch, sizes.context)
    bench_decode(bench, sizes, 1, sizes.long_context)
    bench_prefill(bench, sizes)
    bench_elementwise(bench, sizes)
    _print(bench.rows, copy_bw, nominal)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
