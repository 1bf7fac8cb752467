"""The KQx16 kernel (kernels/cpu/kquant_x16.cpp) against the float64 reference of the same
weights dequantized, for every K-quant type and Q5_0 / Q5_1; on an AVX-512 machine the
AVX2 path passes the same tests too, from a build of its own (the last test).

# M = activation rows, K = input features, N = output features

The kernel takes int16 codes of x with one step per row (dx = max |x| / 32767) and sums each
group's code products exactly in int32, so its error is the activation rounding's, at most
dx / 2 times the sum of |code * scale| over the row, plus float32 slack for the order of
the per-group terms and the min term (computed from the float sum of x). With act_bits 8
(AVX-512 VNNI) x takes int8 codes per 32 values, and the result is held to the float64
product of those codes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from common.models.quant.kquants import KQUANT_TYPES, read_kq_x16
from kernels.cpu import available
from kernels.cpu.kquant import (
    KQ_LAYOUTS,
    KQx16,
    kq_available,
    kq_int8_available,
    kq_x16_matmul,
    rows,
)
from tests.unit.test_kquants import random_blocks

pytestmark = pytest.mark.skipif(
    not available() or not kq_available(),
    reason="no KQx16 kernels here (the CPU lacks AVX2, and AVX-512 VNNI)",
)

TYPES = sorted(KQUANT_TYPES)
M_VALUES = [1, 2, 3, 4, 5, 9, 16]  # 9 and 16: the 16-bit path's wide tiles of 8 rows (Q3_K, Q6_K)


def random_weight(type_name: str, n: int, k: int, seed: int) -> KQx16:
    raw = random_blocks(type_name, n, k, seed)
    # Random float16 fields span 1e-6..1e2; keep the products' range moderate for float32.
    return read_kq_x16(type_name, raw, n, k)


def error_bound(x: torch.Tensor, w: KQx16) -> torch.Tensor:
    n, k = w.shape
    g = w.group_size
    dx = x.double().abs().amax(dim=-1, keepdim=True) / 32767  # [M, 1]
    codes = (w.codes().double() - w.bias).view(n, k // g, g)
    per_block = KQ_LAYOUTS[w.type_name][3] // g
    scales = rows(w.d).double().repeat_interleave(per_block, dim=1)
    if w.sc is not None:  # None: half scales, every sc 1
        scales = scales * rows(w.sc).double()
    terms = (codes * scales[..., None]).abs().sum(dim=(1, 2))  # [N]: sum |code * scale|
    magnitude = x.double().abs() @ w.dequantize().double().abs().t()
    return 0.5 * dx * terms[None, :] + 1e-6 * magnitude


@pytest.mark.parametrize("type_name", TYPES)
def test_kernel_matches_float64_reference(type_name: str) -> None:
    per_block = KQUANT_TYPES[type_name][0]
    k = 2 * max(per_block, 256)
    gen = torch.Generator().manual_seed(len(type_name))
    for n in (16, 48):
        w = random_weight(type_name, n, k, seed=n)
        dense = w.dequantize().double()
        for m in M_VALUES:
            x = torch.randn(m, k, generator=gen)
            out = kq_x16_matmul(x, w)
            assert out.dtype == torch.float32 and out.shape == (m, n)
            ref = x.double() @ dense.t()
            err = (out.double() - ref).abs()
            bound = error_bound(x, w)
            assert bool((err <= bound).all()), (
                f"{type_name} M={m} N={n}: {(err - bound).max().item():.3e} over the bound"
            )
            assert (err.max() / ref.abs().max()).item() < 2e-4, type_name


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q3_K", "Q5_1"])
def test_each_row_is_computed_alone(type_name: str) -> None:
    w = random_weight(type_name, 48, 512, seed=3)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(1))
    whole = kq_x16_matmul(x, w)
    for lo, hi in [(0, 1), (2, 5), (4, 9), (8, 9)]:
        assert torch.equal(kq_x16_matmul(x[lo:hi].contiguous(), w), whole[lo:hi]), (lo, hi)


def int8_codes(x: torch.Tensor) -> torch.Tensor:
    """x as the 8-bit activation path codes it, back in float64: per 32 values a step of
    max |x| / 127, round to nearest even (float32, as the kernel computes it)."""
    blocks = x.view(x.shape[0], -1, 32)
    absmax = blocks.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(absmax > 0, 127 / absmax, torch.zeros_like(absmax))
    return (torch.round(blocks * inv).double() * (absmax / 127).double()).view_as(x)


@pytest.mark.skipif(not kq_int8_available(), reason="no int8 activation path here")
@pytest.mark.parametrize("type_name", TYPES)
def test_int8_activations_multiply_exactly_their_codes(type_name: str) -> None:
    """With 8-bit activations (vpdpbusd on the same planes, x's codes in the pairing's
    order) the product is the float64 product of x's int8 codes and the weights, to float32
    slack: any code paired with the wrong weight shows far above it. Against x itself the
    error stays within half a step per value."""
    per_block = KQUANT_TYPES[type_name][0]
    k = 2 * max(per_block, 256)
    gen = torch.Generator().manual_seed(7 + len(type_name))
    for n in (16, 48, 80):
        w = random_weight(type_name, n, k, seed=n)
        dense = w.dequantize().double()
        # wide tiles of 16 and 8 rows, the rest in passes of up to 4
        for m in [*M_VALUES, 6, 7, 8, 13, 16, 24]:
            x = torch.randn(m, k, generator=gen) * torch.rand(m, k, generator=gen) * 4
            out = kq_x16_matmul(x, w, act_bits=8).double()
            xq = int8_codes(x)
            magnitude = xq.abs() @ dense.abs().t()
            assert bool(((out - xq @ dense.t()).abs() <= 2e-6 * magnitude + 1e-30).all()), (
                type_name, m, n
            )
            step = x.view(m, -1, 32).abs().amax(-1, keepdim=True).double() / 127
            half_step = (step / 2).expand(m, k // 32, 32).reshape(m, k)
            bound = half_step @ dense.abs().t() + 2e-6 * magnitude
            assert bool(((out - x.double() @ dense.t()).abs() <= bound).all()), (type_name, m)
            # Each row alone gives the same bits.
            alone = kq_x16_matmul(x[-1:].contiguous(), w, act_bits=8).double()
            assert torch.equal(alone, out[-1:])


@pytest.mark.skipif(not kq_int8_available(), reason="no int8 activation path here")
@pytest.mark.parametrize("type_name", TYPES)
def test_a_lone_row_in_four_runs_gives_one_runs_bits(type_name: str) -> None:
    """With 8-bit activations a lone row reads a thread's n-blocks of a type with 4-bit low
    planes in 4 runs at once (kq_rows_i8); each block's sums and float work are a one-block
    tile's, so the output is the same bits as one run and as the row's in a batch, for
    shares long enough to take the runs (hundreds of n-blocks) and every remainder."""
    from kernels.cpu import quant as cpu_quant

    k = max(KQUANT_TYPES[type_name][0], 256)
    gen = torch.Generator().manual_seed(41 + len(type_name))
    try:
        for n in (1040, 1072, 4112):
            w = random_weight(type_name, n, k, seed=n)
            x = torch.randn(1, k, generator=gen) * 3
            cpu_quant.set_row_streams(True)
            runs = kq_x16_matmul(x, w, act_bits=8)
            cpu_quant.set_row_streams(False)
            one = kq_x16_matmul(x, w, act_bits=8)
            assert torch.equal(runs.view(torch.int32), one.view(torch.int32)), (type_name, n)
            batch = torch.cat([x, torch.randn(4, k, generator=gen)])
            assert torch.equal(kq_x16_matmul(batch, w, act_bits=8)[:1], runs), (type_name, n)
    finally:
        cpu_quant.set_row_streams(True)


@pytest.mark.skipif(not kq_int8_available(), reason="no int8 activation path here")
@pytest.mark.parametrize("bits", [4, 8])
def test_integer_codes_multiply_exactly_their_int8_codes(bits: int) -> None:
    """GPTQ / compressed-tensors integer codes (W4, and W8 whose 8-bit codes take each
    nibble plane apart on AVX2) with 8-bit activations: the float64 product of x's int8
    codes and the weights, to float32 slack, each row alone the same bits."""
    from kernels.cpu.kquant import affine_type

    gen = torch.Generator().manual_seed(bits)
    n, k = 48, 256
    codes = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.int16).to(torch.uint8)
    scale = torch.rand(n, k // 32, generator=gen) * 0.01 + 1e-3
    # symmetric codes (GPTQ's sym, W8A8): the code bias 2^(bits - 1), no min term
    w = KQx16.pack(affine_type(bits, 32), codes, scale, torch.ones(n, k // 32), None, None,
                   2 ** (bits - 1), -1.0)  # fmt: skip
    dense = w.dequantize().double()
    for m in (1, 3, 9, 16):
        x = torch.randn(m, k, generator=gen) * 3
        out = kq_x16_matmul(x, w, act_bits=8).double()
        xq = int8_codes(x)
        magnitude = xq.abs() @ dense.abs().t()
        assert bool(((out - xq @ dense.t()).abs() <= 2e-6 * magnitude + 1e-30).all()), (bits, m)
        alone = kq_x16_matmul(x[-1:].contiguous(), w, act_bits=8).double()
        assert torch.equal(alone, out[-1:])


def test_a_file_tensor_multiplies_as_its_dequantized_weights() -> None:
    from pathlib import Path

    from gguf import GGUFReader

    path = Path(__file__).resolve().parents[1] / "data" / "kquants" / "tiny-llama-Q4_K_M.gguf"
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    for name in ("blk.0.ffn_down.weight", "output.weight", "blk.1.attn_q.weight"):
        t = tensors[name]
        rows, k = int(t.shape[1]), int(t.shape[0])
        w = read_kq_x16(t.tensor_type.name, np.asarray(t.data), rows, k)
        x = torch.randn(3, k, generator=torch.Generator().manual_seed(2))
        ref = x.double() @ w.dequantize().double().t()
        out = kq_x16_matmul(x, w).double()
        assert bool(((out - ref).abs() <= error_bound(x, w)).all()), name


def test_bad_arguments_are_refused() -> None:
    w = random_weight("Q4_K", 16, 256, seed=0)
    x = torch.randn(2, 256)
    with pytest.raises(RuntimeError, match="multiple of the float block"):
        kq_x16_matmul(torch.randn(2, 288), w)
    broken = KQx16(w.type_name, w.planes, w.d.double(), w.sc, w.dmin, w.m, w.bias, w.sign)
    with pytest.raises(RuntimeError, match="d must be contiguous"):
        kq_x16_matmul(x, broken)
    # float16 d only where there is one d per group (Q4_K's is one per 8 groups of 32)
    half_d = KQx16(w.type_name, w.planes, w.d.half(), None, w.dmin, None, w.bias, w.sign)
    with pytest.raises(RuntimeError, match="one d per group"):
        kq_x16_matmul(x, half_d)
    q5 = random_weight("Q5_1", 16, 256, seed=0)
    assert q5.d.dtype == torch.float16 and q5.sc is None and q5.m is None
    with_sc = KQx16(q5.type_name, q5.planes, q5.d, torch.ones(1, 8, 16, dtype=torch.int8),
                    q5.dmin, None, q5.bias, q5.sign)  # fmt: skip
    with pytest.raises(RuntimeError, match="without sc and m"):
        kq_x16_matmul(x, with_sc)
    no_min = KQx16(w.type_name, w.planes, w.d, w.sc, w.dmin, None, w.bias, w.sign)
    with pytest.raises(RuntimeError, match="come together"):
        kq_x16_matmul(x, no_min)
    with pytest.raises(RuntimeError, match="act_bits must be 8 or 16"):
        kq_x16_matmul(x, w, act_bits=4)


def test_the_avx2_path_passes_these_tests() -> None:
    """The kernel's AVX2 path (for CPUs without AVX-512 VNNI) runs this module, the half /
    FP8 kernels' tests and the K-quant and GPTQ files' greedy parity in a process whose kernels are built for x86-64-v3
    (PDSERVE_CPU_TARGET=avx2: a build of its own beside the native one, a few minutes the
    first time)."""
    import os
    import subprocess
    import sys

    from kernels.cpu import load

    if not load().has_x16():
        pytest.skip("this build is the AVX2 one already: the tests above ran it")
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PDSERVE_CPU_TARGET": "avx2"}
    check = subprocess.run(
        [sys.executable, "-c", "from kernels.cpu import load; m = load(); "
         "assert m.has_kq() and not m.has_x16(), (m.has_kq(), m.has_x16())"],
        cwd=repo, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert check.returncode == 0, check.stderr[-4000:]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/kernels/test_kquant_x16.py", "tests/kernels/test_fp8_matmul.py",
         "tests/integration/test_kquant_parity.py",
         "tests/integration/test_gptq_awq_parity.py", "-k",
         "not avx2_path and not awq and not int8_activations"],
        cwd=repo, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1], done.stdout[-2000:]

