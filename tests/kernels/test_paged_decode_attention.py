"""paged_decode_attention: kernel vs reference vs dense SDPA, split-K, argument checks."""

from __future__ import annotations

import importlib

import pytest
import torch
from kernel_cases import (
    DEVICE,
    FLOAT_DTYPES,
    HEAD_LAYOUTS,
    assert_close,
    dense_attention,
    make_paged_kv,
)

from kernels.checks import check_paged_metadata
from kernels.paged_decode_attention import (
    MAX_SPLITS,
    choose_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
)

HEAD_DIM = 16
SCALE = HEAD_DIM**-0.5


def _lengths(block_size: int) -> list[int]:
    # 1 token, exactly one block, ragged, and longer than one 64-token kernel tile.
    return [1, block_size, 2 * block_size + 3, 70]


def _run(dtype, heads, block_size, num_splits, window, seq_lens=None):
    num_q_heads, num_kv_heads = heads
    kv = make_paged_kv(seq_lens or _lengths(block_size), num_kv_heads, HEAD_DIM, block_size, dtype)
    check_paged_metadata(kv.block_tables, kv.seq_lens, kv.k_cache.shape[0], block_size)
    q = torch.randn(len(kv.dense_k), num_q_heads, HEAD_DIM).to(dtype).to(DEVICE)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, SCALE, window)
    out = paged_decode_attention(*args, num_splits=num_splits)
    ref = paged_decode_attention_ref(*args, num_splits=num_splits)
    return q, kv, out, ref


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 7])
def test_kernel_matches_reference(dtype, heads, block_size, num_splits, window):
    _, _, out, ref = _run(dtype, heads, block_size, num_splits, window)
    assert out.dtype == dtype and out.shape == ref.shape
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("window", [None, 1, 7, 500])
def test_reference_matches_dense_sdpa(heads, window):
    q, kv, _, ref = _run(torch.float32, heads, 4, 1, window)
    for b in range(q.shape[0]):
        expected = dense_attention(q[b : b + 1], kv.dense_k[b], kv.dense_v[b], SCALE, window)
        torch.testing.assert_close(ref[b : b + 1].cpu(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [8, 24, 64])
def test_head_dims(head_dim):
    kv = make_paged_kv([5, 33], 2, head_dim, 8, torch.float16)
    q = torch.randn(2, 4, head_dim, dtype=torch.float16, device=DEVICE)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, head_dim**-0.5)
    assert_close(paged_decode_attention(*args), paged_decode_attention_ref(*args), torch.float16)


@pytest.mark.parametrize("block_size", [1, 6])
def test_unusual_block_sizes(block_size):
    _, _, out, ref = _run(torch.float16, (4, 2), block_size, 2, None)
    assert_close(out, ref, torch.float16)


@pytest.mark.parametrize("num_splits", [None, 2, 8])
def test_split_k_with_empty_splits(num_splits):
    # 8 splits of a 70-token context leave some programs without a single token.
    _, _, out, ref = _run(torch.float32, (4, 2), 16, num_splits, None, seq_lens=[3, 70, 1])
    assert_close(out, ref, torch.float32)


def test_auto_split_path_runs_split_kernel():
    # Long context, one sequence: the heuristic must split, and the answer must not change.
    kv = make_paged_kv([600], 1, HEAD_DIM, 16, torch.float32)
    q = torch.randn(1, 2, HEAD_DIM, device=DEVICE)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, SCALE)
    assert choose_num_splits(1, 1, kv.block_tables.shape[1] * 16, 4) > 1
    assert_close(paged_decode_attention(*args), paged_decode_attention_ref(*args), torch.float32)


def test_choose_num_splits():
    # Enough (sequence, kv head) programs already: no split.
    assert choose_num_splits(batch=64, num_kv_heads=8, max_context=32768, num_sms=132) == 1
    # Short contexts never split.
    assert choose_num_splits(batch=1, num_kv_heads=8, max_context=256, num_sms=132) == 1
    # One long sequence: split up to the cap, bounded by the length.
    assert choose_num_splits(batch=1, num_kv_heads=8, max_context=32768, num_sms=132) == MAX_SPLITS
    assert choose_num_splits(batch=1, num_kv_heads=8, max_context=1024, num_sms=132) == 4
    # Fill about two programs per SM.
    assert choose_num_splits(batch=4, num_kv_heads=8, max_context=32768, num_sms=132) == 9


