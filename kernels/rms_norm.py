"""RMSNorm, optionally fused with the residual add before it.

# T = tokens, H = hidden size

    rms_norm(x, weight, eps)            -> out
    rms_norm(x, weight, eps, residual)  -> (out, new_residual),  new_residual = x + residual

Numerics follow Hugging Face LlamaRMSNorm: the residual add rounds to the input dtype, the
mean of squares and the normalisation run in float32, the result is cast back to the input
dtype and only then multiplied by the weight (which must have the input dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import FLOAT_DTYPES, check_launchable, check_shape, check_tensor, next_pow2


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, H]
    residual_ptr,  # [T, H] (HAS_RESIDUAL only)
    weight_ptr,  # [H]
    out_ptr,  # [T, H]
    new_residual_ptr,  # [T, H] (HAS_RESIDUAL only)
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * hidden
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(new_residual_ptr + row + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * inv_rms).to(x.dtype)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    out = normed.to(tl.float32) * weight.to(tl.float32)
    tl.store(out_ptr + row + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _check_args(x: object, weight: object, eps: object, residual: object) -> None:
    x = check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    w = check_tensor("weight", weight, ndim=1, dtypes=(x.dtype,), device=x.device)
    check_shape("weight", w, (x.shape[1],))
    if residual is not None:
        r = check_tensor("residual", residual, ndim=2, dtypes=(x.dtype,), device=x.device)
        check_shape("residual", r, x.shape)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """out [T, H], or (out, new_residual) when residual is given."""
    _check_args(x, weight, eps, residual)
    out = torch.empty_like(x)
    new_residual = torch.empty_like(x) if residual is not None else out
    num_tokens, hidden = x.shape
    if num_tokens > 0 and hidden > 0:
        check_launchable(x.device)
        block = next_pow2(hidden)
        _rms_norm_kernel[(num_tokens,)](
            x, residual if residual is not None else x, weight, out, new_residual, hidden, eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 512)),
        )  # fmt: skip
    return out if residual is None else (out, new_residual)


def rms_norm_ref(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch rms_norm, written as transformers' LlamaRMSNorm.forward."""
    _check_args(x, weight, eps, residual)
    if residual is not None:
        x = x + residual
    hidden = x.float()
    variance = hidden.pow(2).mean(-1, keepdim=True)
    out = weight * (hidden * torch.rsqrt(variance + eps)).to(x.dtype)
    return out if residual is None else (out, x)
