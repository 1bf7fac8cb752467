"""Decode attention over a paged KV cache: one new query token per sequence.

# B = batch, Hq = query heads, Hkv = kv heads, G = Hq // Hkv, D = head dim, N = num blocks,
# S = block size, M = max blocks per sequence, P = num splits

Sequence b has seq_lens[b] tokens in the cache (the new one included); its query sits at
position seq_lens[b] - 1 and attends to [max(0, seq_lens[b] - sliding_window), seq_lens[b]).

One program handles (sequence, kv head, split): it loads the G query heads that share the kv
head once and streams that head's keys and values in tiles of TILE_N tokens gathered through
the block table, with an online softmax in float32. K/V are never copied or repeated for GQA.
With P > 1 splits each program covers a contiguous 1/P of the context and writes an
unnormalised partial result (acc, running max, running sum); a second kernel merges them.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.checks import (
    FLOAT_DTYPES,
    check_attention_args,
    check_launchable,
    check_tensor,
    dot_precision,
    next_pow2,
)
from kernels.paged_attention_ref import attend_ref, gather_kv_ref
from kernels.paged_attention_tiles import load_kv_tile, scale_scores, scale_weights

TILE_N = 64  # context tokens per inner iteration
MIN_TOKENS_PER_SPLIT = 256  # a split shorter than this costs more to merge than it saves
MAX_SPLITS = 16
INTERPRETER_NUM_SMS = 4  # nominal "SM count" on the CPU interpreter


@triton.jit
def _decode_kernel(
    q_ptr,  # [B, Hq, D]
    k_cache_ptr,  # [N, S, Hkv, D]
    v_cache_ptr,
    k_scale_ptr,  # [N, Hkv] float32 (QUANT only)
    v_scale_ptr,
    block_tables_ptr,  # [B, M]
    seq_lens_ptr,  # [B]
    out_ptr,  # [B, Hq, D] (NUM_SPLITS == 1)
    part_acc_ptr,  # [B, Hq, P, D] float32 (NUM_SPLITS > 1)
    part_max_ptr,  # [B, Hq, P] float32, log2 domain
    part_sum_ptr,  # [B, Hq, P] float32
    qk_scale,  # softmax scale * log2(e)
    sliding_window,  # 0: none
    max_blocks,  # M
    num_kv_heads,
    head_dim,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    QUANT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_q_heads = num_kv_heads * GROUP
    row_size = num_kv_heads * head_dim

    seq_len = tl.load(seq_lens_ptr + seq)
    start = tl.where(sliding_window > 0, tl.maximum(seq_len - sliding_window, 0), 0)
    per_split = tl.cdiv(tl.cdiv(seq_len - start, NUM_SPLITS), TILE) * TILE
    lo = start + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    g = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + g  # [GROUP_PAD]
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = d < head_dim
    q_rows = (seq * num_q_heads + heads).to(tl.int64) * head_dim
    q = tl.load(
        q_ptr + q_rows[:, None] + d[None, :], mask=(g < GROUP)[:, None] & d_mask[None, :], other=0.0
    )

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * max_blocks
    for tile_start in range(lo, hi, TILE):
        pos = tile_start + tl.arange(0, TILE)  # [TILE]
        pos_mask = pos < hi
        page, k, v = load_kv_tile(
            k_cache_ptr, v_cache_ptr, table_row, pos, pos_mask, kv_head, d, d_mask, row_size,
            head_dim, q, BLOCK_SIZE,
        )  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [GROUP_PAD, TILE]
        s = scale_scores(s, k_scale_ptr, page, pos_mask, kv_head, num_kv_heads, qk_scale, QUANT)
        s = tl.where(pos_mask[None, :], s, float("-inf"))
        # pos[0] < hi inside the loop, so every row has a finite maximum.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [GROUP_PAD, TILE]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = scale_weights(p, v_scale_ptr, page, pos_mask, kv_head, num_kv_heads, QUANT)
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv  # [GROUP_PAD, HEAD_DIM_PAD]
        m_i = m_new

    store_mask = (g < GROUP)[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out_offs = q_rows[:, None] + d[None, :]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        part_rows = (seq * num_q_heads + heads).to(tl.int64) * NUM_SPLITS + split  # [GROUP_PAD]
        tl.store(part_acc_ptr + part_rows[:, None] * head_dim + d[None, :], acc, mask=store_mask)
        tl.store(part_max_ptr + part_rows, m_i, mask=g < GROUP)
        tl.store(part_sum_ptr + part_rows, l_i, mask=g < GROUP)


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr,  # [B, Hq, P, D] float32
    part_max_ptr,  # [B, Hq, P] float32, log2 domain
    part_sum_ptr,  # [B, Hq, P] float32
    out_ptr,  # [B, Hq, D]
    head_dim,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # b * Hq + h
    sp = tl.arange(0, SPLITS_PAD)
    sp_mask = sp < NUM_SPLITS
    d = tl.arange(0, HEAD_DIM_PAD)
    m = tl.load(part_max_ptr + row * NUM_SPLITS + sp, mask=sp_mask, other=float("-inf"))
    lsum = tl.load(part_sum_ptr + row * NUM_SPLITS + sp, mask=sp_mask, other=0.0)
    m_all = tl.max(m, axis=0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.exp2(m - m_all)  # [SPLITS_PAD]; empty splits (max -inf) weigh 0
    denom = tl.sum(w * lsum, axis=0)
    denom = tl.where(denom > 0, denom, 1.0)
    acc_offs = (row * NUM_SPLITS + sp)[:, None] * head_dim + d[None, :]
    acc = tl.load(
        part_acc_ptr + acc_offs, mask=sp_mask[:, None] & (d < head_dim)[None, :], other=0.0
    )
    out = tl.sum(acc * w[:, None], axis=0) / denom  # [HEAD_DIM_PAD]
    tl.store(out_ptr + row * head_dim + d, out.to(out_ptr.dtype.element_ty), mask=d < head_dim)


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Split the context when (sequence, kv head) programs alone would leave SMs idle.

    Aims for about two programs per SM (enough to hide memory latency in a bandwidth-bound
    kernel) without making any split shorter than MIN_TOKENS_PER_SPLIT tokens."""
    programs = batch * num_kv_heads
    target = 2 * num_sms
    if programs >= target:
        return 1
    by_occupancy = triton.cdiv(target, max(programs, 1))
    by_length = max_context // MIN_TOKENS_PER_SPLIT
    return max(1, min(MAX_SPLITS, by_occupancy, by_length))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_NUM_SMS


