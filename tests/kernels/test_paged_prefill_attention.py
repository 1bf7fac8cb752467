"""paged_prefill_attention: kernel vs reference vs dense SDPA, chunked prefill, argument checks."""

from __future__ import annotations

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
from kernels.paged_prefill_attention import paged_prefill_attention, paged_prefill_attention_ref

HEAD_DIM = 16
SCALE = HEAD_DIM**-0.5


def _cases(block_size: int) -> list[tuple[int, int]]:
    """(seq_len, q_len) per sequence: a 1-token prompt, a full prefill of exactly one block, a
    chunk after a cached prefix, a chunk-free sequence, a decode-like chunk of one, and a long
    prompt spanning several query tiles and kv tiles."""
    return [(1, 1), (block_size, block_size), (2 * block_size + 3, 5), (6, 0), (37, 1), (70, 70)]


def _run(dtype, heads, cases, block_size, window, head_dim=HEAD_DIM):
    num_q_heads, num_kv_heads = heads
    seq_lens = [s for s, _ in cases]
    kv = make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype)
    q_lens = torch.tensor([0] + [n for _, n in cases])
    query_start_loc = q_lens.cumsum(0).to(torch.int32).to(DEVICE)
    num_tokens = int(q_lens.sum())
    check_paged_metadata(
        kv.block_tables, kv.seq_lens, kv.k_cache.shape[0], block_size, query_start_loc, num_tokens
    )
    q = torch.randn(num_tokens, num_q_heads, head_dim).to(dtype).to(DEVICE)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, query_start_loc, kv.seq_lens)
    scale = head_dim**-0.5
    out = paged_prefill_attention(*args, scale, window)
    ref = paged_prefill_attention_ref(*args, scale, window)
    return q, kv, query_start_loc.tolist(), out, ref


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [None, 7])
def test_kernel_matches_reference(dtype, heads, block_size, window):
    _, _, _, out, ref = _run(dtype, heads, _cases(block_size), block_size, window)
    assert out.dtype == dtype and out.shape == ref.shape
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("window", [None, 1, 7])
def test_reference_matches_dense_sdpa(heads, window):
    q, kv, starts, _, ref = _run(torch.float32, heads, _cases(4), 4, window)
    for b in range(len(kv.dense_k)):
        lo, hi = starts[b], starts[b + 1]
        if hi > lo:
            expected = dense_attention(q[lo:hi], kv.dense_k[b], kv.dense_v[b], SCALE, window)
            torch.testing.assert_close(ref[lo:hi].cpu(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [8, 24, 64])
def test_head_dims(head_dim):
    _, _, _, out, ref = _run(torch.float16, (4, 2), [(9, 9), (20, 3)], 8, None, head_dim)
    assert_close(out, ref, torch.float16)


@pytest.mark.parametrize("block_size", [1, 6])
def test_unusual_block_sizes(block_size):
    cases = [(13, 13), (20, 7)]
    _, _, _, out, ref = _run(torch.float16, (4, 2), cases, block_size, None)
    assert_close(out, ref, torch.float16)


def test_many_sequences():
    # More sequences than one step of the kernel's tile -> sequence search (SEARCH_BLOCK).
    cases = [(1, 1)] * 130
    _, _, _, out, ref = _run(torch.float32, (2, 1), cases, 4, None)
    assert_close(out, ref, torch.float32)


def test_empty_inputs():
    kv = make_paged_kv([], 2, HEAD_DIM, 4, torch.float32)
    q = torch.empty(0, 4, HEAD_DIM, device=DEVICE)
    qsl = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, qsl, kv.seq_lens, SCALE)
    assert paged_prefill_attention(*args).shape == (0, 4, HEAD_DIM)
    # Sequences present, but no queries (every q_len is 0).
    kv = make_paged_kv([3, 5], 2, HEAD_DIM, 4, torch.float32)
    qsl = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, qsl, kv.seq_lens, SCALE)
    assert paged_prefill_attention(*args).shape == (0, 4, HEAD_DIM)


@pytest.fixture
def valid_args():
    kv = make_paged_kv([5, 9], 2, HEAD_DIM, 4, torch.float16)
    q = torch.randn(6, 4, HEAD_DIM, dtype=torch.float16, device=DEVICE)
    qsl = torch.tensor([0, 2, 6], dtype=torch.int32, device=DEVICE)
    return dict(
        q=q, k_cache=kv.k_cache, v_cache=kv.v_cache, block_tables=kv.block_tables,
        query_start_loc=qsl, seq_lens=kv.seq_lens, scale=SCALE,
    )  # fmt: skip


def _bad_cases(a):
    return {
        "q rank": dict(q=a["q"][0]),
        "q dtype vs cache": dict(q=a["q"].float()),
        "q non-contiguous": dict(q=a["q"][:, :, ::2]),
        "qsl length": dict(query_start_loc=a["query_start_loc"][:2]),
        "qsl dtype": dict(query_start_loc=a["query_start_loc"].float()),
        "qsl non-contiguous": dict(
            query_start_loc=torch.arange(6, dtype=torch.int32, device=DEVICE)[::2]
        ),
        "window negative": dict(sliding_window=-3),
        "cache dtype": dict(k_cache=a["k_cache"].float(), v_cache=a["v_cache"].float()),
        "only k_scale": dict(k_scale=torch.ones(a["k_cache"].shape[0], 2, device=DEVICE)),
    }


BAD_CASES = [
    "q rank", "q dtype vs cache", "q non-contiguous", "qsl length", "qsl dtype",
    "qsl non-contiguous", "window negative", "cache dtype", "only k_scale",
]  # fmt: skip


@pytest.mark.parametrize("fn", [paged_prefill_attention, paged_prefill_attention_ref])
@pytest.mark.parametrize("case", BAD_CASES)
def test_rejects_bad_arguments(fn, case, valid_args):
    with pytest.raises(ValueError):
        fn(**{**valid_args, **_bad_cases(valid_args)[case]})


def test_metadata_check_catches_inconsistent_query_starts(valid_args):
    a = valid_args
    bad = torch.tensor([0, 2, 5], dtype=torch.int32)  # ends at 5, but T = 6
    with pytest.raises(ValueError, match="query_start_loc"):
        check_paged_metadata(a["block_tables"], a["seq_lens"], a["k_cache"].shape[0], 4, bad, 6)
