"""The fused C++ CPU ops (kernels/cpu/ops.cpp) against their torch references, and the cpp
attention backend against the torch backend, op by op and in an engine.

# T = tokens, H = hidden size, Hq / Hkv = query / kv heads, D = head dim, N = cache blocks,
# S = block size, B = sequences, M = max blocks per sequence, I = MLP intermediate size

References: common/models/layers.py ``rms_norm_hf`` / ``silu_and_mul``, common/models/rope.py
``apply_rotary``, and for decode attention a float64 softmax over the unpaged K/V
(tests/kernels/kernel_cases.py ``dense_attention``) and the torch backend's decode. The C++
ops round differently (FMA, other summation orders, an exp good to about 2e-7), so float32
results are compared with a tolerance: measured max |difference| is printed by each test.
Caches are poisoned with NaN wherever a sequence has no context (the tail of its last block,
spare blocks, and with a sliding window the positions before it), and block tables are padded
with an id far outside the cache, so a kernel that reads what it should not fails.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from kernel_cases import dense_attention

from common.engine.attention.base import AttentionBatch, LayerKV
from common.engine.attention.torch_backend import TorchAttentionBackend
from common.models.layers import rms_norm_hf, silu_and_mul
from common.models.rope import apply_rotary
from kernels.cpu import available, load

pytestmark = pytest.mark.skipif(not available(), reason="the C++ CPU kernels do not build here")

EPS = 1e-6
GARBAGE_BLOCK_ID = 1_000_000


@pytest.fixture(scope="module")
def ops() -> ModuleType:
    return load()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- RMS norm ---------------------------------------------------------------------------------


@pytest.mark.parametrize("hidden", [8, 64, 576, 1000, 1003])  # 1003: a scalar tail after AVX
@pytest.mark.parametrize("num_tokens", [1, 5, 130])  # 130: more than one 64-row chunk
def test_rms_norm_matches_hf(ops: ModuleType, hidden: int, num_tokens: int) -> None:
    gen = _gen(hidden + num_tokens)
    x = 3 * torch.randn(num_tokens, hidden, generator=gen)
    weight = torch.randn(hidden, generator=gen)
    out = ops.rms_norm(x, weight, EPS)
    ref = rms_norm_hf(x, weight, EPS)
    assert out.dtype == torch.float32 and out.shape == x.shape
    print(f"rms_norm H={hidden}: max |diff| {(out - ref).abs().max().item():.2e}")
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6)


def test_rms_norm_reads_strided_rows(ops: ModuleType) -> None:
    """x [T, H] may be a column slice of a wider tensor (rows of stride > H)."""
    gen = _gen(1)
    wide = torch.randn(6, 200, generator=gen)
    x = wide[:, 40:136]  # [6, 96], row stride 200
    weight = torch.randn(96, generator=gen)
    torch.testing.assert_close(
        ops.rms_norm(x, weight, EPS), rms_norm_hf(x, weight, EPS), rtol=2e-6, atol=2e-6
    )


@pytest.mark.parametrize("hidden", [64, 1003])
def test_add_rms_norm_updates_the_residual_in_place(ops: ModuleType, hidden: int) -> None:
    gen = _gen(hidden)
    wide = torch.randn(9, hidden + 16, generator=gen)
    x = wide[:, 8 : 8 + hidden]  # strided rows, as an attention output slice would be
    residual = torch.randn(9, hidden, generator=gen)
    before = residual.clone()
    weight = torch.randn(hidden, generator=gen)
    storage = residual.data_ptr()
    out = ops.add_rms_norm_(x, residual, weight, EPS)
    # The same float32 additions as torch's: exact.
    assert torch.equal(residual, before + x) and residual.data_ptr() == storage
    assert out.data_ptr() != storage
    ref = rms_norm_hf(before + x, weight, EPS)
    print(f"add_rms_norm_ H={hidden}: max |diff| {(out - ref).abs().max().item():.2e}")
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6)
    assert torch.equal(x, wide[:, 8 : 8 + hidden])  # x itself is read only


def test_norm_argument_checks(ops: ModuleType) -> None:
    x, w = torch.randn(4, 16), torch.ones(16)
    with pytest.raises(RuntimeError, match="float32"):
        ops.rms_norm(x.double(), w, EPS)
    with pytest.raises(RuntimeError, match="weight must be contiguous"):
        ops.rms_norm(x, w[:8], EPS)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        ops.rms_norm(x.t(), torch.ones(4), EPS)
    with pytest.raises(RuntimeError, match="residual must be contiguous"):
        ops.add_rms_norm_(x, torch.randn(16, 4).t(), w, EPS)
    with pytest.raises(RuntimeError, match="residual must be contiguous and shaped like x"):
        ops.add_rms_norm_(x, torch.randn(3, 16), w, EPS)


# -- rotary -----------------------------------------------------------------------------------


def _cos_sin(num_positions: int, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.arange(num_positions).float()[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)  # [P, D]


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim"), [(4, 2, 64), (9, 3, 128), (4, 4, 20), (6, 2, 48)]
)
def test_rotary_in_place_on_views_of_the_projection(
    ops: ModuleType, num_q_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    """q and k are views into one [T, (Hq + 2 Hkv) * D] projection output, as the model
    makes them; rotating them in place must leave v (the rest of the row) as it was.
    head_dim 20: half = 10, a scalar tail after one AVX vector; 48: 24 = 3 vectors."""
    gen = _gen(head_dim)
    num_tokens = 37
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen)
    original = qkv.clone()
    q = qkv[:, :q_size].view(num_tokens, num_q_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, 500, (num_tokens,), generator=gen)
    cos_sin = _cos_sin(512, head_dim)
    rows = cos_sin[positions]
    want_q = apply_rotary(original[:, :q_size].view_as(q), rows)
    want_k = apply_rotary(original[:, q_size : q_size + kv_size].view_as(k), rows)
    ops.rotary_(q, positions, cos_sin)
    ops.rotary_(k, positions, cos_sin)
    diff = max((q - want_q).abs().max().item(), (k - want_k).abs().max().item())
    print(f"rotary D={head_dim}: max |diff| {diff:.2e}")
    torch.testing.assert_close(q, want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k, want_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, q_size + kv_size :], original[:, q_size + kv_size :])
    # Position 0 is the identity rotation: exactly the input.
    at_zero = torch.zeros(num_tokens, dtype=torch.long)
    fresh = original[:, :q_size].clone().view(num_tokens, num_q_heads, head_dim)
    expected = fresh.clone()
    ops.rotary_(fresh, at_zero, cos_sin)
    assert torch.equal(fresh, expected)


def test_rotary_argument_checks(ops: ModuleType) -> None:
    x = torch.randn(3, 2, 16)
    cos_sin = _cos_sin(8, 16)
    with pytest.raises(RuntimeError, match="position 8 is outside the rotary table"):
        ops.rotary_(x, torch.tensor([0, 8, 1]), cos_sin)
    with pytest.raises(RuntimeError, match="position -1 is outside"):
        ops.rotary_(x, torch.tensor([0, -1, 1]), cos_sin)
    with pytest.raises(RuntimeError, match="positions must be contiguous int64"):
        ops.rotary_(x, torch.tensor([0, 1, 2], dtype=torch.int32), cos_sin)
    with pytest.raises(RuntimeError, match="cos_sin must be contiguous"):
        ops.rotary_(x, torch.tensor([0, 1, 2]), _cos_sin(8, 8))
    with pytest.raises(RuntimeError, match="contiguous D"):
        ops.rotary_(x.transpose(1, 2), torch.tensor([0, 1, 2]), _cos_sin(8, 2))


# -- KV write ---------------------------------------------------------------------------------


HALF_KV = (torch.float16, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, *HALF_KV])
def test_write_kv_stores_exactly_at_the_slots(ops: ModuleType, dtype: torch.dtype) -> None:
    """float32 caches hold k and v as they are; float16 / bfloat16 caches hold them rounded
    as torch's .to() rounds them (to nearest even)."""
    gen = _gen(3)
    num_blocks, block_size, num_kv_heads, head_dim = 6, 4, 2, 16
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"),
                         dtype=dtype)  # fmt: skip
    v_cache = k_cache.clone()
    num_tokens, num_q_heads = 7, 4
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)  # strided
    v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim).contiguous()
    slots = torch.tensor([5, 0, 23, 12, 13, 14, 3])
    ops.write_kv(k, v, k_cache, v_cache, slots)
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    assert torch.equal(flat_k[slots], k.to(dtype)) and torch.equal(flat_v[slots], v.to(dtype))
    if dtype != torch.float32:  # the rounding is not a truncation: some values round up
        assert bool((flat_k[slots].float().abs() > k.abs()).any())
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert bool(flat_k[untouched].isnan().all()) and bool(flat_v[untouched].isnan().all())


