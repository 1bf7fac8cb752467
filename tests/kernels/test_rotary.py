"""apply_rotary: kernel vs reference vs transformers' apply_rotary_pos_emb, checks."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, FLOAT_DTYPES, HEAD_LAYOUTS, assert_close
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kernels.rotary import apply_rotary, apply_rotary_ref

MAX_POS = 64


def _cos_sin_cache(head_dim, base=10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)  # [D/2]
    angles = torch.arange(MAX_POS).float()[:, None] * inv_freq[None, :]  # [P, D/2]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(DEVICE)  # [P, D]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("head_dim", [8, 24, 64])
def test_matches_reference(dtype, heads, head_dim):
    num_q_heads, num_kv_heads = heads
    q = torch.randn(7, num_q_heads, head_dim).to(dtype).to(DEVICE)
    k = torch.randn(7, num_kv_heads, head_dim).to(dtype).to(DEVICE)
    positions = torch.tensor([0, 1, 2, 63, 5, 5, 40], device=DEVICE)
    cache = _cos_sin_cache(head_dim)
    q_out, k_out = apply_rotary(q, k, positions, cache)
    q_ref, k_ref = apply_rotary_ref(q, k, positions, cache)
    assert q_out.dtype == dtype and k_out.shape == k.shape
    assert_close(q_out, q_ref, dtype)
    assert_close(k_out, k_ref, dtype)


def test_reference_matches_hf_rotate_half():
    head_dim = 16
    q = torch.randn(5, 4, head_dim, device=DEVICE)
    k = torch.randn(5, 2, head_dim, device=DEVICE)
    positions = torch.tensor([3, 0, 9, 9, 50], device=DEVICE)
    cache = _cos_sin_cache(head_dim)
    cos, sin = cache[positions].chunk(2, dim=-1)
    full_cos, full_sin = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]
    # transformers wants [batch, heads, seq, D]
    q_hf, k_hf = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], full_cos, full_sin
    )
    q_ref, k_ref = apply_rotary_ref(q, k, positions, cache)
    torch.testing.assert_close(q_ref, q_hf[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_ref, k_hf[0].transpose(0, 1), atol=1e-6, rtol=1e-6)


def test_position_zero_is_identity():
    q = torch.randn(1, 2, 8, device=DEVICE)
    q_out, _ = apply_rotary(
        q, q.clone(), torch.zeros(1, dtype=torch.int64, device=DEVICE), _cos_sin_cache(8)
    )
    assert_close(q_out, q, torch.float32)


@pytest.mark.parametrize("fn", [apply_rotary, apply_rotary_ref])
def test_rejects_bad_arguments(fn):
    q = torch.randn(3, 4, 8, device=DEVICE)
    k = torch.randn(3, 2, 8, device=DEVICE)
    pos = torch.arange(3, device=DEVICE)
    cache = _cos_sin_cache(8)
    for args in [
        (q[0], k, pos, cache),  # rank
        (q, k[:2], pos, cache),  # tokens
        (q, k.half(), pos, cache),  # k dtype
        (q, k, pos.float(), cache),  # positions dtype
        (q, k, pos[:2], cache),  # positions length
        (q, k, pos, cache[:, :4].contiguous()),  # cache width
        (q, k, pos, cache.t().contiguous().t()),  # non-contiguous
        (q[:, :, :7].contiguous(), k[:, :, :7].contiguous(), pos, cache),  # odd head dim
    ]:
        with pytest.raises(ValueError):
            fn(*args)
