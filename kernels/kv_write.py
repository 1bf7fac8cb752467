"""Scatter new tokens' K and V into one layer's paged cache (optionally quantizing them).

# T = tokens, Hkv = kv heads, D = head dim, N = num blocks, S = block size

Token t goes to slot `slot_mapping[t]` (= block_id * S + offset); slot -1 means padding and is
skipped. Slots must be distinct within one call. For a quantized cache (int8 / fp8 codes with
per-(block, kv head) scales, see kernels/kv_quant.py) the tokens are visited in slot order
(one argsort), so the tokens of one block form a run; one program per (run, kv head) computes
the block's new scale, re-encodes the block's other codes if the scale grew, and writes the
run's codes. No two programs touch the same block, so no reader of the finished write sees a
code paired with the wrong scale. A write that covers offset 0 of a block starts it afresh.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_launchable,
    check_paged_cache,
    check_scales,
    check_shape,
    check_tensor,
    next_pow2,
)
from kernels.kv_quant import (
    dequantize_ref,
    encode,
    pow2_reciprocal,
    pow2_scale,
    pow2_scale_ref,
    qmax,
    quantize_ref,
)

_COPY_BLOCK = 1024


@triton.jit
def _write_kv_kernel(
    k_ptr,  # [T, Hkv, D]
    v_ptr,
    k_cache_ptr,  # [N, S, Hkv, D]
    v_cache_ptr,
    slot_mapping_ptr,  # [T]
    row_size,  # Hkv * D
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    mask = offs < tl.where(slot >= 0, row_size, 0)  # [BLOCK]; slot -1 is padding
    src = token.to(tl.int64) * row_size + offs
    dst = slot * row_size + offs
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + src, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + src, mask=mask), mask=mask)


@triton.jit
def _quantize_run(
    src_ptr,  # [T, Hkv, D] float
    cache_ptr,  # [N, S, Hkv, D] codes (int8, or uint8 view of fp8)
    scale_ptr,  # [N, Hkv] float32
    tokens,  # [S_PAD] source token of each run entry
    offsets,  # [S_PAD] in-block offset of each run entry
    in_run,  # [S_PAD]
    block,
    first_offset,
    head,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_SIZE_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    QMAX: tl.constexpr,
    QMAX_FLOOR_LOG2: tl.constexpr,
    IS_FP8: tl.constexpr,
):
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = d < head_dim
    row_size = num_kv_heads * head_dim
    x_ptrs = src_ptr + tokens.to(tl.int64)[:, None] * row_size + head * head_dim + d[None, :]
    x = tl.load(x_ptrs, mask=in_run[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    needed = pow2_scale(tl.max(tl.max(tl.abs(x), axis=1), axis=0), QMAX, QMAX_FLOOR_LOG2)
    old_scale = tl.load(scale_ptr + block * num_kv_heads + head)
    fresh = first_offset == 0
    new_scale = tl.where(fresh, needed, tl.maximum(old_scale, needed))

    # If the scale grew, re-encode every entry of the block this write does not cover.
    o = tl.arange(0, BLOCK_SIZE_PAD)
    hits = (offsets[None, :] == o[:, None]) & in_run[None, :]  # [S_PAD (entry), S_PAD (run)]
    kept = (tl.sum(hits.to(tl.int32), axis=1) == 0) & (o < BLOCK_SIZE)
    # tl.where, not `&`, with the scalar: Triton's interpreter mis-types tensor & scalar-bool.
    regrow = tl.where((new_scale > old_scale) & (first_offset > 0), kept, False)
    old_ptrs = (
        cache_ptr + (block * BLOCK_SIZE + o)[:, None] * row_size + head * head_dim + d[None, :]
    )
    old_mask = regrow[:, None] & d_mask[None, :]
    old_codes = tl.load(old_ptrs, mask=old_mask, other=0)
    if IS_FP8:
        old_codes = old_codes.to(tl.float8e4nv, bitcast=True)
    ratio = old_scale * pow2_reciprocal(new_scale)
    tl.store(old_ptrs, encode(old_codes.to(tl.float32) * ratio, IS_FP8), mask=old_mask)

    new_ptrs = cache_ptr + (block * BLOCK_SIZE + offsets)[:, None] * row_size + head * head_dim
    new_ptrs = new_ptrs + d[None, :]
    codes = encode(x * pow2_reciprocal(new_scale), IS_FP8)
    tl.store(new_ptrs, codes, mask=in_run[:, None] & d_mask[None, :])
    tl.store(scale_ptr + block * num_kv_heads + head, new_scale)


@triton.jit
def _write_kv_quant_kernel(
    k_ptr,  # [T, Hkv, D]
    v_ptr,
    k_cache_ptr,  # [N, S, Hkv, D] codes
    v_cache_ptr,
    k_scale_ptr,  # [N, Hkv]
    v_scale_ptr,
    sorted_slots_ptr,  # [T] slot_mapping in ascending order
    order_ptr,  # [T] token index of each sorted slot
    num_tokens,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_SIZE_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    QMAX: tl.constexpr,
    QMAX_FLOOR_LOG2: tl.constexpr,
    IS_FP8: tl.constexpr,
):
    i = tl.program_id(0)
    head = tl.program_id(1)
    # int64 slots: block * S * Hkv * D can pass 2^31 in a large cache.
    slot = tl.load(sorted_slots_ptr + i).to(tl.int64)
    block = slot // BLOCK_SIZE
    prev = tl.load(sorted_slots_ptr + i - 1, mask=i > 0, other=-1).to(tl.int64)
    # The first sorted entry of each block leads its run; others and padding do nothing.
    leads = (slot >= 0) & ((prev < 0) | (prev // BLOCK_SIZE != block))
    if leads:
        run = i + tl.arange(0, BLOCK_SIZE_PAD)
        run_valid = (run < num_tokens) & (run < i + BLOCK_SIZE)
        run_slots = tl.load(sorted_slots_ptr + run, mask=run_valid, other=-1).to(tl.int64)
        in_run = run_valid & (run_slots >= 0) & (run_slots // BLOCK_SIZE == block)
        tokens = tl.load(order_ptr + run, mask=in_run, other=0)
        offsets = run_slots % BLOCK_SIZE
        first_offset = slot % BLOCK_SIZE
        _quantize_run(
            k_ptr, k_cache_ptr, k_scale_ptr, tokens, offsets, in_run, block, first_offset,
            head, num_kv_heads, head_dim, BLOCK_SIZE, BLOCK_SIZE_PAD, HEAD_DIM_PAD, QMAX,
            QMAX_FLOOR_LOG2, IS_FP8,
        )  # fmt: skip
        _quantize_run(
            v_ptr, v_cache_ptr, v_scale_ptr, tokens, offsets, in_run, block, first_offset,
            head, num_kv_heads, head_dim, BLOCK_SIZE, BLOCK_SIZE_PAD, HEAD_DIM_PAD, QMAX,
            QMAX_FLOOR_LOG2, IS_FP8,
        )  # fmt: skip


def _check_write_args(
    k: object,
    v: object,
    k_cache: object,
    v_cache: object,
    slot_mapping: object,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> bool:
    k = check_tensor("k", k, ndim=3, dtypes=FLOAT_DTYPES)
    v = check_tensor("v", v, ndim=3, dtypes=FLOAT_DTYPES, device=k.device)
    check_shape("v", v, k.shape)
    if v.dtype != k.dtype:
        raise ValueError(f"k and v dtypes differ: {k.dtype} vs {v.dtype}")
    kc, vc = check_paged_cache(k_cache, v_cache, k.device)
    num_tokens, num_kv_heads, head_dim = k.shape
    if tuple(kc.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"k is [T, Hkv, D] = {tuple(k.shape)} but the cache is [N, S, Hkv, D] = "
            f"{tuple(kc.shape)}"
        )
    slots = check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, device=k.device)
    check_shape("slot_mapping", slots, (num_tokens,))
    quantized = check_scales(kc, vc, k_scale, v_scale)
    if not quantized and kc.dtype != k.dtype:
        raise ValueError(f"cache dtype {kc.dtype} differs from k dtype {k.dtype}")
    return quantized


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, S, Hkv, D]
    v_cache: torch.Tensor,  # [N, S, Hkv, D]
    slot_mapping: torch.Tensor,  # [T]
    k_scale: torch.Tensor | None = None,  # [N, Hkv] float32, quantized cache only
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write k[t], v[t] into the cache at slot_mapping[t] (in place), skipping slot -1."""
    quantized = _check_write_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    check_launchable(k.device)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if not quantized:
        row_size = num_kv_heads * head_dim
        block = min(_COPY_BLOCK, next_pow2(row_size))
        grid = (num_tokens, triton.cdiv(row_size, block))
        _write_kv_kernel[grid](k, v, k_cache, v_cache, slot_mapping, row_size, BLOCK=block)
        return
    assert k_scale is not None and v_scale is not None, "checked by check_scales"
    block_size = k_cache.shape[1]
    order = torch.argsort(slot_mapping, stable=True)  # [T]
    sorted_slots = slot_mapping[order]  # [T]
    is_fp8 = k_cache.dtype == torch.float8_e4m3fn
    max_code = qmax(k_cache.dtype)
    # fp8 codes are encoded with integer ops and stored through a uint8 view of the cache.
    k_codes = k_cache.view(torch.uint8) if is_fp8 else k_cache
    v_codes = v_cache.view(torch.uint8) if is_fp8 else v_cache
    _write_kv_quant_kernel[(num_tokens, num_kv_heads)](
        k, v, k_codes, v_codes, k_scale, v_scale, sorted_slots, order,
        num_tokens, num_kv_heads, head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_SIZE_PAD=next_pow2(block_size),
        HEAD_DIM_PAD=next_pow2(head_dim),
        QMAX=max_code,
        QMAX_FLOOR_LOG2=int(max_code).bit_length() - 1,
        IS_FP8=is_fp8,
    )  # fmt: skip