def test_float16_kv_rounds_every_value_as_torch_does(ops: ModuleType) -> None:
    """8 values at a time (vcvtps2ph) and the rest one by one, the same bits as torch's
    .to(float16): overflow to inf, values past float16's range to 0 or its subnormals, NaN,
    -0; rows of 22 values (2 heads of 11), so each row has a tail past its last 8."""
    gen = _gen(4)
    num_tokens, heads, dim = 40, 2, 11
    k = torch.randn(num_tokens, heads, dim, generator=gen)
    k *= torch.logspace(-10, 6, num_tokens).view(-1, 1, 1)  # 1e-10 .. 1e6: every range
    edges = [65504.0, 65519.0, 65520.0, 1e6, -6e-8, 3e-8, 2.9e-8, -0.0, float("inf"), float("nan")]
    k.view(-1)[: len(edges)] = torch.tensor(edges)
    v = -k.flip(0).contiguous()
    k_cache = torch.zeros(10, 4, heads, dim, dtype=torch.float16)
    v_cache = k_cache.clone()
    slots = torch.randperm(40, generator=gen)
    ops.write_kv(k, v, k_cache, v_cache, slots)
    for cache, x in ((k_cache, k), (v_cache, v)):
        stored = cache.view(-1, heads, dim)[slots]
        assert torch.equal(stored.view(torch.int16), x.to(torch.float16).view(torch.int16))


