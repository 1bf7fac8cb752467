"""The torch backend's KV write and read: float scatter, int8 / fp8 codes with block scales.

(Bit-identity with kernels.write_kv_ref is in tests/kernels/test_triton_engine.py, which may
import Triton; these tests must not.)
"""

from __future__ import annotations

import pytest
import torch

from common.engine.attention.base import LayerKV
from common.engine.attention.torch_kv import gather_blocks, new_kv_scales, write_kv_torch

NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 6, 4, 2, 8
QUANT_DTYPES = [torch.int8, torch.float8_e4m3fn]


def _layer_kv(dtype: torch.dtype) -> LayerKV:
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    generator = torch.Generator().manual_seed(3)
    k_cache = torch.randn(shape, generator=generator).to(dtype)  # stale contents
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    if dtype not in QUANT_DTYPES:
        return LayerKV(k_cache, v_cache)
    scales = new_kv_scales((2, NUM_BLOCKS, NUM_KV_HEADS), torch.device("cpu"))
    return LayerKV(k_cache, v_cache, scales[0], scales[1])


def _tokens(n: int, magnitude: float, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return magnitude * torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=generator)


def _fresh_bound(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [Hkv, 1]
    """kernels/kv_quant.py's error bound for values x [n, Hkv, D] quantized into one block:
    int8 < 2 * absmax / 127 per kv head; fp8 2^-4 relative plus a tiny subnormal term."""
    absmax = x.abs().amax(dim=(0, 2))[:, None]
    return 2 * absmax / 127 if dtype == torch.int8 else absmax / 15


def _read(kv: LayerKV, slot: int) -> torch.Tensor:  # [Hkv, D] float32
    block, offset = divmod(slot, BLOCK_SIZE)
    ids = torch.tensor([block])
    return gather_blocks(kv.k_cache, kv.k_scale, ids, torch.float32)[0, offset]


def test_float_write_scatters_to_slots_and_leaves_the_rest() -> None:
    kv = _layer_kv(torch.float32)
    before = kv.k_cache.clone()
    slots = torch.tensor([5, 0, 17])
    k = _tokens(3, 1.0, seed=1)
    write_kv_torch(k, -k, kv, slots)
    flat_k = kv.k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)
    flat_v = kv.v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)
    assert torch.equal(flat_k[slots], k) and torch.equal(flat_v[slots], -k)
    untouched = torch.ones(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat_k[untouched], before.view(-1, NUM_KV_HEADS, HEAD_DIM)[untouched])


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_offset_zero_write_resets_a_reused_blocks_scale(dtype: torch.dtype) -> None:
    kv = _layer_kv(dtype)
    write_kv_torch(_tokens(4, 100.0, seed=1), _tokens(4, 100.0, seed=2), kv, torch.arange(8, 12))
    assert kv.k_scale is not None
    big = kv.k_scale[2].clone()
    # The block is freed and reused by another sequence: its first write covers offset 0.
    small = _tokens(2, 0.01, seed=3)
    write_kv_torch(small, small, kv, torch.tensor([8, 9]))
    assert bool((kv.k_scale[2] < big / 1000).all()), (kv.k_scale[2], big)
    for t, slot in enumerate((8, 9)):
        assert bool(((_read(kv, slot) - small[t]).abs() < _fresh_bound(small, dtype)).all())


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_growing_scale_reencodes_earlier_tokens(dtype: torch.dtype) -> None:
    kv = _layer_kv(dtype)
    first = _tokens(2, 1.0, seed=4)
    write_kv_torch(first, first, kv, torch.tensor([12, 13]))  # block 3, offsets 0-1
    assert kv.k_scale is not None and kv.v_scale is not None
    scale_before = kv.k_scale[3].clone()
    later = _tokens(1, 50.0, seed=5)
    write_kv_torch(later, later, kv, torch.tensor([14]))  # same block, offset 2
    scale_after = kv.k_scale[3]
    assert bool((scale_after > scale_before).all())
    assert torch.equal(kv.k_scale, kv.v_scale)  # same values in both: same scales
    mantissa, _ = torch.frexp(scale_after)
    assert bool((mantissa == 0.5).all()), "scales are powers of two"
    # Earlier tokens now read under the grown scale, within one final quantum (int8) or the
    # e4m3 relative step plus a subnormal quantum (fp8).
    for t, slot in enumerate((12, 13)):
        err = (_read(kv, slot) - first[t]).abs()
        final_step = scale_after[:, None]  # [Hkv, 1]
        bound = final_step if dtype == torch.int8 else first[t].abs() / 8 + final_step / 256
        assert bool((err <= bound).all()), (slot, err.max())
    assert bool(((_read(kv, 14) - later[0]).abs() < _fresh_bound(later, dtype)).all())


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_tokens_of_one_block_share_its_scale(dtype: torch.dtype) -> None:
    kv = _layer_kv(dtype)
    k = _tokens(6, 1.0, seed=6)
    k[5] *= 40  # slot 5 is block 1 offset 1: only block 1's scale grows
    write_kv_torch(k, k, kv, torch.tensor([0, 1, 2, 3, 4, 5]))
    assert kv.k_scale is not None
    assert bool((kv.k_scale[1] > 8 * kv.k_scale[0]).all())
