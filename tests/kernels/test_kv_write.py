"""write_kv: kernel vs reference (float and quantized caches), padding, argument checks."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, FLOAT_DTYPES

from kernels.kv_quant import new_kv_scales
from kernels.kv_write import write_kv, write_kv_ref

NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 8, 4, 2, 8


def _caches(dtype, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE):
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape).to(dtype).to(DEVICE)
    return k_cache, torch.randn(shape).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("block_size", [4, 16])
def test_scatter_matches_reference_and_skips_padding(dtype, block_size):
    k_cache, v_cache = _caches(dtype, block_size=block_size)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    before = k_cache.clone()
    slots = torch.tensor([5, -1, 3 * block_size, 0, -1, 7 * block_size + 1], device=DEVICE)
    k = torch.randn(6, NUM_KV_HEADS, HEAD_DIM).to(dtype).to(DEVICE)
    v = torch.randn(6, NUM_KV_HEADS, HEAD_DIM).to(dtype).to(DEVICE)
    write_kv(k, v, k_cache, v_cache, slots)
    write_kv_ref(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    flat_k = k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)
    flat_before = before.view(-1, NUM_KV_HEADS, HEAD_DIM)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], k[t])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[[s for s in slots.tolist() if s >= 0]] = False
    assert torch.equal(flat_k[untouched], flat_before[untouched])


def test_no_tokens_is_a_no_op():
    k_cache, v_cache = _caches(torch.float32)
    before = k_cache.clone()
    empty = torch.empty(0, NUM_KV_HEADS, HEAD_DIM, device=DEVICE)
    write_kv(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(k_cache, before)


def _write_steps(dtype, fn, steps):
    """Run the writes on caches that start as the same (seeded) garbage."""
    generator = torch.Generator().manual_seed(1)
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=generator).to(dtype).to(DEVICE)
    v_cache = torch.randn(shape, generator=generator).to(dtype).to(DEVICE)
    k_scale = new_kv_scales(NUM_BLOCKS, NUM_KV_HEADS, DEVICE)
    v_scale = new_kv_scales(NUM_BLOCKS, NUM_KV_HEADS, DEVICE)
    for slots, k, v in steps:
        fn(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    return k_cache, v_cache, k_scale, v_scale


def _quant_steps():
    """A prefill of two sequences (out of order, with padding), then decode steps whose values
    grow (forcing scale growth and re-encoding), then a block reused from offset 0 with small
    values (forcing a scale reset)."""
    steps = []

    def step(slots, magnitude):
        k = magnitude * torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM, device=DEVICE)
        v = magnitude * torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM, device=DEVICE)
        steps.append((torch.tensor(slots, device=DEVICE), k, v))

    step([9, 8, -1, 20, 21, 10, 22, 4, 5, 6, 7], 1.0)  # blocks 2 (8..10), 5 (20..22), 1 (4..7)
    step([11, 23], 10.0)
    step([12, 24, -1], 100.0)
    step([13, 25], 0.5)
    step([8, 9], 0.01)  # block 2 restarts
    return steps


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_quantized_write_matches_reference_bit_for_bit(dtype):
    steps = _quant_steps()
    got = _write_steps(dtype, write_kv, steps)
    want = _write_steps(dtype, write_kv_ref, steps)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_quantized_write_grows_and_resets_scales(dtype):
    steps = _quant_steps()
    scales_after = [_write_steps(dtype, write_kv, steps[: i + 1])[2] for i in range(len(steps))]
    # Blocks 2 and 5 grew when the 10x decode tokens joined them.
    assert bool((scales_after[1][[2, 5]] > scales_after[0][[2, 5]]).all())
    # Block 3 (fresh at step 2 with 100x values) keeps its scale for a smaller token.
    assert torch.equal(scales_after[3][3], scales_after[2][3])
    # Block 2 restarted at offset 0 with tiny values: its scale shrank.
    assert bool((scales_after[4][2] < scales_after[3][2]).all())
    # Scales are powers of two.
    mantissa, _ = torch.frexp(scales_after[-1])
    assert bool((mantissa == 0.5).all())


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_stored_values_within_documented_bound(dtype):
    """Per element: int8 |err| < 2 * absmax / 127; fp8 |err| <= 2^-4 |x| + 2^-10 * scale, summed
    over re-encodings (at most 3 here)."""
    steps = _quant_steps()[:4]  # block 2 (slots 8..13) and 5 (20..25) see growth
    k_cache, _, k_scale, _ = _write_steps(dtype, write_kv, steps)
    written = {}
    for slots, k, _ in steps:
        for t, slot in enumerate(slots.tolist()):
            if slot >= 0:
                written[slot] = k[t]
    for slot, x in written.items():
        block, offset = divmod(slot, BLOCK_SIZE)
        scale = k_scale[block][:, None]  # [Hkv, 1]
        got = k_cache[block, offset].float() * scale
        err = (got - x).abs()
        block_slots = [s for s in written if s // BLOCK_SIZE == block]
        absmax = torch.stack([written[s].abs() for s in block_slots]).amax(dim=(0, 2))[:, None]
        if dtype == torch.int8:
            assert bool((err < 2 * absmax / 127).all()), (slot, err.max())
        else:
            assert bool((err <= 3 * (x.abs() / 16 + scale / 1024)).all()), (slot, err.max())


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("block_size", [1, 6])
def test_quantized_write_unusual_block_sizes(dtype, block_size):
    shape = (5, block_size, NUM_KV_HEADS, HEAD_DIM)
    caches = [torch.zeros(shape, device=DEVICE).to(dtype) for _ in range(4)]
    scales = [new_kv_scales(5, NUM_KV_HEADS, DEVICE) for _ in range(4)]
    for step in range(3):
        slots = torch.tensor([2 * block_size + step, step, -1], device=DEVICE)
        slots = slots[slots < 5 * block_size]
        k = (1 + 10 * step) * torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM, device=DEVICE)
        write_kv(k, k, caches[0], caches[1], slots, scales[0], scales[1])
        write_kv_ref(k, k, caches[2], caches[3], slots, scales[2], scales[3])
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(scales[0], scales[2])


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_out_of_order_offsets_are_rescaled_too(dtype):
    """Offsets 0-1, then 3, then 2 with large values: the scale grows and offset 3, written
    before the growth and above the new token, must be re-encoded with the rest."""
    x = {slot: torch.randn(1, NUM_KV_HEADS, HEAD_DIM, device=DEVICE) for slot in (28, 29, 31)}
    x[30] = 50 * torch.randn(1, NUM_KV_HEADS, HEAD_DIM, device=DEVICE)
    steps = [
        (torch.tensor(slots, device=DEVICE), torch.cat([x[s] for s in slots]), torch.cat([x[s] for s in slots]))
        for slots in ([28, 29], [31], [30])
    ]  # fmt: skip
    got = _write_steps(dtype, write_kv, steps)
    want = _write_steps(dtype, write_kv_ref, steps)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
    k_cache, _, k_scale, _ = got
    grown = k_scale[7][:, None]  # [Hkv, 1]
    assert bool((grown > 2.0**-4).all())  # sized for the 50x token
    stored = k_cache[7, 3].float() * grown
    assert bool(((stored - x[31][0]).abs() <= grown).all())  # within one final quantum


@pytest.fixture
def valid_args():
    k_cache, v_cache = _caches(torch.float16)
    k = torch.randn(3, NUM_KV_HEADS, HEAD_DIM, dtype=torch.float16, device=DEVICE)
    slots = torch.tensor([0, 1, 2], device=DEVICE)
    return dict(k=k, v=k.clone(), k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)


def _bad_cases(a):
    scales = new_kv_scales(NUM_BLOCKS, NUM_KV_HEADS, DEVICE)
    int8 = dict(k_cache=a["k_cache"].to(torch.int8), v_cache=a["v_cache"].to(torch.int8))
    return {
        "k rank": dict(k=a["k"][0]),
        "v shape": dict(v=a["v"][:2]),
        "k/v dtype": dict(v=a["v"].float()),
        "k heads vs cache": dict(k=a["k"][:, :1].contiguous(), v=a["v"][:, :1].contiguous()),
        "cache dtype": dict(k_cache=a["k_cache"].float(), v_cache=a["v_cache"].float()),
        "slots dtype": dict(slot_mapping=a["slot_mapping"].float()),
        "slots length": dict(slot_mapping=a["slot_mapping"][:2]),
        "k non-contiguous": dict(k=a["k"].transpose(0, 1).contiguous().transpose(0, 1)),
        "quantized without scales": dict(
            k_cache=a["k_cache"].to(torch.int8), v_cache=a["v_cache"].to(torch.int8)
        ),
        "scale shape": dict(
            **int8, k_scale=scales[:, :1].contiguous(), v_scale=scales[:, :1].contiguous()
        ),
        "scale dtype": dict(**int8, k_scale=scales.half(), v_scale=scales.half()),
    }


BAD_CASES = [
    "k rank", "v shape", "k/v dtype", "k heads vs cache", "cache dtype", "slots dtype",
    "slots length", "k non-contiguous", "quantized without scales", "scale shape", "scale dtype",
]  # fmt: skip


@pytest.mark.parametrize("fn", [write_kv, write_kv_ref])
@pytest.mark.parametrize("case", BAD_CASES)
def test_rejects_bad_arguments(fn, case, valid_args):
    with pytest.raises(ValueError):
        fn(**{**valid_args, **_bad_cases(valid_args)[case]})