def test_empty_batch_returns_empty_without_launching(monkeypatch):
    # (importlib: kernels re-exports a function under the module's name.)
    module = importlib.import_module("kernels.paged_decode_attention")
    monkeypatch.setattr(module, "_decode_kernel", None)  # a launch would raise TypeError
    kv = make_paged_kv([], 2, HEAD_DIM, 4, torch.float32)
    q = torch.empty(0, 4, HEAD_DIM, device=DEVICE)
    out = paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, SCALE)
    assert out.shape == (0, 4, HEAD_DIM)


@pytest.fixture
def valid_args():
    kv = make_paged_kv([5, 9], 2, HEAD_DIM, 4, torch.float16)
    q = torch.randn(2, 4, HEAD_DIM, dtype=torch.float16, device=DEVICE)
    return dict(
        q=q, k_cache=kv.k_cache, v_cache=kv.v_cache, block_tables=kv.block_tables,
        seq_lens=kv.seq_lens, scale=SCALE,
    )  # fmt: skip


BAD_CASES = [
    "q rank", "q dtype", "q dtype vs cache", "q non-contiguous", "q head dim",
    "heads not a multiple", "cache rank", "k/v mismatch", "cache non-contiguous", "tables dtype",
    "tables rows", "seq_lens length", "seq_lens device", "scale type", "window zero",
    "splits zero", "scales on float cache", "int8 cache without scales",
]  # fmt: skip


def _bad_cases(a):
    meta = torch.device("meta")
    return {
        "q rank": dict(q=a["q"][0]),
        "q dtype": dict(q=a["q"].to(torch.int32)),
        "q dtype vs cache": dict(q=a["q"].float()),
        "q non-contiguous": dict(q=a["q"].transpose(0, 1).contiguous().transpose(0, 1)),
        "q head dim": dict(q=a["q"][:, :, :8].contiguous()),
        "heads not a multiple": dict(
            q=torch.randn(2, 3, HEAD_DIM, dtype=torch.float16, device=DEVICE)
        ),
        "cache rank": dict(k_cache=a["k_cache"][0]),
        "k/v mismatch": dict(v_cache=a["v_cache"][:-1]),
        "cache non-contiguous": dict(
            k_cache=a["k_cache"].transpose(1, 2).contiguous().transpose(1, 2)
        ),
        "tables dtype": dict(block_tables=a["block_tables"].float()),
        "tables rows": dict(block_tables=a["block_tables"][:1]),
        "seq_lens length": dict(seq_lens=a["seq_lens"][:1]),
        "seq_lens device": dict(seq_lens=torch.empty(2, dtype=torch.int32, device=meta)),
        "scale type": dict(scale=None),
        "window zero": dict(sliding_window=0),
        "splits zero": dict(num_splits=0),
        "scales on float cache": dict(
            k_scale=torch.ones(a["k_cache"].shape[0], 2, device=DEVICE),
            v_scale=torch.ones(a["k_cache"].shape[0], 2, device=DEVICE),
        ),
        "int8 cache without scales": dict(
            k_cache=a["k_cache"].to(torch.int8), v_cache=a["v_cache"].to(torch.int8)
        ),
    }


@pytest.mark.parametrize("fn", [paged_decode_attention, paged_decode_attention_ref])
@pytest.mark.parametrize("case", BAD_CASES)
def test_rejects_bad_arguments(fn, case, valid_args):
    with pytest.raises(ValueError):
        fn(**{**valid_args, **_bad_cases(valid_args)[case]})


def test_cpu_tensors_need_the_interpreter(valid_args, monkeypatch):
    if DEVICE.type == "cuda":
        pytest.skip("CPU-only check")
    import triton

    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        paged_decode_attention(**valid_args)
