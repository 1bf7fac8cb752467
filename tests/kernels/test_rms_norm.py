"""rms_norm: kernel vs reference vs transformers' LlamaRMSNorm, residual fusion, checks."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, FLOAT_DTYPES, assert_close
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from kernels.rms_norm import rms_norm, rms_norm_ref

EPS = 1e-6


def _hf(x, weight):
    norm = LlamaRMSNorm(x.shape[1], eps=EPS).to(device=x.device, dtype=x.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        return norm(x)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("hidden", [8, 96, 1000])
def test_matches_reference_and_hf(dtype, hidden):
    x = (3 * torch.randn(5, hidden)).to(dtype).to(DEVICE)
    weight = torch.randn(hidden).to(dtype).to(DEVICE)
    out = rms_norm(x, weight, EPS)
    ref = rms_norm_ref(x, weight, EPS)
    assert isinstance(out, torch.Tensor) and isinstance(ref, torch.Tensor)
    assert out.dtype == dtype
    assert torch.equal(ref, _hf(x, weight))
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_fused_residual(dtype):
    x = torch.randn(4, 64).to(dtype).to(DEVICE)
    residual = torch.randn(4, 64).to(dtype).to(DEVICE)
    weight = torch.randn(64).to(dtype).to(DEVICE)
    out, new_residual = rms_norm(x, weight, EPS, residual)
    ref_out, ref_residual = rms_norm_ref(x, weight, EPS, residual)
    assert torch.equal(new_residual, x + residual) and torch.equal(ref_residual, x + residual)
    assert torch.equal(ref_out, _hf(x + residual, weight))
    assert_close(out, ref_out, dtype)


def test_no_tokens():
    out = rms_norm(torch.empty(0, 16, device=DEVICE), torch.ones(16, device=DEVICE), EPS)
    assert isinstance(out, torch.Tensor) and out.shape == (0, 16)


@pytest.mark.parametrize("fn", [rms_norm, rms_norm_ref])
def test_rejects_bad_arguments(fn):
    x = torch.randn(4, 16, device=DEVICE)
    w = torch.ones(16, device=DEVICE)
    for args in [
        (x[0], w, EPS),  # rank
        (x, w[:8], EPS),  # weight size
        (x, w.half(), EPS),  # weight dtype
        (x.int(), w, EPS),  # dtype
        (x.t(), w, EPS),  # non-contiguous
        (x, w, -1.0),  # eps
        (x, w, EPS, x[:2]),  # residual shape
    ]:
        with pytest.raises(ValueError):
            fn(*args)
