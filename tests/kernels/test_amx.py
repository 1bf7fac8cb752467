"""The x16 kernels' 8-bit tiles of 16 rows on AMX (kernels/cpu/quant_x16.cpp
``x16_wide_i8_amx``) against the same kernels on AVX-512 alone: the same bits, for Q4 with
mins and without (symmetric), Q8 in groups and per row, every count of n-blocks a pass takes
(1-3, and chunks of 4 split 3 + 1), and row counts with wide tiles of 16 beside 8-row tiles
and smaller passes. Runs only where the CPU has AMX and Linux grants the tiles.

# M = activation rows, K = input features, N = output features, G = group size
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

import pytest
import torch

from kernels.cpu import available
from kernels.cpu import quant as cpu_quant
from tests.kernels.test_quant_matmul import random_q4, random_q8

needs_amx = pytest.mark.skipif(
    not available() or not cpu_quant.has_x16() or not cpu_quant.amx_available(),
    reason="no AMX int8 tiles here (or the kernel refused them)",
)


@pytest.fixture
def amx_restored() -> Iterator[None]:
    yield
    cpu_quant.set_amx(True)


def both_paths(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    cpu_quant.set_amx(False)
    vector = fn(x)
    cpu_quant.set_amx(True)
    return vector, fn(x)


@needs_amx
@pytest.mark.parametrize("m", [16, 17, 24, 32, 40])
@pytest.mark.parametrize("n", [16, 32, 48, 64, 112])
def test_q4_tiles_on_amx_give_the_vector_paths_bits(m: int, n: int, amx_restored: None) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n)
    k = 192
    for symmetric in (False, True):
        w = random_q4(n, k, 32, gen)
        mins = (w.scales.float() * -8).half() if symmetric else w.mins
        packed, scales, held = cpu_quant.pack_q4_x16(w.qweight, w.scales, mins)
        assert (held.numel() == 0) == symmetric
        x = torch.randn(m, k, generator=gen) * 3
        run = partial(
            cpu_quant.q4x16_matmul, qweight=packed, scales=scales, mins=held, group_size=32,
            n=n, act_bits=8,
        )  # fmt: skip
        vector, amx = both_paths(run, x)
        assert torch.equal(vector, amx), (symmetric, (vector - amx).abs().max())


@needs_amx
@pytest.mark.parametrize("m", [16, 33, 48])
@pytest.mark.parametrize("n", [16, 48, 80])
@pytest.mark.parametrize("group", [32, 64, 256])
def test_q8_tiles_on_amx_give_the_vector_paths_bits(
    m: int, n: int, group: int, amx_restored: None
) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + group)
    k = 256
    w = random_q8(n, k, group, gen)
    w.qweight[:, ::5] = -128  # the code 0 once the top bit flips
    w.qweight[::3, 1::5] = 127
    packed, scales = cpu_quant.pack_q8_x16(w.qweight, w.scales)
    x = torch.randn(m, k, generator=gen)
    x[0, :32] = 0.0  # a sub-block of zero codes (step 0)

    def run(x: torch.Tensor) -> torch.Tensor:
        return cpu_quant.q8x16_matmul(x, packed, scales, group, n, act_bits=8)

    vector, amx = both_paths(run, x)
    assert torch.equal(vector, amx), (vector - amx).abs().max()
    # and the AVX-512 path is what it was: against the float64 product of the same codes
    reference = x.double() @ (w.qweight.double() * w.scales.double().repeat_interleave(group, 1)).T
    assert torch.allclose(amx.double(), reference, rtol=0.05, atol=0.05 * float(reference.abs().max()))


@needs_amx
def test_amx_switch_reads_back(amx_restored: None) -> None:
    load = cpu_quant.load()
    cpu_quant.set_amx(False)
    assert not load.amx_on()
    cpu_quant.set_amx(True)
    assert load.amx_on()