def test_write_kv_argument_checks(ops: ModuleType) -> None:
    cache = torch.zeros(2, 4, 2, 8)
    k = torch.randn(3, 2, 8)
    with pytest.raises(RuntimeError, match="slot -1 is outside the cache"):
        ops.write_kv(k, k, cache, cache.clone(), torch.tensor([0, -1, 2]))
    with pytest.raises(RuntimeError, match="slot 8 is outside the cache"):
        ops.write_kv(k, k, cache, cache.clone(), torch.tensor([0, 8, 2]))
    with pytest.raises(RuntimeError, match="slot_mapping must be int64"):
        ops.write_kv(k, k, cache, cache.clone(), torch.tensor([0, 1, 2], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="must be a float32, float16 or bfloat16"):
        ops.write_kv(k, k, cache.to(torch.int8), cache.to(torch.int8), torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="must have one dtype"):
        ops.write_kv(k, k, cache, cache.half(), torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="do not match the cache"):
        ops.write_kv(torch.randn(3, 1, 8), torch.randn(3, 1, 8), cache, cache.clone(),
                     torch.tensor([0, 1, 2]))  # fmt: skip
    with pytest.raises(RuntimeError, match="contiguous heads"):
        ops.write_kv(k.transpose(1, 2).contiguous().transpose(1, 2), k, cache, cache.clone(),
                     torch.tensor([0, 1, 2]))  # fmt: skip


# -- paged decode attention -------------------------------------------------------------------


def _has_avx512() -> bool:
    """Whether decode_attention_x16.cpp's path is built (with the x16 matmuls' target)."""
    from kernels.cpu import available, load

    return available() and bool(load().has_x16())


def _paged_cache(
    seq_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int,
    window: int, gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:  # fmt: skip
    """(k_cache, v_cache, block_tables int32 [B, M], dense K, dense V): each sequence's
    K/V in shuffled blocks, NaN everywhere else, and before the window (window > 0)."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(seq_lens), max(blocks_per_seq) + 1), GARBAGE_BLOCK_ID,
                        dtype=torch.int32)  # fmt: skip
    dense_k, dense_v = [], []
    for b, n in enumerate(seq_lens):
        ids = [order.pop() for _ in range(blocks_per_seq[b])]
        tables[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        positions = torch.arange(n)
        slots = tables[b, positions // block_size].long() * block_size + positions % block_size
        visible = positions >= n - window if window > 0 else positions >= 0
        k_cache.view(-1, num_kv_heads, head_dim)[slots[visible]] = k[visible]
        v_cache.view(-1, num_kv_heads, head_dim)[slots[visible]] = v[visible]
        dense_k.append(k)
        dense_v.append(v)
    return k_cache, v_cache, tables, dense_k, dense_v


def _decode_case(
    ops: ModuleType, heads: tuple[int, int], head_dim: int, block_size: int, seq_lens: list[int],
    window: int, seed: int = 0,
) -> float:  # fmt: skip
    """Runs the kernel on q as rows of a wider tensor; returns its max |diff| from the float64
    softmax reference, after asserting it is within 2e-5."""
    num_q_heads, num_kv_heads = heads
    gen = _gen(seed)
    k_cache, v_cache, tables, dense_k, dense_v = _paged_cache(
        seq_lens, num_kv_heads, head_dim, block_size, window, gen
    )
    wide = torch.randn(len(seq_lens), (num_q_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    q = wide[:, : num_q_heads * head_dim].view(len(seq_lens), num_q_heads, head_dim)
    scale = head_dim**-0.5
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, window)
    assert out.shape == q.shape and out.dtype == torch.float32
    worst = 0.0
    for b in range(len(seq_lens)):
        ref = dense_attention(q[b : b + 1], dense_k[b], dense_v[b], scale, window or None)[0]
        assert not out[b].isnan().any(), f"sequence {b} (len {seq_lens[b]}) read poison"
        diff = (out[b] - ref).abs().max().item()
        worst = max(worst, diff)
        assert diff < 2e-5, f"sequence {b} (len {seq_lens[b]}): max |diff| {diff:.2e}"
    return worst


def _lengths(block_size: int) -> list[int]:
    # 1 token, exact block multiples, ragged, long.
    return [1, block_size, 3 * block_size, 2 * block_size + 3, 300]


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    """torch's thread count for the block: the kernel picks its task split from it."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("window", [0, 7, 40])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("head_dim", [64, 128, 80, 20])  # 80: 64 + 16 lanes; 20: scalar
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 2), (3, 1)])  # GQA 1, 3, 4; MQA 3
def test_paged_decode_attention_matches_dense_softmax(
    ops: ModuleType, heads: tuple[int, int], head_dim: int, block_size: int, window: int
) -> None:
    """Both task splits: the whole batch on 1 thread (B * Hkv >= 2 * threads: a task per
    (sequence, kv head) serving its query group), then each sequence alone on Hkv threads
    (B * Hkv < 2 * threads: a task per (sequence, query head))."""
    lengths = _lengths(block_size)
    with num_threads(1):
        worst = _decode_case(ops, heads, head_dim, block_size, lengths, window)
    with num_threads(heads[1]):
        for i, length in enumerate(lengths):
            one = _decode_case(ops, heads, head_dim, block_size, [length], window, seed=i + 1)
            worst = max(worst, one)
    print(f"decode {heads} D={head_dim} S={block_size} w={window}: max |diff| {worst:.2e}")


