"""Rotary position embedding, NeoX / Hugging Face "rotate_half" convention.

# T = tokens, Hq = query heads, Hkv = kv heads, D = head dim, P = max positions

Dimension i pairs with i + D/2:
    out[i]       = x[i] * cos[i] - x[i + D/2] * sin[i]
    out[i + D/2] = x[i + D/2] * cos[i] + x[i] * sin[i]        for i < D/2
with cos = cos_sin_cache[pos, :D/2] and sin = cos_sin_cache[pos, D/2:]. This equals
transformers' q * cos + rotate_half(q) * sin with its full-width (duplicated) cos and sin.
The kernel computes in float32 and rounds once to the input dtype. positions must lie in
[0, P) (not checked: that needs a device sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_launchable,
    check_shape,
    check_tensor,
    next_pow2,
)


@triton.jit
def _rotate_heads(
    src_ptr,  # [T, H, D]
    dst_ptr,
    token,
    num_heads,
    head_dim,
    cos,  # [HALF_PAD] float32
    sin,
    HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    half = head_dim // 2
    h = tl.arange(0, HEADS_PAD)
    i = tl.arange(0, HALF_PAD)
    mask = (h < num_heads)[:, None] & (i < half)[None, :]
    # [HEADS_PAD, HALF_PAD] offsets of the first halves
    first = (token * num_heads + h).to(tl.int64)[:, None] * head_dim + i[None, :]
    x1 = tl.load(src_ptr + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_ptr + first + half, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(dst_ptr + first, out1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst_ptr + first + half, out2.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [T, Hkv, D]
    positions_ptr,  # [T]
    cos_sin_ptr,  # [P, D]
    q_out_ptr,
    k_out_ptr,
    num_q_heads,
    num_kv_heads,
    head_dim,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    half = head_dim // 2
    pos = tl.load(positions_ptr + token).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_sin_ptr + pos * head_dim + i, mask=i < half, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * head_dim + half + i, mask=i < half, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, token, num_q_heads, head_dim, cos, sin, Q_HEADS_PAD, HALF_PAD)
    _rotate_heads(k_ptr, k_out_ptr, token, num_kv_heads, head_dim, cos, sin, K_HEADS_PAD, HALF_PAD)


def _check_args(q: object, k: object, positions: object, cos_sin_cache: object) -> None:
    q = check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    k = check_tensor("k", k, ndim=3, dtypes=(q.dtype,), device=q.device)
    num_tokens, _, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(
            f"k must be [T, Hkv, D] with T, D of q {tuple(q.shape)}, got {tuple(k.shape)}"
        )
    if head_dim % 2:
        raise ValueError(f"head dim must be even for rotary, got {head_dim}")
    pos = check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES, device=q.device)
    check_shape("positions", pos, (num_tokens,))
    cache = check_tensor(
        "cos_sin_cache", cos_sin_cache, ndim=2, dtypes=(torch.float32, q.dtype), device=q.device
    )
    if cache.shape[1] != head_dim:
        raise ValueError(f"cos_sin_cache must be [P, {head_dim}], got {tuple(cache.shape)}")


def apply_rotary(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int64
    cos_sin_cache: torch.Tensor,  # [P, D]: cos in [:, :D/2], sin in [:, D/2:]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies (q_out [T, Hq, D], k_out [T, Hkv, D])."""
    _check_args(q, k, positions, cos_sin_cache)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0 or head_dim == 0:
        return q_out, k_out
    check_launchable(q.device)
    num_kv_heads = k.shape[1]
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos_sin_cache, q_out, k_out, num_q_heads, num_kv_heads, head_dim,
        Q_HEADS_PAD=next_pow2(num_q_heads),
        K_HEADS_PAD=next_pow2(num_kv_heads),
        HALF_PAD=next_pow2(head_dim // 2),
    )  # fmt: skip
    return q_out, k_out


def apply_rotary_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T]
    cos_sin_cache: torch.Tensor,  # [P, D]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch apply_rotary (float32 math, one rounding)."""
    _check_args(q, k, positions, cos_sin_cache)
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)  # [T, D/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)  # [T, H, D/2]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)