def _check_args(
    q: object,
    k_cache: object,
    v_cache: object,
    block_tables: object,
    seq_lens: object,
    scale: object,
    sliding_window: object,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    num_splits: object,
) -> bool:
    q = check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    quantized = check_attention_args(
        q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, k_scale, v_scale
    )
    assert isinstance(block_tables, torch.Tensor), "checked above"
    if block_tables.shape[0] != q.shape[0]:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {q.shape[0]} queries")
    if num_splits is not None and (
        isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1
    ):
        raise ValueError(f"num_splits must be None or a positive int, got {num_splits!r}")
    return quantized


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [N, S, Hkv, D]
    v_cache: torch.Tensor,  # [N, S, Hkv, D]
    block_tables: torch.Tensor,  # [B, M] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,  # [N, Hkv] float32, quantized cache only
    v_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of each sequence's newest token over its cached context: [B, Hq, D]."""
    quantized = _check_args(
        q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, k_scale, v_scale,
        num_splits,
    )  # fmt: skip
    batch, num_q_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if batch == 0:
        return out
    check_launchable(q.device)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_blocks = block_tables.shape[1]
    group = num_q_heads // num_kv_heads
    if num_splits is None:
        max_context = max_blocks * block_size
        if sliding_window is not None:
            max_context = min(max_context, sliding_window)
        num_splits = choose_num_splits(batch, num_kv_heads, max_context, _num_sms(q.device))
    if num_splits > 1:
        part_acc = torch.empty(
            batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        part_max = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused
    k_scale_arg = k_scale if k_scale is not None else out  # unused unless quantized
    v_scale_arg = v_scale if v_scale is not None else out
    head_dim_pad = next_pow2(head_dim, 16)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, k_scale_arg, v_scale_arg, block_tables, seq_lens,
        out, part_acc, part_max, part_sum,
        scale * math.log2(math.e), sliding_window or 0, max_blocks, num_kv_heads, head_dim,
        GROUP=group,
        GROUP_PAD=next_pow2(group, 16),  # tl.dot needs every dim >= 16
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        TILE=TILE_N,
        NUM_SPLITS=num_splits,
        QUANT=quantized,
        DOT_PRECISION=dot_precision(q.dtype),
    )  # fmt: skip
    if num_splits > 1:
        _merge_splits_kernel[(batch * num_q_heads,)](
            part_acc, part_max, part_sum, out, head_dim,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=next_pow2(num_splits),
            HEAD_DIM_PAD=head_dim_pad,
        )  # fmt: skip
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [N, S, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, M]
    seq_lens: torch.Tensor,  # [B]
    scale: float,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Pure-torch paged_decode_attention (num_splits only changes the kernel's schedule)."""
    _check_args(
        q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, k_scale, v_scale,
        num_splits,
    )  # fmt: skip
    out = torch.empty_like(q)
    for b, seq_len in enumerate(seq_lens.tolist()):
        k = gather_kv_ref(k_cache, k_scale, block_tables[b], seq_len)  # [L, Hkv, D]
        v = gather_kv_ref(v_cache, v_scale, block_tables[b], seq_len)
        position = torch.tensor([seq_len - 1], device=q.device)
        out[b] = attend_ref(q[b : b + 1], k, v, position, scale, sliding_window)[0].to(q.dtype)
    return out
