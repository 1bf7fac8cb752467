"""The layout for a checkpoint's integer codes (GPTQ, AWQ, compressed-tensors): the Q4 or Q8
layout where the weight maps onto it exactly, else the KQx16 integer-code types.

# N = output features, K = input features, G = the checkpoint's quantization group

A weight is ``(u - 2^(bits-1) - z) * scale`` of its group, u the unsigned code and z the
zero point relative to the middle code (0 for a symmetric weight). Where z is 0, the
activations are not int8 per token, the columns are in order, G is a power of two of at
least 32 and every scale is a float16 exactly (float16 and bfloat16 scales of usual size
are), the weight is exactly a Q4 weight with ``scale`` and ``min = -8 * scale`` (both
float16 exactly; ``q * scale + min`` is then ``(q - 8) * scale`` exactly in float32), or a
Q8 weight with codes ``u - 128``: the layouts with the fastest kernels and the fused decode
step. Anything else keeps its zero points, column order and scales in KQx16.
"""

from __future__ import annotations

import torch

from common.models.quant.weights import Q4Weight, Q8Weight
from kernels.cpu.kquant import KQx16, affine_type
from kernels.cpu.quant import pack_q4_codes


def _float16_exactly(scales: torch.Tensor) -> torch.Tensor | None:
    half = scales.to(torch.float16)
    if not bool(torch.isfinite(half).all()) or not torch.equal(half.float(), scales.float()):
        return None
    return half


def integer_weight(
    bits: int,
    group: int,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None = None,
    perm: torch.Tensor | None = None,
    int8_tokens: bool = False,
) -> Q4Weight | Q8Weight | KQx16:
    """``codes`` uint8 [N, K] (unsigned, columns in ``perm``'s order), ``scales`` [N, K/G]
    in the checkpoint's dtype, ``zeros`` integer [N, K/G] relative to the middle code or
    None (symmetric)."""
    n, k = codes.shape
    bias = 1 << (bits - 1)
    if zeros is not None and not bool(zeros.any()):
        zeros = None
    plain = zeros is None and perm is None and not int8_tokens
    power_of_two = group >= 32 and group & (group - 1) == 0
    half = _float16_exactly(scales) if plain else None
    if half is not None and bits == 4 and power_of_two:
        return Q4Weight(pack_q4_codes(codes), half.contiguous(), (-8 * half).contiguous(), group)
    if half is not None and bits == 8 and (power_of_two or group == k):
        signed = (codes.to(torch.int16) - bias).to(torch.int8)
        return Q8Weight(signed.contiguous(), half.contiguous(), group)
    d = scales.float().contiguous()
    ones = torch.ones(n, k // 32, dtype=torch.int8)
    m = None if zeros is None else zeros.to(torch.int16).repeat_interleave(group // 32, dim=1)
    return KQx16.pack(
        affine_type(bits, group), codes, d, ones, None if m is None else d, m, bias, -1.0,
        perm, int8_tokens,
    )  # fmt: skip
