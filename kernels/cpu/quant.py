"""Matmuls over packed 4-bit and 8-bit weights (C++, quant_matmul.cpp) and their references.

# M = activation rows, K = input features, N = output features, G = group size

Q4: ``qweight`` uint8 [N, K/2] (per 32-element sub-block: low nibbles = elements 0..15,
high nibbles = 16..31, GGUF's order), ``scales`` and ``mins`` float16 [N, K/G]:
``w = q * scale + min``. Q8: ``qweight`` int8 [N, K], ``scales`` float16 [N, K/G] (G = K: one
scale per output channel): ``w = q * scale``. Group sizes are powers of two >= 32.

The C++ kernels quantize x to int16 codes with one step per row (act_bits 16: each element
within 1/65534 of the row's largest |x|) or to int8 codes per sub-block of 32 (act_bits 8:
1/254 of the sub-block's) and sum exactly in int32. Against the float64 reference
``x @ dequantize(w).T`` that measured up to 8e-5 of the largest output for int16 codes and
1-2e-2 for int8 codes
(tests/kernels/test_quant_matmul.py states the bounds it checks).
"""

from __future__ import annotations

import torch

from kernels.cpu import load

SUB_BLOCK = 32


def unpack_q4_codes(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> the codes in element order, uint8 [N, K] in [0, 15]."""
    n, half = qweight.shape
    blocks = qweight.view(n, half // 16, 16)
    low, high = blocks & 0x0F, blocks >> 4
    return torch.cat([low, high], dim=2).reshape(n, half * 2)


def pack_q4_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] codes in [0, 15] (K a multiple of 32) -> uint8 [N, K/2]."""
    n, k = codes.shape
    blocks = codes.to(torch.uint8).reshape(n, k // SUB_BLOCK, 2, 16)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def dequantize_q4_ref(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int
) -> torch.Tensor:
    """float32 [N, K]: ``q * scale + min``, each product and sum rounded to float32 once,
    as GGUF's own dequantization computes it."""
    codes = unpack_q4_codes(qweight).float()
    n, k = codes.shape
    groups = codes.view(n, k // group_size, group_size)
    out = groups * scales.float()[..., None] + mins.float()[..., None]
    return out.view(n, k)


def dequantize_q8_ref(qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = qweight.shape
    groups = qweight.float().view(n, k // group_size, group_size)
    return (groups * scales.float()[..., None]).view(n, k)


def q4_matmul_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    return x @ dequantize_q4_ref(qweight, scales, mins, group_size).t()


def q8_matmul_ref(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    return x @ dequantize_q8_ref(qweight, scales, group_size).t()


def q4_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    group_size: int,
    act_bits: int = 16,
) -> torch.Tensor:
    """x float32 [M, K] contiguous -> float32 [M, N]; x is quantized to ``act_bits``
    (16: per row, 8: per sub-block of 32) inside."""
    out: torch.Tensor = load().q4_matmul(x, qweight, scales, mins, group_size, act_bits)
    return out


def q8_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    act_bits: int = 16,
) -> torch.Tensor:
    out: torch.Tensor = load().q8_matmul(x, qweight, scales, group_size, act_bits)
    return out


def q4_dequantize(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    group_size: int,
    row_start: int = 0,
    row_end: int | None = None,
) -> torch.Tensor:
    """Rows ``[row_start, row_end)`` as float32, bit for bit ``dequantize_q4_ref``'s."""
    end = qweight.shape[0] if row_end is None else row_end
    out: torch.Tensor = load().q4_dequantize(qweight, scales, mins, group_size, row_start, end)
    return out
