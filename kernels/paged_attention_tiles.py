"""What the paged attention kernels (paged_decode_attention.py, paged_prefill_attention.py)
share, as ``@triton.jit`` helpers inlined into both: one tile of a kv head's keys and values
gathered through a sequence's block table, and the per-block scales of an int8 / fp8 cache
applied to the scores and the softmax weights (QUANT).

# TILE = context tokens per tile, D = head dim (padded), S = block size, Hkv = kv heads
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(
    k_cache_ptr,  # [N, S, Hkv, D]
    v_cache_ptr,
    table_row,  # the sequence's row of the block table
    pos,  # [TILE] context positions
    pos_mask,  # [TILE] which positions exist
    kv_head,
    d,  # [D_PAD] head-dim offsets
    d_mask,  # [D_PAD]
    row_size,  # Hkv * D: elements per cache slot
    head_dim,
    like,  # a tensor of the dtype K and V are converted to (the queries)
    BLOCK_SIZE: tl.constexpr,
):
    """(page [TILE] int64, k [TILE, D_PAD], v [TILE, D_PAD]) of the positions ``pos``."""
    page = tl.load(table_row + pos // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
    slot = page * BLOCK_SIZE + pos % BLOCK_SIZE
    kv_offs = slot[:, None] * row_size + kv_head * head_dim + d[None, :]  # [TILE, D_PAD]
    kv_mask = pos_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(like.dtype)
    v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(like.dtype)
    return page, k, v


@triton.jit
def scale_scores(
    s, k_scale_ptr, page, pos_mask, kv_head, num_kv_heads, qk_scale, QUANT: tl.constexpr
):
    """Raw scores q.k [R, TILE] -> softmax logits in the log2 domain: times ``qk_scale``,
    and for a quantized cache times each key block's scale ([N, Hkv] float32)."""
    if QUANT:
        k_s = tl.load(k_scale_ptr + page * num_kv_heads + kv_head, mask=pos_mask, other=0.0)
        s = s * (k_s * qk_scale)[None, :]
    else:
        s = s * qk_scale
    return s


@triton.jit
def scale_weights(p, v_scale_ptr, page, pos_mask, kv_head, num_kv_heads, QUANT: tl.constexpr):
    """Softmax weights [R, TILE] for the values: a quantized cache's value codes are
    multiplied by their block's scale through the weights (one multiply per weight, not per
    element of V)."""
    if QUANT:
        v_s = tl.load(v_scale_ptr + page * num_kv_heads + kv_head, mask=pos_mask, other=0.0)
        p = p * v_s[None, :]
    return p
