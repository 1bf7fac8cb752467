"""Quantized KV cache: int8 or fp8 (e4m3fn) codes, one float32 scale per (block, kv head).

    value = code * scale[block, kv_head]        k_scale, v_scale: [N, Hkv] float32, per layer

Scale scheme: power-of-two block scales (the shared exponent of OCP microscaling).
  * Every scale is a power of two 2^e, e in [E_MIN, E_MAX]. Codes are x * 2^-e, which is exact,
    so the kernel and the torch reference produce bit-identical codes.
  * When a write lands tokens in a block, the needed scale for a kv head is the smallest power
    of two s with QMAX * s >= absmax(new tokens' values for that head) (QMAX = 127 for int8,
    448 for e4m3). The block's scale becomes max(current scale, needed scale).
  * A write that covers offset 0 of a block starts the block afresh: its old scale and codes
    are ignored (the block was just allocated, or is being recomputed).
    So a block's first write must include offset 0, as it does when blocks fill in order.
  * Any other write keeps the block's codes at the offsets it does not write. If the scale
    grows from s_old to s_new = s_old * 2^k, those codes are re-encoded as code * 2^-k by the
    same program that writes the new tokens, so no reader ever pairs a code with the wrong
    scale. One program owns a (block, kv head) per write; see kernels/kv_write.py.

Error admitted, for a value x stored in a (block, head) whose final scale is s:
  * int8 (round half away from zero): direct quantization errs by at most s/2. Each re-encode
    adds at most half of the scale at that time; scales at least double per re-encode, so the
    total stays below s. Since s < 2 * absmax / 127 (absmax over the values written to that
    block and head), |x - dequant(x)| < 2 * absmax / 127, about 1.6% of the block's absmax.
  * fp8 e4m3fn (round to nearest even, saturating at 448): relative error <= 2^-4 for
    |x| >= 2^-6 * s, absolute error <= 2^-10 * s below that. Re-encoding by a power of two is
    exact unless a code falls below e4m3's normal range, where it rounds to a multiple of
    2^-9 (absolute error <= 2^-10 * s_new per re-encode).
Attention over dequantized K/V: the output is a convex combination of V rows, so its error is
at most the V error above plus the effect of the K error on the softmax weights. Measured
against float attention (tests/kernels/test_kv_quant.py: unit-normal K/V and queries, head dim
32 and 64, contexts of 1 to 70 tokens, float32 and float16 queries), max |quant - float| over
all outputs:   int8  0.016 (decode) / 0.041 (prefill)   fp8 e4m3  0.072 / 0.169.
The largest errors come from queries with a one-token context, whose output is a single V row.
The tests allow QUANT_ATTENTION_ATOL below.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)
INT8_MAX = 127.0
E4M3_MAX = 448.0
E_MIN = -100  # exponent of the scale given to an all-zero block
E_MAX = 100
_E_MIN: tl.constexpr = tl.constexpr(E_MIN)
_E_MAX: tl.constexpr = tl.constexpr(E_MAX)

# Max |quantized attention - float attention| the tests allow for unit-normal K/V: the
# per-element bound above at |v| <= 4 (int8: 2 * 4 / 127 ~ 0.063, e4m3: 4 * 2^-4 = 0.25),
# rounded down, since measured errors sit at 25-70% of it.
QUANT_ATTENTION_ATOL = {torch.int8: 0.05, torch.float8_e4m3fn: 0.2}


def qmax(dtype: torch.dtype) -> float:
    if dtype == torch.int8:
        return INT8_MAX
    if dtype == torch.float8_e4m3fn:
        return E4M3_MAX
    raise ValueError(f"no quantized KV format for dtype {dtype}; use one of {QUANT_DTYPES}")


def new_kv_scales(num_blocks: int, num_kv_heads: int, device: torch.device | str) -> torch.Tensor:
    """Scales for one layer's K (or V) cache: [N, Hkv] float32. Initial values do not matter,
    since the first write to a block (offset 0) sets its scale."""
    return torch.full((num_blocks, num_kv_heads), 2.0**E_MIN, dtype=torch.float32, device=device)


def pow2_scale_ref(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Smallest power of two s with qmax(dtype) * s >= amax (elementwise), float32."""
    # float64 makes the division and log2 exact enough: amax / qmax is a power of two exactly
    # when amax == qmax * 2^k, and otherwise lies at least one float32 ulp away from one.
    exponent = torch.ceil(torch.log2(amax.double() / qmax(dtype)))
    exponent = exponent.clamp(E_MIN, E_MAX)
    return torch.exp2(exponent).float()


