"""kernels/cpu/fp8_matmul.cpp: FP8 E4M3 codes and bfloat16 / float16 weights, 16 rows
interleaved, converted exactly as they are read, multiplied in float32 (a bfloat16 head's x
rounded to bfloat16 first), each row of x alone."""

from __future__ import annotations

import pytest
import torch

from common.models.quant.fp8 import Fp8Weight
from common.models.quant.half import HalfWeight, pack_rows
from common.models.quant.linear import DENSE_MIN_ROWS, PackedMatmul, QuantCompute
from kernels.cpu import available, load
from kernels.cpu import quant as cpu_quant

pytestmark = pytest.mark.skipif(not available(), reason="the C++ CPU kernels do not build here")


def test_every_e4m3_code_converts_exactly() -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # E4M3's two NaNs
    grid = codes.view(16, 16).contiguous()
    identity = torch.eye(16)
    out = cpu_quant.fp8_x16_matmul(identity, pack_rows(grid), torch.full((16,), 2.0**120), 16)
    assert torch.equal(out.t(), grid.view(torch.float8_e4m3fn).float())
    assert out.abs().min() == 0 and out.abs().max() == 448  # subnormals and the largest


@pytest.mark.parametrize("shape", [(1, 576, 1536), (5, 256, 100), (3, 41, 7), (17, 64, 33)])
def test_products_match_float64_and_each_row_is_alone(shape: tuple[int, int, int]) -> None:
    """Odd K, N not a multiple of 16 (a padded block), more rows of x than a tile holds."""
    m, k, n = shape
    torch.manual_seed(0)
    w = (torch.randn(n, k) * 0.2).to(torch.float8_e4m3fn)
    scale = torch.rand(n, 1) * 0.01 + 1e-3
    x = torch.randn(m, k)
    ref = x.double() @ (w.double() * scale.double()).t()
    weight = Fp8Weight.of(w.view(torch.uint8), scale, torch.float32)
    assert torch.equal(weight.codes, w.view(torch.uint8))
    assert torch.equal(weight.dequantize(), w.float() * scale)
    out = cpu_quant.fp8_x16_matmul(x, weight.packed, weight.kernel_scale, n)
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    for i in range(m):  # a row's result does not depend on the rows beside it
        alone = cpu_quant.fp8_x16_matmul(x[i : i + 1].contiguous(), weight.packed, weight.kernel_scale, n)
        assert torch.equal(alone[0], out[i])
    ids = torch.tensor([0, n - 1, n // 2])
    assert torch.equal(weight.lookup(ids), w[ids].float() * scale[ids])
    with pytest.raises(RuntimeError, match="scale must be float32"):
        cpu_quant.fp8_x16_matmul(x, weight.packed, weight.kernel_scale[:-1], n)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "shape", [(1, 576, 160), (17, 101, 37), (9, 64, 16), (3, 1, 5), (16, 63, 150), (7, 96, 208)]
)
def test_interleaved_half_weights(dtype: torch.dtype, shape: tuple[int, int, int]) -> None:
    """Odd K (a column past the last pair), N not a multiple of 16 (a padded block), more
    rows of x than a tile holds (6 or 8), blocks in fours and a remainder: against float64,
    and each row of x as if alone (a lone row takes the blocks one at a time)."""
    m, k, n = shape
    torch.manual_seed(2)
    w = torch.randn(n, k).to(dtype)
    x = torch.randn(m, k)
    head = HalfWeight.of(w)
    assert head.shape == (n, k) and head.packed.shape == (-(-n // 16), k, 16)
    out = cpu_quant.half_x16_matmul(x, head.packed, n)
    # a bfloat16 head multiplies x rounded to bfloat16 (torch's rounding: to nearest even)
    taken = x.to(torch.bfloat16).float() if dtype == torch.bfloat16 else x
    assert torch.equal(head.round_input(x), taken)
    ref = taken.double() @ w.double().t()
    assert out.shape == (m, n)
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert torch.equal(cpu_quant.half_x16_matmul(taken, head.packed, n), out)
    if dtype == torch.bfloat16:  # the rounding matters: float32 x would differ
        assert (x.double() @ w.double().t() - ref).abs().max() > 1e-4 * ref.abs().max()
    for i in range(m):
        alone = cpu_quant.half_x16_matmul(x[i : i + 1].contiguous(), head.packed, n)
        assert torch.equal(alone[0], out[i])


def test_the_interleaved_head_gives_back_its_rows() -> None:
    torch.manual_seed(3)
    w = torch.randn(37, 24).to(torch.bfloat16)
    head = HalfWeight.of(w)
    assert torch.equal(head.dequantize(), w.float())
    assert torch.equal(head.rows(5, 33), w[5:33].float())
    assert torch.equal(head.rows(32, 37), w[32:37].float())
    ids = torch.tensor([[0, 36], [17, 16]])
    assert torch.equal(head.lookup(ids), w[ids].float())
    assert head.num_bytes == 3 * 16 * 24 * 2  # the padded block counted
    with pytest.raises(RuntimeError, match="bfloat16 or float16"):
        load().half_x16_matmul(torch.randn(1, 24), head.packed.float(), 37)
    with pytest.raises(RuntimeError, match="fit the packed blocks"):
        load().half_x16_matmul(torch.randn(1, 24), head.packed, 49)


@pytest.mark.parametrize("kernel", ["cpp", "torch"])
def test_a_bfloat16_head_rounds_x_on_every_path(kernel: str) -> None:
    """The kernel (a step's few rows), torch's float GEMM (many rows, DENSE_MIN_ROWS) and the
    torch kernel all multiply x rounded to bfloat16: their logits agree to float32 rounding,
    where float32 x would move them by bfloat16's step."""
    torch.manual_seed(4)
    n, k = 200, 96
    w = (torch.randn(n, k) * 0.1).to(torch.bfloat16)
    x = torch.randn(DENSE_MIN_ROWS + 2, k)
    ref = x.to(torch.bfloat16).double() @ w.double().t()
    matmul = PackedMatmul(HalfWeight.of(w), QuantCompute(kernel))
    for rows in (x[:3], x):  # the packed kernel's rows; the float GEMM's
        out = matmul(rows.contiguous()).double()
        assert (out - ref[: rows.shape[0]]).abs().max() <= 1e-5 * ref.abs().max()
    unrounded = x.double() @ w.double().t()
    assert (unrounded - ref).abs().max() > 1e-4 * ref.abs().max()
