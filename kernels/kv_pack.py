"""Gather KV blocks into the wire layout and scatter them back, one launch each.

# L = layers, N = num blocks, S = block size, Hkv = kv heads, D = head dim, n = blocks moved

    kv_cache: [L, 2, N, S, Hkv, D]   (one engine's paged cache, all layers)
    wire:     [n, L, 2, S, Hkv, D]   (ARCHITECTURE.md: block i = all layers' K and V, row-major)

A (layer, K/V, block) slab of S * Hkv * D elements is contiguous on both sides, so the
kernel copies slabs; it moves raw bits (through an integer view), so fp8 / int8 / bf16 caches
round-trip exactly. Quantization scales are not part of this layout and travel separately.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.checks import INDEX_DTYPES, check_launchable, check_shape, check_tensor, next_pow2

COPY_BLOCK = 2048  # elements per program
_BITS_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _copy_blocks_kernel(
    src_ptr,
    dst_ptr,
    block_ids_ptr,  # [n]
    num_cache_blocks,  # N
    slab,  # S * Hkv * D
    num_slabs,  # 2 * L
    PACK: tl.constexpr,  # True: cache -> wire, False: wire -> cache
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)  # position in the wire
    layer_kv = tl.program_id(1).to(tl.int64)  # layer * 2 + (0 for K, 1 for V)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < slab
    block = tl.load(block_ids_ptr + i).to(tl.int64)
    cache_offs = (layer_kv * num_cache_blocks + block) * slab + offs
    wire_offs = (i.to(tl.int64) * num_slabs + layer_kv) * slab + offs
    if PACK:
        tl.store(dst_ptr + wire_offs, tl.load(src_ptr + cache_offs, mask=mask), mask=mask)
    else:
        tl.store(dst_ptr + cache_offs, tl.load(src_ptr + wire_offs, mask=mask), mask=mask)


def _check_cache(kv_cache: object) -> torch.Tensor:
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.element_size() not in _BITS_VIEW:
        raise ValueError("kv_cache must be a tensor with 1-, 2-, 4- or 8-byte elements")
    cache = check_tensor("kv_cache", kv_cache, ndim=6, dtypes=(kv_cache.dtype,))
    if cache.shape[1] != 2:
        raise ValueError(f"kv_cache must be [L, 2, N, S, Hkv, D], got {tuple(cache.shape)}")
    return cache


def _block_ids_tensor(
    block_ids: torch.Tensor | Sequence[int], kv_cache: torch.Tensor, unique: bool
) -> torch.Tensor:
    """Block ids as a device tensor, checked against N (this syncs; transfers are host-driven)."""
    if isinstance(block_ids, torch.Tensor):
        ids = check_tensor("block_ids", block_ids, ndim=1, dtypes=INDEX_DTYPES)
    else:
        ids = torch.tensor(list(block_ids), dtype=torch.int64)
    num_blocks = kv_cache.shape[2]
    host = ids.cpu()
    if host.numel() and (int(host.min()) < 0 or int(host.max()) >= num_blocks):
        raise ValueError(f"block_ids must lie in [0, {num_blocks}): {host.tolist()}")
    if unique and torch.unique(host).numel() != host.numel():
        raise ValueError(f"block_ids must be distinct when unpacking: {host.tolist()}")
    return ids.to(kv_cache.device)


def _launch(
    src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor, kv_cache: torch.Tensor, pack: bool
) -> None:
    num_layers, _, num_blocks = kv_cache.shape[:3]
    slab = kv_cache[0, 0, 0].numel()
    block = min(COPY_BLOCK, next_pow2(slab))
    bits = _BITS_VIEW[kv_cache.element_size()]
    grid = (ids.numel(), 2 * num_layers, triton.cdiv(slab, block))
    _copy_blocks_kernel[grid](
        src.view(bits),
        dst.view(bits),
        ids,
        num_blocks,
        slab,
        2 * num_layers,
        PACK=pack,
        BLOCK=block,
    )


def _wire_shape(kv_cache: torch.Tensor, n: int) -> tuple[int, ...]:
    num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    return (n, num_layers, 2, block_size, num_kv_heads, head_dim)


def pack_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """Copy blocks `block_ids` out of kv_cache [L, 2, N, S, Hkv, D] into wire [n, L, 2, S, Hkv, D]."""
    cache = _check_cache(kv_cache)
    ids = _block_ids_tensor(block_ids, cache, unique=False)
    wire = torch.empty(_wire_shape(cache, ids.numel()), dtype=cache.dtype, device=cache.device)
    if ids.numel() == 0 or wire.numel() == 0:
        return wire
    check_launchable(cache.device)
    _launch(cache, wire, ids, cache, pack=True)
    return wire


def unpack_kv(
    wire: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor | Sequence[int]
) -> None:
    """Copy wire [n, L, 2, S, Hkv, D] into kv_cache [L, 2, N, S, Hkv, D] at `block_ids` (in place)."""
    cache = _check_cache(kv_cache)
    ids = _block_ids_tensor(block_ids, cache, unique=True)
    check_tensor("wire", wire, ndim=6, dtypes=(cache.dtype,), device=cache.device)
    check_shape("wire", wire, _wire_shape(cache, ids.numel()))
    if ids.numel() == 0 or wire.numel() == 0:
        return
    check_launchable(cache.device)
    _launch(wire, cache, ids, cache, pack=False)


def pack_kv_ref(kv_cache: torch.Tensor, block_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """Pure-torch pack_kv."""
    cache = _check_cache(kv_cache)
    ids = _block_ids_tensor(block_ids, cache, unique=False).long()
    return cache[:, :, ids].permute(2, 0, 1, 3, 4, 5).contiguous()


def unpack_kv_ref(
    wire: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor | Sequence[int]
) -> None:
    """Pure-torch unpack_kv."""
    cache = _check_cache(kv_cache)
    ids = _block_ids_tensor(block_ids, cache, unique=True).long()
    check_tensor("wire", wire, ndim=6, dtypes=(cache.dtype,), device=cache.device)
    check_shape("wire", wire, _wire_shape(cache, ids.numel()))
    bits = _BITS_VIEW[cache.element_size()]
    cache.view(bits)[:, :, ids] = wire.view(bits).permute(1, 2, 0, 3, 4, 5)
