"""Q4 and Q8 weights in groups of 32 (GGUF's Q4_0, Q4_1, Q8_0, and the engine's own Q4 / Q8)
in the KQx16 layout, which they take where the x16 kernels are not built and x is coded in
int8 (common/models/quant/linear.py ``kernel_layout``).

# M = activation rows, K = input features, N = output features
"""

from __future__ import annotations

import pytest
import torch

from common.models.quant import linear
from common.models.quant.linear import PackedMatmul, QuantCompute
from common.models.quant.weights import Q4Weight, Q8Weight
from kernels.cpu import available
from kernels.cpu.kquant import KQx16, kq_int8_available, kq_x16_matmul
from tests.kernels.test_kquant_x16 import int8_codes
from tests.kernels.test_quant_matmul import random_q4, random_q8

needs_kq = pytest.mark.skipif(
    not available() or not kq_int8_available(), reason="no KQx16 int8 path here (AVX2 or VNNI)"
)


def q4_0(n: int, k: int, gen: torch.Generator) -> Q4Weight:
    """A Q4 weight as a Q4_0 file's blocks read: every min -8 times its scale."""
    w = random_q4(n, k, 32, gen)
    return Q4Weight(w.qweight, w.scales, (w.scales.float() * -8).half(), 32)


def weights(gen: torch.Generator, n: int = 48, k: int = 256) -> dict[str, Q4Weight | Q8Weight]:
    q8 = random_q8(n, k, 32, gen)
    q8.qweight[:, ::7] = -128  # the code 0 once 128 is added
    return {"Q4_0": q4_0(n, k, gen), "Q4_1": random_q4(n, k, 32, gen), "Q8_0": q8}


def test_each_weight_dequantizes_bit_for_bit_in_the_kq_layout() -> None:
    gen = torch.Generator().manual_seed(0)
    for type_name, w in weights(gen).items():
        kq = w.to_kq_x16()
        assert kq.type_name == type_name
        assert kq.d.dtype == torch.float16 and kq.sc is None and kq.m is None  # half scales
        assert torch.equal(kq.dequantize(), w.dequantize()), type_name
        # bytes as in the file: 4.5 bits a weight for Q4_0, 5 for Q4_1, 8.5 for Q8_0
        bits = {"Q4_0": 4.5, "Q4_1": 5.0, "Q8_0": 8.5}[type_name]
        assert kq.num_bytes * 8 == bits * w.shape[0] * w.shape[1], type_name


@needs_kq
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_int8_activations_multiply_exactly_their_codes(type_name: str) -> None:
    """The float64 product of x's int8 codes and the weights, to float32 slack, for every
    tile the kernel runs (a lone row, passes of up to 4, wide tiles of 8 and 16 rows); each
    row alone gives the same bits."""
    gen = torch.Generator().manual_seed(len(type_name))
    for n in (16, 80):
        w = weights(gen, n, 512)[type_name]
        kq = w.to_kq_x16()
        dense = w.dequantize().double()
        for m in (1, 2, 3, 5, 8, 9, 16, 24):
            x = torch.randn(m, 512, generator=gen) * torch.rand(m, 512, generator=gen) * 4
            out = kq_x16_matmul(x, kq, act_bits=8).double()
            xq = int8_codes(x)
            magnitude = xq.abs() @ dense.abs().t()
            assert bool(((out - xq @ dense.t()).abs() <= 2e-6 * magnitude + 1e-30).all()), (
                type_name, n, m
            )
            alone = kq_x16_matmul(x[-1:].contiguous(), kq, act_bits=8).double()
            assert torch.equal(alone, out[-1:]), (type_name, m)


@needs_kq
def test_packed_matmul_takes_the_kq_layout_without_x16_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the x16 kernels are not built: int8 codes take KQx16 (groups of 32, rows in
    sixteens); int16 codes, other groups and ragged rows keep the rows layout."""
    monkeypatch.setattr(linear, "_x16_ok", False)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 256, generator=gen)
    for type_name, w in weights(gen).items():
        a8 = PackedMatmul(w, QuantCompute("cpp", act_bits=8))
        assert isinstance(a8.weight, KQx16) and a8.weight.type_name == type_name
        assert torch.equal(a8(x), kq_x16_matmul(x, w.to_kq_x16(), act_bits=8))
        a16 = PackedMatmul(w, QuantCompute("cpp", act_bits=16))
        assert a16.weight is not None and a16.weight.layout == "rows", type_name
    for other in (random_q4(48, 256, 64, gen), random_q8(48, 256, 256, gen), random_q4(24, 256, 32, gen)):
        kept = PackedMatmul(other, QuantCompute("cpp", act_bits=8))
        assert kept.weight is not None and kept.weight.layout == "rows"