def write_kv_ref(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, S, Hkv, D]
    v_cache: torch.Tensor,  # [N, S, Hkv, D]
    slot_mapping: torch.Tensor,  # [T]
    k_scale: torch.Tensor | None = None,  # [N, Hkv]
    v_scale: torch.Tensor | None = None,
) -> None:
    """Pure-torch write_kv: same arguments, same result (bit-identical codes and scales)."""
    quantized = _check_write_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    keep = slot_mapping >= 0  # [T]
    slots = slot_mapping[keep]
    if not quantized:
        for src, cache in ((k, k_cache), (v, v_cache)):
            cache.view(-1, *cache.shape[2:])[slots] = src[keep]
        return
    assert k_scale is not None and v_scale is not None, "checked by check_scales"
    block_size = k_cache.shape[1]
    for src, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        rows = src[keep].float()  # [T', Hkv, D]
        blocks = torch.div(slots, block_size, rounding_mode="floor")
        for block in torch.unique(blocks).tolist():
            in_block = blocks == block
            offsets = slots[in_block] % block_size  # [n]
            x = rows[in_block]  # [n, Hkv, D]
            needed = pow2_scale_ref(x.abs().amax(dim=(0, 2)), cache.dtype)  # [Hkv]
            if int(offsets.min()) == 0:
                new = needed
            else:
                old = scales[block]  # [Hkv]
                new = torch.maximum(old, needed)
                kept = torch.ones(block_size, dtype=torch.bool, device=cache.device)
                kept[offsets] = False
                entries = cache[block, kept]  # [n_kept, Hkv, D]
                regrown = quantize_ref(
                    dequantize_ref(entries, old[:, None]), new[:, None], cache.dtype
                )
                cache[block, kept] = torch.where((new > old)[:, None], regrown, entries)
            cache[block, offsets] = quantize_ref(x, new[:, None], cache.dtype)
            scales[block] = new
