"""Prefill / chunked-prefill attention over a paged KV cache.

# T = query tokens (all sequences), B = sequences, Hq = query heads, Hkv = kv heads,
# G = Hq // Hkv, D = head dim, N = num blocks, S = block size, M = max blocks per sequence

Sequence b owns query rows [query_start_loc[b], query_start_loc[b+1]): the last q_len_b of its
seq_lens[b] tokens, whose K/V (and those of the cached prefix before them) are already in the
cache. Query i of the chunk sits at position seq_lens[b] - q_len_b + i and attends causally,
within sliding_window when given.

Grid: (query tile, kv head). A tile is BLOCK_Q consecutive queries of one sequence times the G
query heads of one kv head, so each K/V tile loaded from the cache serves BLOCK_Q * G rows.
Sequence b's tiles are numbered from query_start_loc[b] // BLOCK_Q + b, which never collides
with sequence b-1's and needs no host sync; the grid has T // BLOCK_Q + B tiles, of which a few
exit at once.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_attention_args,
    check_launchable,
    check_shape,
    check_tensor,
    dot_precision,
    next_pow2,
)
from kernels.paged_attention_ref import attend_ref, gather_kv_ref
from kernels.paged_attention_tiles import load_kv_tile, scale_scores, scale_weights

TILE_N = 64  # context tokens per inner iteration
ROWS_PER_TILE = 64  # BLOCK_Q * GROUP_PAD, unless one kv head's group alone is larger
SEARCH_BLOCK = 128  # sequences scanned per step when a tile looks up its sequence
NO_WINDOW = 1 << 30


@triton.jit
def _prefill_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [N, S, Hkv, D]
    v_cache_ptr,
    k_scale_ptr,  # [N, Hkv] float32 (QUANT only)
    v_scale_ptr,
    block_tables_ptr,  # [B, M]
    query_start_loc_ptr,  # [B + 1]
    seq_lens_ptr,  # [B]
    out_ptr,  # [T, Hq, D]
    qk_scale,  # softmax scale * log2(e)
    sliding_window,  # NO_WINDOW when none
    max_blocks,  # M
    num_seqs,
    num_kv_heads,
    head_dim,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    SEARCH: tl.constexpr,
    QUANT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    num_q_heads = num_kv_heads * GROUP
    row_size = num_kv_heads * head_dim

    # Sequence of this tile: the number of sequences whose first tile is <= tile_id, minus 1.
    count = tl.zeros((), tl.int32)
    for base in range(0, num_seqs, SEARCH):
        idx = base + tl.arange(0, SEARCH)
        starts = tl.load(query_start_loc_ptr + idx, mask=idx < num_seqs, other=0)
        hits = tl.where(idx < num_seqs, starts // BLOCK_Q + idx <= tile_id, False)
        count += tl.sum(hits.to(tl.int32), axis=0)
    seq = count - 1
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local = tile_id - (q_start // BLOCK_Q + seq)
    if local * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        context = seq_len - q_len  # cached prefix before this chunk
        r = tl.arange(0, BLOCK_Q * GROUP_PAD)
        g = r % GROUP_PAD
        q_idx = local * BLOCK_Q + r // GROUP_PAD  # [BLOCK_M] query index inside the chunk
        row_mask = (q_idx < q_len) & (g < GROUP)
        q_pos = context + q_idx  # [BLOCK_M]
        rows = ((q_start + q_idx).to(tl.int64) * num_q_heads + kv_head * GROUP + g) * head_dim
        d = tl.arange(0, HEAD_DIM_PAD)
        d_mask = d < head_dim
        io_mask = row_mask[:, None] & d_mask[None, :]
        q = tl.load(q_ptr + rows[:, None] + d[None, :], mask=io_mask, other=0.0)

        first_pos = context + local * BLOCK_Q
        kv_hi = tl.minimum(first_pos + BLOCK_Q, seq_len)
        kv_lo = tl.maximum(first_pos - sliding_window + 1, 0)
        m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
        table_row = block_tables_ptr + seq.to(tl.int64) * max_blocks
        for tile_start in range(kv_lo, kv_hi, TILE):
            pos = tile_start + tl.arange(0, TILE)  # [TILE]
            pos_mask = pos < kv_hi
            page, k, v = load_kv_tile(
                k_cache_ptr, v_cache_ptr, table_row, pos, pos_mask, kv_head, d, d_mask,
                row_size, head_dim, q, BLOCK_SIZE,
            )  # fmt: skip
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, TILE]
            s = scale_scores(s, k_scale_ptr, page, pos_mask, kv_head, num_kv_heads, qk_scale, QUANT)
            distance = q_pos[:, None] - pos[None, :]  # [BLOCK_M, TILE]
            allowed = (distance >= 0) & (distance < sliding_window) & pos_mask[None, :]
            s = tl.where(allowed, s, float("-inf"))
            # A row may see no allowed key in a tile (window or causal edge): keep it NaN-free.
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            p = scale_weights(p, v_scale_ptr, page, pos_mask, kv_head, num_kv_heads, QUANT)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask
        )


def _check_args(
    q: object,
    k_cache: object,
    v_cache: object,
    block_tables: object,
    query_start_loc: object,
    seq_lens: object,
    scale: object,
    sliding_window: object,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> bool:
    q = check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    quantized = check_attention_args(
        q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, k_scale, v_scale
    )
    assert isinstance(block_tables, torch.Tensor), "checked above"
    qsl = check_tensor(
        "query_start_loc", query_start_loc, ndim=1, dtypes=INDEX_DTYPES, device=q.device
    )
    check_shape("query_start_loc", qsl, (block_tables.shape[0] + 1,))
    return quantized


def paged_prefill_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, S, Hkv, D]
    v_cache: torch.Tensor,  # [N, S, Hkv, D]
    block_tables: torch.Tensor,  # [B, M] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,  # [N, Hkv] float32, quantized cache only
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's chunk over its cached prefix and itself: [T, Hq, D].

    query_start_loc must start at 0, be non-decreasing and end at T, with q_len_b <= seq_lens[b]
    <= M * S (checked by kernels.checks.check_paged_metadata, which syncs; not here)."""
    quantized = _check_args(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window,
        k_scale, v_scale,
    )  # fmt: skip
    num_tokens, num_q_heads, head_dim = q.shape
    out = torch.empty_like(q)
    num_seqs = block_tables.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    check_launchable(q.device)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    group_pad = next_pow2(group)
    block_q = max(1, ROWS_PER_TILE // group_pad)
    if block_q * group_pad < 16:  # tl.dot needs every dim >= 16
        block_q = 16 // group_pad
    k_scale_arg = k_scale if k_scale is not None else out  # unused unless quantized
    v_scale_arg = v_scale if v_scale is not None else out
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, k_scale_arg, v_scale_arg, block_tables, query_start_loc, seq_lens,
        out, scale * math.log2(math.e), sliding_window or NO_WINDOW, block_tables.shape[1],
        num_seqs, num_kv_heads, head_dim,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        HEAD_DIM_PAD=next_pow2(head_dim, 16),
        BLOCK_SIZE=block_size,
        TILE=TILE_N,
        SEARCH=SEARCH_BLOCK,
        QUANT=quantized,
        DOT_PRECISION=dot_precision(q.dtype),
    )  # fmt: skip
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, S, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, M]
    query_start_loc: torch.Tensor,  # [B + 1]
    seq_lens: torch.Tensor,  # [B]
    scale: float,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch paged_prefill_attention."""
    _check_args(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window,
        k_scale, v_scale,
    )  # fmt: skip
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[b], starts[b + 1]
        if hi == lo:
            continue
        k = gather_kv_ref(k_cache, k_scale, block_tables[b], seq_len)  # [L, Hkv, D]
        v = gather_kv_ref(v_cache, v_scale, block_tables[b], seq_len)
        positions = torch.arange(seq_len - (hi - lo), seq_len, device=q.device)  # [n]
        out[lo:hi] = attend_ref(q[lo:hi], k, v, positions, scale, sliding_window).to(q.dtype)
    return out
