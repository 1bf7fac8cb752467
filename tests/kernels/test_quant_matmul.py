"""Packed 4-/8-bit matmuls (kernels/cpu/quant_matmul.cpp, common/models/quant/linear.py)
against float64 references over the same quantized values.

# M = activation rows, K = input features, N = output features, G = group size

Reference: ``x.double() @ dequantize(w).double().T``: the weights' quantization is not the
error measured here, only the kernels'. Two checks per case:

- per element, the error bound of the kernels' arithmetic: x is rounded to codes of step
  ``dx = absmax / qmax``, each within ``dx / 2``: per row for act_bits 16 (qmax 32767), per
  sub-block of 32 for act_bits 8 (qmax 127); the code products are summed exactly in int32. So
  ``|y - ref| <= sum over sub-blocks of dx / 2 * sum |q * scale|`` (Q4's min term uses the
  unquantized sums of x), plus float32 rounding (``FLOAT_SLACK`` of ``|x| @ |w|.T``).
- relative to ``max |ref|`` (outputs of at least 16 elements, where that maximum is a stable
  scale; a single output can land near zero). Measured worst per format over the shapes
  below: Q4 a16 8.4e-5, Q8 a16 5.5e-5 (one step per row), Q4 a8 2.0e-2, Q8 a8 1.2e-2 (Q4 is worse than Q8 at
  the same bits: its codes times scale span the whole [min, max] range, so the rounding of x
  multiplies larger terms than |w|). ``REL_TOL`` is 2.4-4x those. The per-element bound is
  used up to 0.47 of itself at most.
"""

from __future__ import annotations

import pytest
import torch

from common.models.quant.linear import (
    DENSE_MIN_ROWS,
    PackedMatmul,
    QuantCompute,
    QuantLinear,
)
from common.models.quant.weights import Q4Weight, Q8Weight, QuantWeight
from kernels.cpu import available
from kernels.cpu import quant as cpu_quant

pytestmark = pytest.mark.skipif(not available(), reason="the C++ CPU kernels do not build here")

REL_TOL = {("q4", 16): 2e-4, ("q8", 16): 2e-4, ("q4", 8): 6e-2, ("q8", 8): 4e-2}
FLOAT_SLACK = 1e-6
QMAX = {16: 32767, 8: 127}
# bfloat16 activations (8 mantissa bits: x within 2^-9 relative) and, for Q4, bfloat16 scale
# and zero: measured max error 4.2e-3 (Q4) / 4.4e-3 (Q8 per row) of max |ref|.
TORCH_KERNEL_REL_TOL = 1.5e-2

K_VALUES = [32, 96, 576, 1536]  # 96: an odd number of sub-blocks (Q4 reads pairs of them)
N_VALUES = [1, 3, 17, 300]  # 300: the N split (chunks of 16) ends mid-chunk
M_VALUES = [1, 2, 3, 5, 8, 33]  # tiles of 4 rows: every remainder 0..3
ROW = "row"  # Q8 with one scale per output row (group size K)


def random_q4(n: int, k: int, group_size: int, generator: torch.Generator) -> Q4Weight:
    """Every code 0..15, scales and mins of both signs' ranges (mins mostly negative)."""
    codes = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8)
    num_groups = k // group_size
    scales = (0.02 + 0.2 * torch.rand(n, num_groups, generator=generator)).half()
    mins = (-8 * scales.float() + 0.3 * torch.randn(n, num_groups, generator=generator)).half()
    return Q4Weight(cpu_quant.pack_q4_codes(codes), scales, mins, group_size)