def test_both_task_splits_agree(ops: ModuleType) -> None:
    """The same batch split by kv head (1 thread) and by query head (4 threads): the same
    results up to summation order."""
    gen = _gen(9)
    k_cache, v_cache, tables, _, _ = _paged_cache([5, 70], 2, 64, 16, 0, gen)
    q = torch.randn(2, 8, 64, generator=gen)
    args = (q, k_cache, v_cache, tables, torch.tensor([5, 70], dtype=torch.int32), 0.125, 0)
    with num_threads(1):
        by_kv_head = ops.paged_decode_attention(*args)
    with num_threads(4):
        by_q_head = ops.paged_decode_attention(*args)
    torch.testing.assert_close(by_kv_head, by_q_head, rtol=1e-6, atol=1e-6)


# (sequence lengths, each row's sequence, each row's length): short contexts (one partition
# of the AVX-512 path), and long ones whose verify group crosses partition boundaries (256,
# 512) and whose rows span up to three partitions, joined from partial results.
_ROW_CASES = {
    "short": ([65, 7, 33], [0, 0, 0, 0, 0, 1, 0, 2], [61, 62, 63, 64, 65, 7, 61, 33]),
    "long": ([600, 7, 300], [0, 0, 0, 0, 0, 1, 0, 2, 0, 0],
             [254, 255, 256, 257, 258, 7, 254, 300, 511, 513]),
}


@pytest.mark.parametrize("case", sorted(_ROW_CASES))
@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.skipif(not _has_avx512(), reason="the AVX-512 attention path is not built here")
def test_a_row_computes_the_same_bits_alone_in_a_verify_group_and_in_a_batch(
    ops: ModuleType, block_size: int, window: int, case: str
) -> None:
    """A speculative verify is rows of one sequence (one table, lengths one apart) that
    the AVX-512 path serves together; each row's output must be the bits that row gives
    alone, on any thread count, so verified tokens are plain decoding's. Short rows:
    sequence A at 61..65 (a group), B at 7, A at 61 again (another group), C at 33; long
    rows: A across the partition boundary at 256, B, C, A at 511 and 513."""
    seq_lens, rows, row_lens = _ROW_CASES[case]
    gen = _gen(11)
    k_cache, v_cache, tables, dense_k, dense_v = _paged_cache(seq_lens, 2, 64, block_size,
                                                              0, gen)  # fmt: skip
    lens = torch.tensor(row_lens, dtype=torch.int32)
    q = torch.randn(len(rows), 6, 64, generator=gen)
    table_rows = tables[rows].contiguous()
    with num_threads(2):
        batch = ops.paged_decode_attention(q, k_cache, v_cache, table_rows, lens, 0.125, window)
    for threads in (1, 2, 4):
        with num_threads(threads):
            for i, r in enumerate(rows):
                alone = ops.paged_decode_attention(q[i : i + 1].contiguous(), k_cache, v_cache,
                                                   tables[r : r + 1].contiguous(), lens[i : i + 1],
                                                   0.125, window)  # fmt: skip
                assert torch.equal(alone[0], batch[i]), (threads, i)
    for i, r in enumerate(rows):  # and right: the float64 reference over the row's context
        n = int(lens[i])
        ref = dense_attention(q[i : i + 1], dense_k[r][:n], dense_v[r][:n], 0.125,
                              window or None)[0]  # fmt: skip
        assert (batch[i] - ref).abs().max().item() < 2e-5, i


