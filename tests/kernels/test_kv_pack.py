"""pack_kv / unpack_kv: wire layout, exact round trip, argument checks."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, needs_cuda

from kernels.kv_pack import pack_kv, pack_kv_ref, unpack_kv, unpack_kv_ref

L, N, S, HKV, D = 3, 10, 4, 2, 8
DTYPES = [
    torch.float32, torch.float16, torch.int8, torch.float8_e4m3fn,
    pytest.param(torch.bfloat16, marks=needs_cuda),
]  # fmt: skip


def _cache(dtype, num_blocks=N):
    bits = torch.randint(-128, 128, (L, 2, num_blocks, S, HKV, D), dtype=torch.int8)
    if dtype in (torch.int8, torch.float8_e4m3fn):
        return bits.view(dtype).to(DEVICE)  # every bit pattern, NaN codes included
    return torch.randn(L, 2, num_blocks, S, HKV, D).to(dtype).to(DEVICE)


def _bits(t):
    return (
        t.view(torch.uint8)
        if t.element_size() == 1
        else t.view(torch.int16 if t.element_size() == 2 else torch.int32)
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_layout_and_reference(dtype):
    cache = _cache(dtype)
    block_ids = [7, 2, 9]
    wire = pack_kv(cache, torch.tensor(block_ids, device=DEVICE))
    assert wire.shape == (3, L, 2, S, HKV, D) and wire.dtype == dtype
    assert torch.equal(_bits(wire), _bits(pack_kv_ref(cache, block_ids)))
    for i, block in enumerate(block_ids):
        for layer in range(L):
            for kv in range(2):
                assert torch.equal(_bits(wire[i, layer, kv]), _bits(cache[layer, kv, block]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unpack", [unpack_kv, unpack_kv_ref])
def test_round_trip_is_exact(dtype, unpack):
    src = _cache(dtype)
    wire = pack_kv(src, [1, 4, 5, 8])
    dst = _cache(dtype, num_blocks=12)
    before = dst.clone()
    unpack(wire, dst, torch.tensor([11, 0, 3, 6], dtype=torch.int32, device=DEVICE))
    for s, d in zip([1, 4, 5, 8], [11, 0, 3, 6], strict=True):
        assert torch.equal(_bits(dst[:, :, d]), _bits(src[:, :, s]))
    untouched = [b for b in range(12) if b not in (11, 0, 3, 6)]
    assert torch.equal(_bits(dst[:, :, untouched]), _bits(before[:, :, untouched]))
    assert torch.equal(_bits(pack_kv(dst, [11, 0, 3, 6])), _bits(wire))


def test_no_blocks():
    cache = _cache(torch.float16)
    wire = pack_kv(cache, [])
    assert wire.shape == (0, L, 2, S, HKV, D)
    unpack_kv(wire, cache, [])


@pytest.mark.parametrize(("pack", "unpack"), [(pack_kv, unpack_kv), (pack_kv_ref, unpack_kv_ref)])
def test_rejects_bad_arguments(pack, unpack):
    cache = _cache(torch.float16)
    wire = pack(cache, [1, 2])
    with pytest.raises(ValueError, match="block_ids"):
        pack(cache, [0, N])
    with pytest.raises(ValueError, match="block_ids"):
        pack(cache, torch.tensor([-1], device=DEVICE))
    with pytest.raises(ValueError, match="distinct"):
        unpack(wire, cache, [3, 3])
    with pytest.raises(ValueError, match="wire"):
        unpack(wire[:1], cache, [3, 4])
    with pytest.raises(ValueError, match="wire"):
        unpack(wire.float(), cache, [3, 4])
    with pytest.raises(ValueError, match="kv_cache"):
        pack(cache[:, :1], [1])
    with pytest.raises(ValueError, match="contiguous"):
        pack(cache.transpose(4, 5), [1])
    with pytest.raises(ValueError, match="block_ids"):
        pack(cache, torch.tensor([1.0], device=DEVICE))