def random_q8(n: int, k: int, group_size: int, generator: torch.Generator) -> Q8Weight:
    codes = torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int8)
    scales = (0.001 + 0.02 * torch.rand(n, k // group_size, generator=generator)).half()
    return Q8Weight(codes, scales, group_size)


def packed_matmul(x: torch.Tensor, w: QuantWeight, act_bits: int) -> torch.Tensor:
    if isinstance(w, Q4Weight):
        return cpu_quant.q4_matmul(x, w.qweight, w.scales, w.mins, w.group_size, act_bits)
    return cpu_quant.q8_matmul(x, w.qweight, w.scales, w.group_size, act_bits)


def code_magnitudes(w: QuantWeight) -> torch.Tensor:
    """float64 [N, K]: |q * scale|, what the rounding of x multiplies."""
    dense = w.dequantize().double()
    if isinstance(w, Q4Weight):
        dense = dense - w.mins.double().repeat_interleave(w.group_size, dim=1)
    return dense.abs()


def error_bound(x: torch.Tensor, w: QuantWeight, act_bits: int) -> torch.Tensor:
    """float64 [M, N]: the activation rounding's worst case plus float32 slack."""
    m, k = x.shape
    if act_bits == 16:  # one step per row
        dx = x.double().abs().amax(dim=-1, keepdim=True).expand(m, k // 32) / QMAX[16]
    else:  # one step per sub-block of 32
        dx = x.double().view(m, k // 32, 32).abs().amax(dim=-1) / QMAX[8]  # [M, K/32]
    terms = code_magnitudes(w).view(-1, k // 32, 32).sum(dim=-1)  # [N, K/32]
    magnitude = x.double().abs() @ w.dequantize().double().abs().t()
    return 0.5 * dx @ terms.t() + FLOAT_SLACK * magnitude


def make_weight(kind: str, n: int, k: int, group: int | str, gen: torch.Generator) -> QuantWeight:
    if kind == "q4":
        assert isinstance(group, int)
        return random_q4(n, k, group, gen)
    return random_q8(n, k, k if group == ROW else int(group), gen)


FORMATS = [("q4", g) for g in (32, 64, 128)] + [("q8", g) for g in (32, 64, 128, ROW)]
# Every format at every K its group size divides (Q8 per row: G = K, also 96 = 3 * 32).
CASES = [(kind, g, k) for kind, g in FORMATS for k in K_VALUES if g == ROW or k % int(g) == 0]


@pytest.mark.parametrize("act_bits", [16, 8])
@pytest.mark.parametrize(("kind", "group", "k"), CASES)
def test_packed_matmul_matches_float64_reference(
    kind: str, group: int | str, k: int, act_bits: int
) -> None:
    gen = torch.Generator().manual_seed(k * 1000 + act_bits)
    worst = 0.0
    for n in N_VALUES:
        w = make_weight(kind, n, k, group, gen)
        dense = w.dequantize().double()
        for m in M_VALUES:
            x = torch.randn(m, k, generator=gen)
            out = packed_matmul(x, w, act_bits)
            assert out.dtype == torch.float32 and out.shape == (m, n)
            ref = x.double() @ dense.t()
            err = (out.double() - ref).abs()
            bound = error_bound(x, w, act_bits)
            where = f"{kind} G={group} a{act_bits} M={m} K={k} N={n}"
            assert bool((err <= bound).all()), (
                f"{where}: error {err.max().item():.3e} exceeds the bound by "
                f"{(err - bound).max().item():.3e}"
            )
            if m * n >= 16:
                rel = (err.max() / ref.abs().max()).item()
                worst = max(worst, rel)
                assert rel <= REL_TOL[(kind, act_bits)], f"{where}: relative error {rel:.3e}"
    print(f"{kind} G={group} K={k} a{act_bits}: max error / max|ref| = {worst:.2e}")


@pytest.mark.parametrize("group", [32, 64, ROW])
def test_a_lone_int8_row_gives_the_bits_it_gives_in_a_batch(group: int | str) -> None:
    """One row of 8-bit codes against Q8 weights takes the weight rows two at a time (a
    decode step's head); the sums are the batch tiles' in the same order, so the row's
    outputs are the bits it gets beside other rows, odd N's last row included."""
    gen = torch.Generator().manual_seed(11)
    for k in (64, 576):
        if group != ROW and k % int(group):
            continue
        w = make_weight("q8", 37, k, group, gen)
        x = torch.randn(3, k, generator=gen) * 3
        batch = packed_matmul(x, w, 8)
        for i in range(3):
            assert torch.equal(packed_matmul(x[i : i + 1].contiguous(), w, 8), batch[i : i + 1]), (k, i)


@pytest.mark.parametrize("act_bits", [16, 8])
@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_zero_and_mixed_magnitude_sub_blocks(kind: str, act_bits: int) -> None:
    """A sub-block of zeros (dx = 0) gives exact zero contributions; sub-blocks of very
    different magnitudes each get their own step."""
    gen = torch.Generator().manual_seed(7)
    k = 256
    w = make_weight(kind, 40, k, 64, gen)
    x = torch.randn(6, k, generator=gen)
    x[:, 32:64] = 0
    x[:, 64:96] *= 1e4
    x[:, 96:128] *= 1e-4
    x[5] = 0
    out = packed_matmul(x, w, act_bits)
    ref = x.double() @ w.dequantize().double().t()
    assert bool(((out.double() - ref).abs() <= error_bound(x, w, act_bits)).all())
    # An all-zero row: the Q4 min term and every product vanish exactly.
    assert torch.equal(out[5], torch.zeros(40))


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_q4_dequantize_rows_are_bit_exact(group_size: int) -> None:
    gen = torch.Generator().manual_seed(group_size)
    n, k = 70, 384
    w = random_q4(n, k, group_size, gen)
    ref = cpu_quant.dequantize_q4_ref(w.qweight, w.scales, w.mins, group_size)
    assert torch.equal(w.dequantize(), ref)
    for start, end in [(0, n), (0, 1), (5, 21), (17, 70), (69, 70), (33, 33)]:
        rows = cpu_quant.q4_dequantize(w.qweight, w.scales, w.mins, group_size, start, end)
        assert rows.shape == (end - start, k) and rows.dtype == torch.float32
        assert torch.equal(rows, ref[start:end]), (start, end)
    assert torch.equal(cpu_quant.q4_dequantize(w.qweight, w.scales, w.mins, group_size), ref)


def test_q4_pack_unpack_round_trip_and_nibble_order() -> None:
    codes = torch.arange(64, dtype=torch.uint8).remainder(16).view(1, 64)
    packed = cpu_quant.pack_q4_codes(codes)
    # Byte j of a sub-block: element j in the low nibble, element 16 + j in the high one.
    assert packed[0, :16].tolist() == [j | (j << 4) for j in range(16)]
    assert torch.equal(cpu_quant.unpack_q4_codes(packed), codes)
    random_codes = torch.randint(0, 16, (5, 96), dtype=torch.uint8)
    assert torch.equal(
        cpu_quant.unpack_q4_codes(cpu_quant.pack_q4_codes(random_codes)), random_codes
    )


def test_references_are_the_stated_formulas() -> None:
    """w = q * scale + min (Q4), w = q * scale (Q8), one scale per group of G along K."""
    codes = torch.tensor([[0, 15] * 32], dtype=torch.uint8)  # [1, 64]
    scales = torch.tensor([[0.5, 2.0]], dtype=torch.float16)
    mins = torch.tensor([[-1.0, 3.0]], dtype=torch.float16)
    q4 = cpu_quant.dequantize_q4_ref(cpu_quant.pack_q4_codes(codes), scales, mins, 32)
    assert q4[0, :2].tolist() == [-1.0, 6.5] and q4[0, 32:34].tolist() == [3.0, 33.0]
    q8 = cpu_quant.dequantize_q8_ref(torch.tensor([[-127, 3] * 32], dtype=torch.int8), scales, 32)
    assert q8[0, :2].tolist() == [-63.5, 1.5] and q8[0, 32:34].tolist() == [-254.0, 6.0]


# -- argument checks ------------------------------------------------------------------------


def _q4_args(m: int = 2, n: int = 4, k: int = 64, g: int = 32) -> list:
    w = random_q4(n, k, g, torch.Generator().manual_seed(0))
    return [torch.randn(m, k), w.qweight, w.scales, w.mins, g, 16]


def _q8_args(m: int = 2, n: int = 4, k: int = 64, g: int = 32) -> list:
    w = random_q8(n, k, g, torch.Generator().manual_seed(0))
    return [torch.randn(m, k), w.qweight, w.scales, g, 16]


def _replace(args: list, index: int, value: object) -> list:
    return [value if i == index else a for i, a in enumerate(args)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (_replace(_q4_args(), 0, torch.randn(2, 64, dtype=torch.float64)), "x must be float32"),
        (_replace(_q4_args(), 0, torch.randn(64, 2).t()), "contiguous"),
        (_replace(_q4_args(), 0, torch.randn(2, 32)), "columns"),  # x's K != the weight's
        (_replace(_q4_args(), 1, _q4_args()[1].view(torch.int8)), "uint8"),
        (_replace(_q4_args(), 2, _q4_args()[2].float()), "scales must be contiguous float16"),
        (_replace(_q4_args(), 3, _q4_args()[3][:, :1].contiguous()), "mins must be"),
        (_replace(_q4_args(), 3, _q4_args()[3].float()), "mins must be"),
        (_replace(_q4_args(), 4, 48), "power of two"),
        (_replace(_q4_args(), 4, 16), "power of two"),
        (_replace(_q4_args(), 4, 128), "power of two"),  # does not divide K = 64
        (_replace(_q4_args(), 5, 4), "act_bits must be 8 or 16"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_q4_matmul_rejects_bad_arguments(args: list, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        cpu_quant.q4_matmul(*args)


def test_k_must_be_a_multiple_of_32() -> None:
    # K = 48: qweight [N, 24] fits x, but 48 is no whole number of sub-blocks.
    x, one, zero = torch.randn(2, 48), torch.ones(4, 1).half(), torch.zeros(4, 1).half()
    with pytest.raises(RuntimeError, match="K must be a multiple of 32, got 48"):
        cpu_quant.q4_matmul(x, torch.zeros(4, 24, dtype=torch.uint8), one, zero, 48)
    with pytest.raises(RuntimeError, match="K must be a multiple of 32, got 48"):
        cpu_quant.q8_matmul(x, torch.zeros(4, 48, dtype=torch.int8), one, 48)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (_replace(_q8_args(), 0, torch.randn(2, 64).half()), "x must be float32"),
        (_replace(_q8_args(), 1, _q8_args()[1].view(torch.uint8)), "int8"),
        (_replace(_q8_args(), 2, _q8_args()[2][:, :1].contiguous()), "scales must be"),
        (_replace(_q8_args(), 3, 96), "power of two"),  # neither a power of two nor K
        (_replace(_q8_args(), 4, 12), "act_bits must be 8 or 16"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_q8_matmul_rejects_bad_arguments(args: list, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        cpu_quant.q8_matmul(*args)


def test_q4_dequantize_rejects_bad_row_ranges() -> None:
    w = random_q4(8, 64, 32, torch.Generator().manual_seed(0))
    for start, end in [(-1, 4), (5, 4), (0, 9)]:
        with pytest.raises(RuntimeError, match="bad row range"):
            cpu_quant.q4_dequantize(w.qweight, w.scales, w.mins, 32, start, end)


# -- the layers over the kernels ------------------------------------------------------------


@pytest.mark.parametrize("m", [1, 5, DENSE_MIN_ROWS])
@pytest.mark.parametrize(("kind", "group"), [("q4", 32), ("q4", 128), ("q8", ROW)])
def test_torch_kernel_path_within_bfloat16_tolerance(kind: str, group: int | str, m: int) -> None:
    """torch's packed kernels take bfloat16 x (and, for Q4, bfloat16 scale and zero)."""
    gen = torch.Generator().manual_seed(m)
    # torch's int4pack packs rows in sixteens: 200 rows are padded to 208 and sliced back.
    k, n = 512, 200
    w = make_weight(kind, n, k, group, gen)
    x = torch.randn(m, k, generator=gen)
    out = PackedMatmul(w, QuantCompute("torch"))(x)
    ref = x.double() @ w.dequantize().double().t()
    assert out.dtype == torch.float32 and out.shape == (m, n)
    rel = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    print(f"torch kernel {kind} G={group} M={m}: max error / max|ref| = {rel:.2e}")
    assert rel <= TORCH_KERNEL_REL_TOL
    # Not the float64 answer to float32 precision: bfloat16 does show (the test sees the path).
    assert rel > 1e-5


def test_cpp_kernels_refuse_input_widths_off_32_at_construction() -> None:
    """A layer the C++ kernels cannot run fails when the model loads, naming the way out,
    not at the first request; torch's kernels take it."""
    w = Q8Weight.quantize_per_channel(torch.randn(8, 112))
    with pytest.raises(ValueError, match=r"multiples of 32; this layer has 112.*quant-kernel torch"):
        PackedMatmul(w, QuantCompute("cpp"))
    x = torch.randn(3, 112)
    out = PackedMatmul(w, QuantCompute("torch"))(x)
    ref = x.double() @ w.dequantize().double().t()
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < TORCH_KERNEL_REL_TOL


def test_torch_kernel_blocked_q8_is_dequantize_then_gemm() -> None:
    """Blocked Q8 (GGUF's Q8_0) has no torch packed kernel: float32 GEMM on the
    dequantized weight, so float32 accuracy."""
    gen = torch.Generator().manual_seed(3)
    w = random_q8(50, 256, 32, gen)
    x = torch.randn(4, 256, generator=gen)
    out = PackedMatmul(w, QuantCompute("torch"))(x)
    ref = x.double() @ w.dequantize().double().t()
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_cpp_path_switches_to_dense_gemm_for_many_rows(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """M >= DENSE_MIN_ROWS: the weight is dequantized in chunks of rows and multiplied in
    float32 (exact weights, float32 GEMM); chunks made small so several are used."""
    from common.models.quant import linear

    monkeypatch.setattr(linear, "_x16_ok", False)  # x16 weights have the packed path only
    gen = torch.Generator().manual_seed(11)
    k, n = 128, 70
    monkeypatch.setattr(linear, "_CHUNK_ELEMENTS", 16 * k)  # 16 rows per chunk: 5 chunks
    w = make_weight(kind, n, k, 32, gen)
    x = torch.randn(DENSE_MIN_ROWS, k, generator=gen)
    out = PackedMatmul(w, QuantCompute("cpp"))(x)
    ref = x.double() @ w.dequantize().double().t()
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-6
    # One row fewer takes the packed kernel: int16 x codes, a visibly different rounding.
    small = PackedMatmul(w, QuantCompute("cpp"))(x[: DENSE_MIN_ROWS - 1])
    assert not torch.equal(small, out[: DENSE_MIN_ROWS - 1])
    small_err = (small.double() - ref[: DENSE_MIN_ROWS - 1]).abs().max() / ref.abs().max()
    assert small_err.item() < REL_TOL[(kind, 16)]


@pytest.mark.parametrize("kernel", ["cpp", "torch"])
def test_fused_layer_of_mixed_formats_is_the_concatenation(kernel: str) -> None:
    """A fused q/k/v whose parts came as Q4 g32, Q8 per row and Q4 g64 (a GGUF may mix
    them): each part multiplies in its own format, outputs concatenated, then the bias."""
    gen = torch.Generator().manual_seed(5)
    k = 128
    parts: list[QuantWeight] = [
        random_q4(32, k, 32, gen),
        Q8Weight.quantize_per_channel(torch.randn(16, k, generator=gen)),
        random_q4(16, k, 64, gen),
    ]
    bias = torch.randn(64, generator=gen)
    offsets = {"q": (0, 32), "k": (32, 48), "v": (48, 64)}
    layer = QuantLinear(parts, bias, QuantCompute(kernel), offsets)
    assert (layer.in_features, layer.out_features) == (k, 64)
    assert layer.format == "q4/g32+q4/g64+q8/row"
    assert layer.shard_offsets == offsets
    assert layer.num_weight_bytes == sum(p.num_bytes for p in parts)
    x = torch.randn(2, 3, k, generator=gen)  # leading dims are kept
    out = layer(x)
    assert out.shape == (2, 3, 64)
    flat = x.reshape(6, k)
    expected = torch.cat([PackedMatmul(p, QuantCompute(kernel))(flat) for p in parts], dim=1)
    assert torch.equal(out.reshape(6, 64), expected + bias)
    dense = torch.cat([p.dequantize() for p in parts]).double()
    ref = flat.double() @ dense.t() + bias.double()
    tol = 1e-4 if kernel == "cpp" else TORCH_KERNEL_REL_TOL
    assert ((out.reshape(6, 64).double() - ref).abs().max() / ref.abs().max()).item() < tol


def test_quant_compute_rejects_unknown_settings() -> None:
    with pytest.raises(ValueError, match="unknown quantized kernel"):
        QuantCompute("cuda")
    with pytest.raises(ValueError, match="activation bits must be 8 or 16"):
        QuantCompute("cpp", 4)