@pytest.mark.parametrize("dtype", HALF_KV)
@pytest.mark.parametrize("block_size", [4, 16])
def test_a_half_cache_attends_as_a_float32_cache_of_its_values(
    ops: ModuleType, dtype: torch.dtype, block_size: int
) -> None:
    """A float16 / bfloat16 cache is converted exactly on the load, so its attention is the
    bits of the same kernel over a float32 cache of the same values: decodes, a verify group
    and rows over several partitions, with and without a window, on 1 and 2 threads (on the
    AVX-512 path where it is built, else on ops.cpp's AVX2 one)."""
    gen = _gen(12)
    k_cache, v_cache, tables, _, _ = _paged_cache([600, 7, 300], 3, 64, block_size, 0, gen)
    k_half, v_half = k_cache.to(dtype), v_cache.to(dtype)
    rows = [0, 0, 0, 1, 2, 0]
    lens = torch.tensor([255, 256, 257, 7, 300, 600], dtype=torch.int32)
    q = torch.randn(len(rows), 9, 64, generator=gen)
    table_rows = tables[rows].contiguous()
    assert ops.attention_takes(k_half)
    for window in (0, 40):
        for threads in (1, 2):
            with num_threads(threads):
                got = ops.paged_decode_attention(q, k_half, v_half, table_rows, lens, 0.125,
                                                 window)  # fmt: skip
                want = ops.paged_decode_attention(q, k_half.float(), v_half.float(), table_rows,
                                                  lens, 0.125, window)  # fmt: skip
            assert not got.isnan().any()
            assert torch.equal(got, want), (window, threads)


@pytest.mark.parametrize("dtype", HALF_KV)
def test_a_half_cache_of_any_head_dim_is_taken(ops: ModuleType, dtype: torch.dtype) -> None:
    """Head dim 20 is no multiple of 16 (the AVX-512 path declines it) nor of 8 (ops.cpp's
    vector loops): a half cache still attends, on the scalar loops, as a float32 cache of
    its values, and write_kv stores into it."""
    cache = torch.zeros(2, 4, 1, 20, dtype=dtype)
    assert ops.attention_takes(cache) and ops.attention_takes(cache.float())
    gen = _gen(5)
    k, v = torch.randn(7, 1, 20, generator=gen), torch.randn(7, 1, 20, generator=gen)
    k_cache, v_cache = cache.clone(), cache.clone()
    ops.write_kv(k, v, k_cache, v_cache, torch.arange(7))
    assert torch.equal(k_cache.view(-1, 20)[:7], k[:, 0].to(dtype))
    q = torch.randn(1, 2, 20, generator=gen)
    tables, lens = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([7], dtype=torch.int32)
    got = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.2, 0)
    want = ops.paged_decode_attention(q, k_cache.float(), v_cache.float(), tables, lens, 0.2, 0)
    assert torch.equal(got, want)


