"""Quantized KV: the scale and encode helpers against torch, and quantized attention against
float attention within the documented error (kernels/kv_quant.py)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from kernel_cases import DEVICE, assert_close, dense_attention, make_paged_kv

from kernels.kv_quant import (
    E4M3_MAX,
    INT8_MAX,
    QUANT_ATTENTION_ATOL,
    encode_e4m3,
    encode_int8,
    pow2_scale,
    pow2_scale_ref,
    qmax,
    quantize_ref,
)
from kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_ref
from kernels.paged_prefill_attention import paged_prefill_attention, paged_prefill_attention_ref

QUANT_DTYPES = [torch.int8, torch.float8_e4m3fn]


@triton.jit
def _helpers_kernel(
    x_ptr,
    scale_ptr,
    int8_ptr,
    e4m3_ptr,
    n,
    QMAX: tl.constexpr,
    QMAX_LOG2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(scale_ptr + offs, pow2_scale(tl.abs(x), QMAX, QMAX_LOG2), mask=mask)
    tl.store(int8_ptr + offs, encode_int8(tl.minimum(tl.maximum(x, -127.0), 127.0)), mask=mask)
    tl.store(e4m3_ptr + offs, encode_e4m3(x), mask=mask)


def _run_helpers(x: torch.Tensor, max_code: float):
    """Run pow2_scale, encode_int8 and encode_e4m3 over x."""
    n = x.numel()
    scale = torch.empty_like(x)
    int8 = torch.empty(n, dtype=torch.int8, device=x.device)
    e4m3 = torch.empty(n, dtype=torch.uint8, device=x.device)
    block = 1024
    max_code_log2 = int(max_code).bit_length() - 1
    grid = (triton.cdiv(n, block),)
    _helpers_kernel[grid](x, scale, int8, e4m3, n, max_code, max_code_log2, block)
    return scale, int8, e4m3


def _tricky_values() -> torch.Tensor:
    fp8_values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    fp8_values = fp8_values[fp8_values.isfinite()].unique()
    midpoints = (fp8_values[1:] + fp8_values[:-1]) / 2  # ties: round to even
    nudged = torch.cat([midpoints * (1 + 2**-20), midpoints * (1 - 2**-20)])
    powers = torch.exp2(torch.arange(-130, 120, dtype=torch.float32))
    edges = torch.cat(
        [p * torch.tensor([1.0, 1 + 2**-23, 1 - 2**-24]) for p in (INT8_MAX, E4M3_MAX)]
    )
    edges = torch.cat([edges[:, None] * powers[None, 120:140]]).flatten()
    halves = torch.arange(-128, 128) + 0.5  # int8 ties: away from zero
    values = torch.cat(
        [fp8_values, midpoints, nudged, powers, edges, halves, torch.randn(2000) * 50]
    )
    values = torch.cat([values, -values, torch.tensor([0.0, 460.0, 1e6])])
    return values.to(DEVICE)


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_pow2_scale_matches_reference(dtype):
    x = _tricky_values()
    scale, _, _ = _run_helpers(x, qmax(dtype))
    expected = pow2_scale_ref(x.abs(), dtype)
    assert torch.equal(scale, expected)


def test_pow2_scale_is_smallest_power_of_two_that_covers():
    x = _tricky_values().abs()
    x = x[(x > 2.0**-90) & (x < 2.0**90)]
    for dtype in QUANT_DTYPES:
        scale = pow2_scale_ref(x, dtype)
        assert bool((x <= qmax(dtype) * scale).all())
        assert bool((x > qmax(dtype) * scale / 2).all())


def test_encoders_match_torch_rounding():
    x = _tricky_values()
    _, int8, e4m3 = _run_helpers(x, INT8_MAX)
    one = torch.ones((), device=DEVICE)
    assert torch.equal(int8, quantize_ref(x.clamp(-127, 127), one, torch.int8))
    expected = quantize_ref(x, one, torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(e4m3, expected)


def _quantized_kv(cache_dtype, seq_lens, heads, head_dim, one_token_per_write=False):
    num_q_heads, num_kv_heads = heads
    kv = make_paged_kv(
        seq_lens, num_kv_heads, head_dim, 16, torch.float32, cache_dtype,
        one_token_per_write=one_token_per_write,
    )  # fmt: skip
    return kv, num_q_heads


@pytest.mark.parametrize("cache_dtype", QUANT_DTYPES)
@pytest.mark.parametrize(
    ("q_dtype", "num_splits", "one_token_per_write"),
    [(torch.float32, 1, False), (torch.float16, 3, False), (torch.float16, 1, True)],
)
def test_quantized_decode_within_stated_error(
    cache_dtype, q_dtype, num_splits, one_token_per_write
):
    head_dim = 32
    kv, num_q_heads = _quantized_kv(
        cache_dtype, [1, 16, 37, 70], (4, 2), head_dim, one_token_per_write
    )
    q = torch.randn(4, num_q_heads, head_dim).to(q_dtype).to(DEVICE)
    scales = dict(k_scale=kv.k_scale, v_scale=kv.v_scale)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, head_dim**-0.5)
    out = paged_decode_attention(*args, **scales, num_splits=num_splits)
    ref = paged_decode_attention_ref(*args, **scales)
    assert_close(out, ref, q_dtype)  # same dequantized values: kernel == reference
    exact = torch.cat([
        dense_attention(q[b : b + 1], kv.dense_k[b], kv.dense_v[b], head_dim**-0.5, None)
        for b in range(4)
    ])  # fmt: skip
    error = (out.float().cpu() - exact).abs().max().item()
    print(
        f"decode {cache_dtype} q={q_dtype} splits={num_splits} "
        f"one_token_per_write={one_token_per_write}: max |quant - float| = {error:.4f}"
    )
    assert error <= QUANT_ATTENTION_ATOL[cache_dtype]


@pytest.mark.parametrize("cache_dtype", QUANT_DTYPES)
@pytest.mark.parametrize("window", [None, 9])
def test_quantized_prefill_within_stated_error(cache_dtype, window):
    head_dim = 64
    cases = [(20, 20), (45, 13), (70, 70)]
    kv, num_q_heads = _quantized_kv(cache_dtype, [s for s, _ in cases], (8, 2), head_dim)
    q_lens = torch.tensor([0] + [n for _, n in cases])
    qsl = q_lens.cumsum(0).to(torch.int32).to(DEVICE)
    q = torch.randn(int(q_lens.sum()), num_q_heads, head_dim, dtype=torch.float16, device=DEVICE)
    scale = head_dim**-0.5
    scales = dict(k_scale=kv.k_scale, v_scale=kv.v_scale)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, qsl, kv.seq_lens, scale, window)
    out = paged_prefill_attention(*args, **scales)
    assert_close(out, paged_prefill_attention_ref(*args, **scales), torch.float16)
    starts = qsl.tolist()
    exact = torch.cat([
        dense_attention(q[starts[b] : starts[b + 1]], kv.dense_k[b], kv.dense_v[b], scale, window)
        for b in range(len(cases))
    ])  # fmt: skip
    error = (out.float().cpu() - exact).abs().max().item()
    print(f"prefill {cache_dtype} window={window}: max |quant - float| = {error:.4f}")
    assert error <= QUANT_ATTENTION_ATOL[cache_dtype]


def test_error_check_can_fail():
    """The bound is tight enough to catch a scale off by one power of two."""
    head_dim = 32
    kv, num_q_heads = _quantized_kv(torch.int8, [40], (2, 1), head_dim)
    q = torch.randn(1, num_q_heads, head_dim, device=DEVICE)
    assert kv.v_scale is not None
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, head_dim**-0.5)
    out = paged_decode_attention(*args, k_scale=kv.k_scale, v_scale=kv.v_scale * 2)
    exact = dense_attention(q, kv.dense_k[0], kv.dense_v[0], head_dim**-0.5, None)
    assert (out.cpu() - exact).abs().max().item() > QUANT_ATTENTION_ATOL[torch.int8]
