"""Factories for the kernel tests: paged caches with known dense contents, and dense attention.

# B = sequences, L = tokens of a sequence, n = queries of a sequence, Hq = query heads,
# Hkv = kv heads, D = head dim, N = num blocks, S = block size, M = max blocks per sequence
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from kernels.kv_quant import new_kv_scales
from kernels.kv_write import write_kv_ref

# Device under test: the GPU when there is one, else the CPU through Triton's interpreter.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_cuda = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="bfloat16 needs CUDA"),
]
# The interpreter computes bfloat16 arithmetic wrongly, so bf16 cases run on GPUs only.
FLOAT_DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=needs_cuda)]
TOLERANCE = {
    torch.float32: dict(atol=2e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
# (Hq, Hkv): GQA ratios 1, 2, 4 and MQA.
HEAD_LAYOUTS = [(4, 4), (4, 2), (8, 2), (4, 1)]
GARBAGE_BLOCK_ID = 1_000_000  # pads block tables; dereferencing it would fault


@dataclass
class PagedKv:
    k_cache: torch.Tensor  # [N, S, Hkv, D]
    v_cache: torch.Tensor  # [N, S, Hkv, D]
    block_tables: torch.Tensor  # [B, M] int32
    seq_lens: torch.Tensor  # [B] int32
    dense_k: list[torch.Tensor]  # B x [L, Hkv, D], the values written into the pages
    dense_v: list[torch.Tensor]
    k_scale: torch.Tensor | None = None  # [N, Hkv]
    v_scale: torch.Tensor | None = None


def make_paged_kv(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype | None = None,
    spare_blocks: int = 3,
    one_token_per_write: bool = False,
) -> PagedKv:
    """Random K/V for each sequence, written into shuffled pages; the rest of the cache is
    poison (NaN for float caches) so that reading an unused slot corrupts the result.
    one_token_per_write writes like decode steps do (quantized blocks then grow their scale)."""
    cache_dtype = cache_dtype or dtype
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    max_blocks = max([*blocks_per_seq, 1]) + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    quantized = cache_dtype in (torch.int8, torch.float8_e4m3fn)
    poison = torch.full(shape, 100.0 if quantized else float("nan"))
    k_cache = poison.to(cache_dtype).to(DEVICE)
    v_cache = k_cache.clone()
    k_scale = new_kv_scales(num_blocks, num_kv_heads, DEVICE) if quantized else None
    v_scale = new_kv_scales(num_blocks, num_kv_heads, DEVICE) if quantized else None
    order = torch.randperm(num_blocks).tolist()
    tables = torch.full((len(seq_lens), max_blocks), GARBAGE_BLOCK_ID, dtype=torch.int32)
    dense_k, dense_v = [], []
    for b, n in enumerate(seq_lens):
        ids = [order.pop() for _ in range(blocks_per_seq[b])]
        tables[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(n, num_kv_heads, head_dim).to(dtype).to(DEVICE)
        v = torch.randn(n, num_kv_heads, head_dim).to(dtype).to(DEVICE)
        positions = torch.arange(n)
        slots = tables[b, positions // block_size].long() * block_size + positions % block_size
        slots = slots.to(DEVICE)
        if one_token_per_write:
            for t in range(n):
                step = slice(t, t + 1)
                write_kv_ref(k[step], v[step], k_cache, v_cache, slots[step], k_scale, v_scale)
        else:
            write_kv_ref(k, v, k_cache, v_cache, slots, k_scale, v_scale)
        dense_k.append(k)
        dense_v.append(v)
    return PagedKv(
        k_cache, v_cache, tables.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        dense_k, dense_v, k_scale, v_scale,
    )  # fmt: skip


def dense_attention(
    q: torch.Tensor,  # [n, Hq, D]
    k: torch.Tensor,  # [L, Hkv, D]
    v: torch.Tensor,  # [L, Hkv, D]
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """torch SDPA on unpaged float64 tensors; queries are the last n of the L positions."""
    n, num_q_heads, _ = q.shape
    length, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    q_pos = torch.arange(length - n, length)[:, None]  # [n, 1]
    k_pos = torch.arange(length)[None, :]  # [1, L]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= q_pos - k_pos < sliding_window
    out = F.scaled_dot_product_attention(
        q.double().cpu().transpose(0, 1),  # [Hq, n, D]
        k.double().cpu().repeat_interleave(group, dim=1).transpose(0, 1),  # [Hq, L, D]
        v.double().cpu().repeat_interleave(group, dim=1).transpose(0, 1),
        attn_mask=mask,
        scale=scale,
    )
    return out.transpose(0, 1).float()  # [n, Hq, D]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), **TOLERANCE[dtype])