def quantize_ref(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Codes of float32 `x` under power-of-two `scale` (broadcast against x)."""
    y = x.float() * (1.0 / scale)
    if dtype == torch.int8:
        rounded = torch.floor(y.abs() + 0.5).clamp(max=INT8_MAX)
        return (torch.sign(y) * rounded).to(torch.int8)
    if dtype == torch.float8_e4m3fn:
        return y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    raise ValueError(f"no quantized KV format for dtype {dtype}")


def dequantize_ref(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale


@triton.jit
def pow2_scale(amax, QMAX: tl.constexpr, QMAX_FLOOR_LOG2: tl.constexpr):
    """Smallest power of two s with QMAX * s >= amax (amax >= 0, float32), built from bits so
    that it is exact on every backend."""
    bits = amax.to(tl.int32, bitcast=True)
    exp_field = (bits >> 23) & 0xFF
    ceil_log2 = exp_field - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    # QMAX * 2^e lies in [2^(ceil_log2 - 1), 2^ceil_log2) for this e; one step up is enough.
    e = tl.maximum(ceil_log2 - QMAX_FLOOR_LOG2 - 1, _E_MIN)
    candidate = ((e + 127) << 23).to(tl.float32, bitcast=True)
    e = tl.where(amax <= QMAX * candidate, e, e + 1)
    e = tl.minimum(e, _E_MAX)
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def pow2_reciprocal(scale):
    """1 / scale for a power-of-two float32 scale, exact."""
    return ((254 << 23) - scale.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)


@triton.jit
def encode_int8(y):
    """Round float32 y (already divided by the scale) half away from zero into int8."""
    r = tl.minimum(tl.floor(tl.abs(y) + 0.5), 127.0)
    return tl.where(y < 0, -r, r).to(tl.int8)


@triton.jit
def encode_e4m3(y):
    """Bits (uint8) of float32 y as float8 e4m3fn: round to nearest even, saturate at 448.

    Done with integer ops rather than a cast because Triton's interpreter mis-rounds fp8."""
    a = tl.minimum(tl.abs(y), 448.0)
    bits = a.to(tl.int32, bitcast=True)
    # Normal range (a >= 2^-6): round the 23-bit mantissa to 3 bits, carry into the exponent,
    # then rebias the exponent from 127 to 7.
    rounded = bits + 0x7FFFF + ((bits >> 20) & 1)
    normal = (rounded >> 20) - (120 << 3)
    # Subnormal range: multiples of 2^-9, round half to even.
    t = a * 512.0
    f = tl.floor(t)
    fi = f.to(tl.int32)
    up = (t - f > 0.5) | ((t - f == 0.5) & ((fi & 1) == 1))
    subnormal = fi + up.to(tl.int32)
    code = tl.where(a >= 0.015625, normal, subnormal)
    sign = (y.to(tl.int32, bitcast=True) >> 24) & 0x80
    return (code | sign).to(tl.uint8)


@triton.jit
def encode(y, IS_FP8: tl.constexpr):
    """Codes to store for y = x / scale: uint8 e4m3 bits when IS_FP8, else int8."""
    if IS_FP8:
        return encode_e4m3(y)
    else:
        return encode_int8(y)
