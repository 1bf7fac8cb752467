"""Writing and reading one layer's paged KV cache in plain torch, float or quantized.

# T = tokens written, U = distinct blocks written, N = num blocks, S = block size,
# Hkv = kv heads, D = head dim, B = sequences, M = blocks per sequence

The quantized format is kernels/kv_quant.py's (int8 / e4m3fn codes, one power-of-two float32
scale per (block, kv head)); this module mirrors its torch reference with whole-step tensor
ops instead of a loop over blocks, and deliberately does not import ``kernels`` (that imports
Triton, which a CPU-only engine must not need). tests/kernels/test_triton_engine.py checks that
``write_kv_torch`` gives bit-identical codes and scales to ``kernels.write_kv_ref``.
"""

from __future__ import annotations

import torch

from common.engine.attention.base import LayerKV

E_MIN, E_MAX = -100, 100  # scale exponent range of kernels/kv_quant.py
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def new_kv_scales(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Scales of a fresh quantized cache; values do not matter (a block's first write sets
    them), so they start at the all-zero block's scale."""
    return torch.full(shape, 2.0**E_MIN, dtype=torch.float32, device=device)


def _pow2_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Smallest power of two s with qmax * s >= amax, float32 (as kernels' pow2_scale_ref)."""
    exponent = torch.ceil(torch.log2(amax.double() / _QMAX[dtype])).clamp(E_MIN, E_MAX)
    return torch.exp2(exponent).float()


def _quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    y = x.float() * (1.0 / scale)
    if dtype == torch.int8:
        rounded = torch.floor(y.abs() + 0.5).clamp(max=_QMAX[dtype])  # half away from zero
        return (torch.sign(y) * rounded).to(torch.int8)
    return y.clamp(-_QMAX[dtype], _QMAX[dtype]).to(dtype)


def write_kv_torch(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv: LayerKV,
    slot_mapping: torch.Tensor,  # [T] int64, distinct, >= 0
) -> None:
    """Stores the new tokens' K/V at their slots, quantizing for an int8 / fp8 cache."""
    if not kv.quantized:
        for src, cache in ((k, kv.k_cache), (v, kv.v_cache)):
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, src.to(cache.dtype))
        return
    assert kv.k_scale is not None and kv.v_scale is not None, "LayerKV checks this"
    block_size = kv.k_cache.shape[1]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")  # [T]
    written, inverse = torch.unique(blocks, return_inverse=True)  # [U], [T]
    # A write covering offset 0 starts its block afresh: old codes and scale are dropped.
    fresh = torch.zeros(written.shape[0], dtype=torch.bool, device=k.device)  # [U]
    fresh[inverse[slot_mapping % block_size == 0]] = True
    for src, cache, scales in ((k, kv.k_cache, kv.k_scale), (v, kv.v_cache, kv.v_scale)):
        num_kv_heads = cache.shape[2]
        token_amax = src.float().abs().amax(dim=-1)  # [T, Hkv]
        amax = torch.zeros(written.shape[0], num_kv_heads, device=k.device)  # [U, Hkv]
        amax.scatter_reduce_(0, inverse[:, None].expand(-1, num_kv_heads), token_amax, "amax")
        needed = _pow2_scale(amax, cache.dtype)  # [U, Hkv]
        old = scales[written]
        new = torch.where(fresh[:, None], needed, torch.maximum(old, needed))
        # Codes kept from earlier writes follow a grown scale (exactly: scales are powers of
        # two); the slots being written now are overwritten just below.
        grown = (new > old) & ~fresh[:, None]  # [U, Hkv]
        if bool(grown.any()):
            codes = cache[written]  # [U, S, Hkv, D]
            regrown = _quantize(codes.float() * old[:, None, :, None], new[:, None, :, None],
                                cache.dtype)  # fmt: skip
            cache[written] = torch.where(grown[:, None, :, None], regrown, codes)
        token_scale = new[inverse][:, :, None]  # [T, Hkv, 1]
        cache.view(-1, *cache.shape[2:])[slot_mapping] = _quantize(src, token_scale, cache.dtype)
        scales[written] = new


def gather_blocks(
    cache: torch.Tensor,  # [N, S, Hkv, D]
    scale: torch.Tensor | None,  # [N, Hkv] float32, quantized caches only
    block_ids: torch.Tensor,  # [..., M] int64
    dtype: torch.dtype,
) -> torch.Tensor:  # [..., M, S, Hkv, D] in dtype
    """The cache's blocks, dequantized (code * scale) when the cache is quantized."""
    # index_select copies whole blocks; advanced indexing is several times slower on CPU.
    flat = block_ids.reshape(-1)
    blocks = cache.index_select(0, flat).view(*block_ids.shape, *cache.shape[1:])
    if scale is None:
        return blocks.to(dtype)
    block_scales = scale.index_select(0, flat).view(*block_ids.shape, scale.shape[1])
    return (blocks.float() * block_scales[..., None, :, None]).to(dtype)
