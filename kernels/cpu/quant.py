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

The x16 layouts (quant_x16.cpp, for CPUs with AVX-512 BW / VL and VNNI) hold the same codes
and scales with 16 weight rows interleaved, so that a 512-bit register's lanes are 16 output
features; ``pack_q4_x16`` / ``pack_q8_x16`` convert (exactly: the inverse functions give the
original tensors back), and ``q4x16_matmul`` / ``q8x16_matmul`` take int16 codes of x per
row (act_bits 16) or int8 codes per 32 elements (act_bits 8, llama.cpp's activations). With
16, their results equal ``q4_matmul`` / ``q8_matmul``'s up to float32 rounding (the same
exact integer sums, added in another order).
"""

from __future__ import annotations

import torch

from kernels.cpu import available, load

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


X16 = 16  # weight rows per block of the x16 layouts


def pack_q4_x16(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4 uint8 [N, K/2], float16 [N, K/G] x 2 (N a multiple of 16) -> the Q4x16 layout:
    codes uint8 [N/16, K/32, 4, 64] (chunk c of n-block j, sub-block b: 32 little-endian
    words, word 2i + h holding q[16j + i, 32b + 8c + 2t + h] in nibble t), scales and mins
    float16 [N/16, K/G, 16]. Where every min is -8 x its scale (symmetric codes: GGUF's
    Q4_0, GPTQ's sym) the mins are not held: float16 [0], which the kernels read as that
    (4.5 bits a weight at groups of 32, as Q4_0's file, instead of 5)."""
    n, half = qweight.shape
    k = half * 2
    codes = unpack_q4_codes(qweight).view(n // X16, X16, k // SUB_BLOCK, 4, 4, 2)  # j i b c t h
    codes = codes.permute(0, 2, 3, 1, 5, 4)  # j b c i h t
    low = codes[..., 0] | (codes[..., 1] << 4)  # the word's first byte: nibbles 0, 1
    high = codes[..., 2] | (codes[..., 3] << 4)
    packed = torch.stack([low, high], dim=-1).reshape(n // X16, k // SUB_BLOCK, 4, 64)
    symmetric = torch.equal(mins.float(), scales.float() * -8)
    held = torch.empty(0, dtype=torch.float16) if symmetric else _lanes(mins)
    return packed.contiguous(), _lanes(scales), held


def symmetric_mins(scales: torch.Tensor) -> torch.Tensor:
    """The mins a Q4x16 weight without them stands for: -8 x each scale (exact in float16:
    pack_q4_x16 drops only mins that equal it)."""
    return (scales.float() * -8).to(torch.float16)


def unpack_q4_x16(
    packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of ``pack_q4_x16``; ``packed`` may be a selection of n-blocks."""
    blocks, num_sub = packed.shape[:2]
    pairs = packed.view(blocks, num_sub, 4, X16, 2, 2)  # j b c i h byte
    nibbles = torch.stack([pairs & 0x0F, pairs >> 4], dim=-1).flatten(-2)  # ... h t
    codes = nibbles.permute(0, 3, 1, 2, 5, 4).reshape(blocks * X16, num_sub * SUB_BLOCK)
    if not mins.numel():
        mins = symmetric_mins(scales)
    return pack_q4_codes(codes), _rows(scales), _rows(mins)


def pack_q8_x16(qweight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8 int8 [N, K], float16 [N, K/G] (N a multiple of 16) -> the Q8x16 layout: codes int8
    [N/16, K/32, 16, 32] (chunk c of n-block j, sub-block b: byte 2i + h is
    q[16j + i, 32b + 2c + h]), scales float16 [N/16, K/G, 16]."""
    n, k = qweight.shape
    codes = qweight.view(n // X16, X16, k // SUB_BLOCK, 16, 2).permute(0, 2, 3, 1, 4)
    return codes.reshape(n // X16, k // SUB_BLOCK, 16, 32).contiguous(), _lanes(scales)


def unpack_q8_x16(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``pack_q8_x16``; ``packed`` may be a selection of n-blocks."""
    blocks, num_sub = packed.shape[:2]
    codes = packed.view(blocks, num_sub, 16, X16, 2).permute(0, 3, 1, 2, 4)
    return codes.reshape(blocks * X16, num_sub * SUB_BLOCK).contiguous(), _rows(scales)


def gather_q4_x16(
    packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows ``ids`` [T] of Q4x16 weights in the rows layout: uint8 [T, K/2], float16
    [T, K/G] x 2 (an embedding lookup reads only these rows' bytes)."""
    blocks, lanes = ids // X16, ids % X16
    num_sub = packed.shape[1]
    pairs = packed.view(packed.shape[0], num_sub, 4, X16, 2, 2)[blocks, :, :, lanes]  # T b c h byte
    nibbles = torch.stack([pairs & 0x0F, pairs >> 4], dim=-1).flatten(-2)  # T b c h t
    codes = nibbles.transpose(-1, -2).reshape(ids.numel(), num_sub * SUB_BLOCK)
    scales = scales[blocks, :, lanes]
    mins = symmetric_mins(scales) if not mins.numel() else mins[blocks, :, lanes]
    return pack_q4_codes(codes), scales, mins


def gather_q8_x16(
    packed: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``ids`` [T] of Q8x16 weights in the rows layout: int8 [T, K], float16 [T, K/G]."""
    blocks, lanes = ids // X16, ids % X16
    num_sub = packed.shape[1]
    codes = packed.view(packed.shape[0], num_sub, 16, X16, 2)[blocks, :, :, lanes]  # T b c h
    return codes.reshape(ids.numel(), num_sub * SUB_BLOCK), scales[blocks, :, lanes]


def q8x16_rows(
    packed: torch.Tensor, scales: torch.Tensor, group_size: int, ids: torch.Tensor
) -> torch.Tensor:
    """Rows ``ids`` [T] of Q8x16 weights dequantized, float32 [T, K]: the bits of
    ``gather_q8_x16`` then ``dequantize_q8_ref``, in one C++ pass (ops.cpp)."""
    if not available():
        codes, row_scales = gather_q8_x16(packed, scales, ids)
        return dequantize_q8_ref(codes, row_scales, group_size)
    out: torch.Tensor = load().q8x16_rows(packed, scales, group_size, ids.long())
    return out


def _lanes(per_row: torch.Tensor) -> torch.Tensor:  # [N, X] -> [N/16, X, 16]
    n = per_row.shape[0]
    return per_row.view(n // X16, X16, -1).transpose(1, 2).contiguous()


def _rows(lanes: torch.Tensor) -> torch.Tensor:  # [N/16, X, 16] -> [N, X]
    return lanes.transpose(1, 2).reshape(lanes.shape[0] * X16, -1).contiguous()


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


def has_x16() -> bool:
    """Whether the x16 kernels were compiled in (this CPU has AVX-512 BW / VL and VNNI)."""
    return bool(load().has_x16())


def amx_available() -> bool:
    """Whether AMX's int8 tiles were compiled in (a CPU listing amx_tile and amx_int8) and
    Linux let this process use them; then the x16 kernels' 8-bit tiles of 16 rows run on them
    (the same bits as the AVX-512 path)."""
    return bool(load().amx_available())


def set_amx(on: bool) -> None:
    """Turns the AMX tiles on or off in this process (PDSERVE_AMX=0 starts it off), to compare
    the two paths; results are the same either way."""
    load().set_amx(on)


def set_row_streams(on: bool) -> None:
    """Whether a lone row reads its Q4x16 and Q8x16 weights, and KQx16 weights with 4-bit low
    planes under 8-bit activation codes, in 4 runs at once (the default) or in one, to
    compare the two; results are the same bits either way."""
    load().set_row_streams(on)


def q4x16_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    group_size: int,
    n: int,
    act_bits: int = 16,
) -> torch.Tensor:
    """x float32 [M, K] contiguous @ Q4x16 weights (``pack_q4_x16``) of N = ``n`` rows ->
    float32 [M, N]; x is quantized inside to int16 codes per row (``act_bits`` 16) or int8
    codes per 32 elements (8)."""
    out: torch.Tensor = load().q4x16_matmul(x, qweight, scales, mins, group_size, n, act_bits)
    return out


def q8x16_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    n: int,
    act_bits: int = 16,
) -> torch.Tensor:
    out: torch.Tensor = load().q8x16_matmul(x, qweight, scales, group_size, n, act_bits)
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


def fp8_x16_matmul(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, n: int
) -> torch.Tensor:
    """x float32 [M, K] contiguous @ FP8 E4M3 codes held 16 rows interleaved, ``packed`` uint8
    [ceil(N / 16), K, 16] (fp8_matmul.cpp), -> float32 [M, N]: ``x . (code * 2^-120)`` per
    row times ``scale`` [N], which carries the 2^120 (``Fp8Weight.kernel_scale``)."""
    out: torch.Tensor = load().fp8_x16_matmul(x, packed, scale, n)
    return out


def half_x16_matmul(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """x float32 [M, K] contiguous @ bfloat16 / float16 weights held 16 rows interleaved,
    ``packed`` [ceil(N / 16), K, 16] (common/models/quant/half.py), -> float32 [M, N]; each
    weight converted exactly, float32 sums in a fixed order per output, whatever M. Against
    bfloat16 weights x is first rounded to bfloat16 (to nearest even), so each product is
    exact (with AVX512-BF16, vdpbf16ps adds them a column pair at a time)."""
    out: torch.Tensor = load().half_x16_matmul(x, packed, n)
    return out