def test_decode_matches_the_torch_backend(ops: ModuleType) -> None:
    """Against TorchAttentionBackend._decode (gather, mask, SDPA) on a cache without poison
    (its masked softmax would multiply poison by zero weights: NaN)."""
    gen = _gen(4)
    seq_lens, block_size = [1, 16, 23, 64, 130], 16
    for window in (None, 9):
        k_cache, v_cache, tables, _, _ = _paged_cache(seq_lens, 2, 64, block_size, 0, gen)
        k_cache.nan_to_num_(0.0)
        v_cache.nan_to_num_(0.0)
        tables[tables == GARBAGE_BLOCK_ID] = 0
        q = torch.randn(len(seq_lens), 6, 64, generator=gen)
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        batch = AttentionBatch(
            slot_mapping=torch.zeros(0, dtype=torch.long),
            num_decode_tokens=len(seq_lens),
            decode_block_tables=tables,
            decode_seq_lens=lens,
            prefill_block_tables=torch.zeros(0, 1, dtype=torch.int32),
            prefill_query_start_loc=torch.zeros(1, dtype=torch.int32),
            prefill_seq_lens=torch.zeros(0, dtype=torch.int32),
            max_decode_seq_len=max(seq_lens),
            prefill_query_lens_host=[],
            prefill_seq_lens_host=[],
        )
        backend = TorchAttentionBackend(window)
        metadata = backend.prepare(batch, block_size)
        want = backend._decode(q, LayerKV(k_cache, v_cache), metadata, 0.125)
        got = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, window or 0)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_decode_argument_checks(ops: ModuleType) -> None:
    gen = _gen(5)
    k_cache, v_cache, tables, _, _ = _paged_cache([5, 9], 2, 16, 4, 0, gen)
    q = torch.randn(2, 4, 16)
    lens = torch.tensor([5, 9], dtype=torch.int32)

    def call(**changes: object) -> None:
        args = dict(q=q, k=k_cache, v=v_cache, tables=tables, lens=lens, scale=0.25, window=0)
        args.update(changes)
        ops.paged_decode_attention(*args.values())

    with pytest.raises(RuntimeError, match="seq_len 0 of sequence 1"):
        call(lens=torch.tensor([5, 0], dtype=torch.int32))
    # Tables have 4 columns (3 blocks and a pad): 17 tokens do not fit; 13 reach the pad.
    with pytest.raises(RuntimeError, match="seq_len 17 of sequence 1 does not fit"):
        call(lens=torch.tensor([5, 17], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=f"block id {GARBAGE_BLOCK_ID} is outside the cache"):
        call(lens=torch.tensor([5, 13], dtype=torch.int32))
    bad = tables.clone()
    bad[1, 1] = -3
    with pytest.raises(RuntimeError, match="block id -3 is outside the cache"):
        call(tables=bad)
    with pytest.raises(RuntimeError, match="block_tables must be contiguous int32"):
        call(tables=tables.long())
    with pytest.raises(RuntimeError, match="seq_lens must be contiguous int32"):
        call(lens=lens.long())
    with pytest.raises(RuntimeError, match="q's heads do not fit"):
        call(q=torch.randn(2, 3, 16))
    with pytest.raises(RuntimeError, match="contiguous heads"):
        call(q=torch.randn(2, 16, 4).transpose(1, 2))
    with pytest.raises(RuntimeError, match="block size must be a power of two"):
        cache6 = torch.zeros(4, 6, 2, 16)
        call(k=cache6, v=cache6.clone(), tables=torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="float32"):
        call(q=q.double())


# -- SwiGLU -----------------------------------------------------------------------------------


@pytest.mark.parametrize("intermediate", [8, 100, 1536])
@pytest.mark.parametrize("num_tokens", [1, 17])
def test_silu_and_mul_matches_torch(ops: ModuleType, intermediate: int, num_tokens: int) -> None:
    gate_up = 4 * torch.randn(num_tokens, 2 * intermediate, generator=_gen(intermediate))
    gate_up[0, :4] = torch.tensor([-100.0, -88.0, 0.0, 60.0])  # exp's clamped range ends
    out = ops.silu_and_mul(gate_up)
    ref = silu_and_mul(gate_up)
    assert out.shape == (num_tokens, intermediate)
    print(f"silu_and_mul I={intermediate}: max |diff| {(out - ref).abs().max().item():.2e}")
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.silu_and_mul(gate_up.t())


# -- argmax ----------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [1, 7, 8, 9, 1000, 49152])
def test_argmax_rows_picks_what_torch_picks(ops: ModuleType, width: int) -> None:
    """The first index of each row's maximum, ties and all; a row's first NaN if it has
    one; index 0 of a row of -inf; rows strided inside a wider (padded) matrix."""
    gen = _gen(width)
    wide = torch.randn(6, width + 5, generator=gen)
    x = wide[:, :width]
    x[1] = torch.round(x[1])  # many ties
    x[2, width // 2 :] = x[2].max() + 1  # a tie at the maximum, in the second half
    x[3] = float("-inf")
    if width > 2:
        x[4, width - 2] = float("nan")
        x[4, width - 1] = float("nan")
    x[5, -1] = float("inf")
    got = ops.argmax_rows(x)
    assert got.dtype == torch.long
    assert torch.equal(got, x.argmax(dim=-1)), (got, x.argmax(dim=-1))
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.argmax_rows(x.t())


def test_the_sampler_takes_the_kernels_argmax_once_loaded(ops: ModuleType) -> None:
    from common.contract.sampling import SamplingParams
    from common.engine import sampler as sampler_module

    class Row:
        sampling = SamplingParams(max_tokens=1)
        seed, token_ids, output_token_ids, num_output_tokens = 0, [1], [], 0
        stop_ids: frozenset[int] = frozenset()
        request_id = "r"

    logits = torch.randn(3, 70, generator=_gen(70))
    called = []
    real = ops.argmax_rows

    class Spy:
        def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
            called.append(x.shape)
            return real(x)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sampler_module, "loaded", lambda: Spy())
        result = sampler_module.Sampler(64)(logits, [Row()] * 3)
    assert called == [(3, 64)]
    assert result.token_ids == logits[:, :64].argmax(dim=-1).tolist()


# -- the backend and the engine ---------------------------------------------------------------


def _mixed_step(
    kv_dtype: torch.dtype,
) -> tuple[AttentionBatch, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One mixed step: (batch, q, k, v, k_cache, v_cache); block size 4, 2 kv heads, 6 query
    heads, head dim 32."""
    gen = _gen(6)
    block_size, num_kv_heads, num_q_heads, head_dim, num_blocks = 4, 2, 6, 32, 24
    # Sequences: decode at len 9 (blocks 3,4,5), decode at len 4 (block 7),
    # fresh prefill of 6 (blocks 10, 11), prefill of 5 after 8 cached (blocks 12, 13, 14, 15).
    tables = {"d0": [3, 4, 5], "d1": [7], "p0": [10, 11], "p1": [12, 13, 14, 15]}
    contexts = {"d0": 8, "d1": 3, "p0": 0, "p1": 8}  # tokens already in the cache
    new = {"d0": 1, "d1": 1, "p0": 6, "p1": 5}
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(kv_dtype)
    v_cache = torch.randn(shape, generator=gen).to(kv_dtype)
    slots = []
    for rid in tables:
        for pos in range(contexts[rid], contexts[rid] + new[rid]):
            slots.append(tables[rid][pos // block_size] * block_size + pos % block_size)

    def padded(ids: list[str]) -> torch.Tensor:
        width = max(len(tables[r]) for r in ids)
        return torch.tensor([tables[r] + [0] * (width - len(tables[r])) for r in ids],
                            dtype=torch.int32)  # fmt: skip

    batch = AttentionBatch(
        slot_mapping=torch.tensor(slots),
        num_decode_tokens=2,
        decode_block_tables=padded(["d0", "d1"]),
        decode_seq_lens=torch.tensor([9, 4], dtype=torch.int32),
        prefill_block_tables=padded(["p0", "p1"]),
        prefill_query_start_loc=torch.tensor([0, 6, 11], dtype=torch.int32),
        prefill_seq_lens=torch.tensor([6, 13], dtype=torch.int32),
        max_decode_seq_len=9,
        prefill_query_lens_host=[6, 5],
        prefill_seq_lens_host=[6, 13],
    )
    num_tokens = len(slots)
    q = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    return batch, q, k, v, k_cache, v_cache


@pytest.mark.parametrize("kv_dtype", [torch.float32, *HALF_KV])
def test_cpp_backend_step_equals_torch_backend(ops: ModuleType, kv_dtype: torch.dtype) -> None:
    """One mixed step (two decodes, a fresh prefill and a prefill after a cached prefix)
    through both backends' forward, every row on the kernel: the same cache contents bit for
    bit, outputs within float32 rounding. A float16 / bfloat16 cache: the same rounded
    contents, and the C++ output is the bits of its float32 path over those values (the torch
    backend's, which attends over the step's own K/V unrounded, within the cache's
    rounding)."""
    from common.engine.attention.cpp_backend import CppAttentionBackend

    batch, q, k, v, k_cache, v_cache = _mixed_step(kv_dtype)
    block_size, head_dim = 4, 32
    for window in (None, 5):
        results = []
        for backend in (TorchAttentionBackend(window), CppAttentionBackend(window, "kernel")):
            kv = LayerKV(k_cache.clone(), v_cache.clone())
            if isinstance(backend, CppAttentionBackend):
                assert backend.takes(kv)
            metadata = backend.prepare(batch, block_size)
            out = backend.forward(q, k, v, kv, metadata, head_dim**-0.5)
            results.append((out, kv))
        (want, want_kv), (got, got_kv) = results
        assert torch.equal(got_kv.k_cache, want_kv.k_cache)
        assert torch.equal(got_kv.v_cache, want_kv.v_cache)
        if kv_dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            continue
        backend = CppAttentionBackend(window, "kernel")
        kv = LayerKV(k_cache.float(), v_cache.float())
        rounded = backend.forward(q, k.to(kv_dtype).float(), v.to(kv_dtype).float(), kv,
                                  backend.prepare(batch, block_size), head_dim**-0.5)  # fmt: skip
        assert torch.equal(got, rounded)
        torch.testing.assert_close(got, want, rtol=0, atol=2e-2 if kv_dtype == torch.bfloat16 else 2e-3)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_sdpa_prefill_sends_the_chunks_to_sdpa_and_the_decodes_to_the_kernel(
    ops: ModuleType, kv_dtype: torch.dtype
) -> None:
    """prefill_attention="sdpa": the same mixed step's prompt rows are the torch backend's
    bits (its scaled_dot_product_attention, fresh and after a cached prefix), its decode
    rows the kernel's bits, as every-row-on-the-kernel gives them; the cache is written the
    same. "auto" is sdpa exactly where the kernel has no AVX-512 path."""
    from common.engine.attention.cpp_backend import CppAttentionBackend

    batch, q, k, v, k_cache, v_cache = _mixed_step(kv_dtype)
    block_size, head_dim, decodes = 4, 32, 2
    for window in (None, 5):
        outs, caches = [], []
        every_chunk = CppAttentionBackend(window, "sdpa")
        every_chunk.sdpa_min_context = every_chunk.sdpa_min_query = 0
        for backend in (TorchAttentionBackend(window), every_chunk,
                        CppAttentionBackend(window, "kernel")):  # fmt: skip
            kv = LayerKV(k_cache.clone(), v_cache.clone())
            outs.append(backend.forward(q, k, v, kv, backend.prepare(batch, block_size),
                                        head_dim**-0.5))  # fmt: skip
            caches.append(kv)
        torch_out, sdpa_out, kernel_out = outs
        assert torch.equal(sdpa_out[decodes:], torch_out[decodes:])
        assert torch.equal(sdpa_out[:decodes], kernel_out[:decodes])
        for kv in caches[1:]:
            assert torch.equal(kv.k_cache, caches[0].k_cache)
            assert torch.equal(kv.v_cache, caches[0].v_cache)
    # A chunk whose context is shorter than sdpa_min_context stays on the kernel: the fresh
    # 6-token chunk gives the kernel's bits, the 5 tokens after 8 cached ones (13) SDPA's.
    for window in (None, 5):
        short = CppAttentionBackend(window, "sdpa")
        short.sdpa_min_context, short.sdpa_min_query = 10, 1
        outs = []
        for backend in (short, CppAttentionBackend(window, "kernel"), TorchAttentionBackend(window)):
            kv = LayerKV(k_cache.clone(), v_cache.clone())
            outs.append(backend.forward(q, k, v, kv, backend.prepare(batch, block_size),
                                        head_dim**-0.5))  # fmt: skip
        mixed, kernel_out, torch_out = outs
        assert torch.equal(mixed[:decodes], kernel_out[:decodes])
        assert torch.equal(mixed[decodes : decodes + 6], kernel_out[decodes : decodes + 6])
        assert torch.equal(mixed[decodes + 6 :], torch_out[decodes + 6 :])
    assert CppAttentionBackend(None, "auto").sdpa_prefill == (not ops.has_x16())
    assert CppAttentionBackend(None).sdpa_prefill == (not ops.has_x16())
    with pytest.raises(ValueError, match="prefill_attention must be auto, kernel or sdpa"):
        CppAttentionBackend(None, "flash")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.factories import make_tiny_checkpoint

    # intermediate 128: every input width a multiple of the int4 group (the default 112 is not)
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("cpu_ops") / "llama", "llama", intermediate_size=128
    )


# quantization -> max |logit diff| allowed between the backends. Measured over 5 prompts x 20
# steps (logits up to 6.9): float weights 9.1e-6, the ops' float32 rounding through two
# layers; int4 (C++ kernels, int16 activation codes) 2.9e-3: a rounding difference that moves
# an element of x across a code boundary changes the next matmul by a whole code step
# (1.5e-5 of its sub-block's largest |x|), and the random model amplifies it. With int8
# activation codes (a step of 1/127) the same flips reach 0.26 and greedy tokens diverge:
# that path is not compared here.
ENGINE_LOGIT_TOL = {"none": 5e-5, "int4": 1e-2}


@pytest.mark.parametrize("prefill", ["kernel", "sdpa"])
@pytest.mark.parametrize("quantization", list(ENGINE_LOGIT_TOL))
@num_threads(1)  # tiny ops: on a busy machine a second thread is only a sync to wait on
def test_engine_same_greedy_tokens_with_cpp_and_torch_attention(
    tiny_llama: Path, quantization: str, prefill: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny llama, float or int4 (C++ matmuls, 16-bit activation codes, in both), with the
    fused C++ ops (prompt tokens on the kernel, or every chunk through SDPA, however short)
    or the torch ones: the same greedy tokens and every step's logits close."""
    from common.contract.sampling import SamplingParams
    from common.engine.attention.cpp_backend import CppAttentionBackend
    from tests.factories import random_prompts, run_to_completion, tiny_engine

    monkeypatch.setattr(CppAttentionBackend, "sdpa_min_context", 0)
    monkeypatch.setattr(CppAttentionBackend, "sdpa_min_query", 0)

    prompts = {f"r{i}": p for i, p in enumerate(random_prompts(384, [1, 9, 16, 40, 75], seed=3))}
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    tokens, logits = {}, {}
    for backend in ("torch", "cpp"):
        engine = tiny_engine(
            tiny_llama, quantization=quantization, quant_kernel="cpp", quant_act_bits=16,
            attention_backend=backend, max_num_batched_tokens=48,  # chunked prefill and decodes
            prefill_attention=prefill,
        )  # fmt: skip
        assert engine.runner.backend.name == backend
        recorded: dict[str, list[torch.Tensor]] = {}
        sampler = engine.sampler

        def recording(
            batch_logits: torch.Tensor, requests: list, sampler=sampler, recorded=recorded
        ) -> object:
            for row, req in zip(batch_logits, requests, strict=True):
                recorded.setdefault(req.request_id, []).append(row.clone())
            return sampler(batch_logits, requests)

        engine.sampler = recording  # type: ignore[assignment]
        tokens[backend] = run_to_completion(engine, prompts, params)
        logits[backend] = torch.stack([torch.stack(recorded[rid]) for rid in prompts])
        assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
    assert tokens["cpp"] == tokens["torch"]
    diff = (logits["cpp"] - logits["torch"]).abs().max().item()
    print(
        f"{quantization} engine: max |logit diff| cpp vs torch attention {diff:.2e} "
        f"(max |logit| {logits['torch'].abs().max().item():.1f})"
    )
    assert diff < ENGINE_LOGIT_TOL[quantization]
