"""The x16 layouts and kernels (kernels/cpu/quant_x16.cpp: 16 weight rows in a 512-bit
register's lanes) against the float64 reference, the rows-layout kernels and themselves.

# M = activation rows, K = input features, N = output features, G = group size

The x16 kernels take int16 codes of x with one step per row, as the rows kernels' act_bits
16, and sum each sub-block's code products exactly in int32; only the float32 order of the
per-sub-block terms differs. So the error bound and tolerance are test_quant_matmul.py's for
act_bits 16, and the two kernels agree far inside them. With act_bits 8 they take int8
codes per 32 elements and are held to the float64 product of those codes.
"""

from __future__ import annotations

import pytest
import torch

from common.models.quant import linear
from common.models.quant.linear import PackedMatmul, QuantCompute
from common.models.quant.weights import Q4Weight, Q8Weight, QuantWeight
from kernels.cpu import available
from kernels.cpu import quant as cpu_quant
from kernels.cpu.kquant import lanes
from tests.kernels.test_quant_matmul import (
    K_VALUES,
    REL_TOL,
    ROW,
    error_bound,
    make_weight,
    packed_matmul,
    random_q4,
    random_q8,
)

pytestmark = pytest.mark.skipif(
    not available() or not cpu_quant.has_x16(),
    reason="no x16 kernels here (the CPU lacks AVX-512 BW / VL or VNNI)",
)

# n-blocks 1, 3, 5, 19: every remainder of the 4-block (one row) and 2-block (tiles) passes.
N_VALUES = [16, 48, 80, 304]
M_VALUES = [1, 2, 3, 4, 5, 7, 9, 33]
FORMATS = [("q4", g) for g in (32, 64, 128)] + [("q8", g) for g in (32, 128, ROW)]
CASES = [(kind, g, k) for kind, g in FORMATS for k in K_VALUES if g == ROW or k % int(g) == 0]


def x16_matmul(x: torch.Tensor, w: QuantWeight, act_bits: int = 16) -> torch.Tensor:
    packed = w.to_x16()
    n = w.shape[0]
    if isinstance(packed, Q4Weight):
        return cpu_quant.q4x16_matmul(x, packed.qweight, packed.scales, packed.mins,
                                      packed.group_size, n, act_bits)  # fmt: skip
    return cpu_quant.q8x16_matmul(x, packed.qweight, packed.scales, packed.group_size, n, act_bits)


@pytest.mark.parametrize(("kind", "group_size", "k"), CASES)
def test_int8_activations_multiply_exactly_their_codes(
    kind: str, group_size: int | str, k: int
) -> None:
    """act_bits 8: x in int8 codes per 32 elements (step max |x| / 127, round half to even),
    4 codes per vpdpbusd (Q4's nibbles two by two, Q8's chunks interleaved by vpermw). The
    result is the float64 product of those codes and the weights to float32 slack, for
    every row count and n-block remainder; any code met by the wrong weight shows far above
    it. Each row alone gives the same bits."""
    from tests.kernels.test_kquant_x16 import int8_codes

    gen = torch.Generator().manual_seed(k + len(kind))
    for n in (16, 80):
        w = make_weight(kind, n, k, group_size, gen)
        dense = w.dequantize().double()
        # 9 and fewer rows in passes of up to 8; from 8, wide tiles of 16 and 8, then passes
        for m in (1, 3, 4, 9, 13, 16, 24):
            x = torch.randn(m, k, generator=gen) * torch.rand(m, k, generator=gen) * 4
            out = x16_matmul(x, w, act_bits=8).double()
            xq = int8_codes(x)
            magnitude = xq.abs() @ dense.abs().t()
            err = (out - xq @ dense.t()).abs()
            assert bool((err <= 2e-6 * magnitude + 1e-30).all()), (kind, group_size, k, n, m)
            for row in {0, m - 1}:
                alone = x16_matmul(x[row : row + 1].contiguous(), w, act_bits=8).double()
                assert torch.equal(alone, out[row : row + 1]), (kind, m, row)


def test_q4_x16_byte_order_is_the_documented_one() -> None:
    """Chunk c of n-block j, sub-block b: word 2i + h holds q[16j + i, 32b + 8c + 2t + h]
    in nibble t."""
    n, k = 32, 64
    codes = (torch.arange(n * k).view(n, k) * 7 % 16).to(torch.uint8)
    packed, _, _ = cpu_quant.pack_q4_x16(
        cpu_quant.pack_q4_codes(codes), torch.ones(n, 2).half(), torch.zeros(n, 2).half()
    )
    assert packed.shape == (2, 2, 4, 64)
    words = packed.view(2, 2, 4, 32, 2).to(torch.int32)
    words = words[..., 0] | (words[..., 1] << 8)  # little-endian 16-bit
    for j, b, c, i, h, t in [(0, 0, 0, 0, 0, 0), (1, 1, 3, 15, 1, 3), (0, 1, 2, 7, 0, 2)]:
        nibble = (words[j, b, c, 2 * i + h] >> (4 * t)) & 15
        assert nibble.item() == codes[16 * j + i, 32 * b + 8 * c + 2 * t + h].item()


def test_q8_x16_byte_order_is_the_documented_one() -> None:
    n, k = 32, 64
    codes = (torch.arange(n * k).view(n, k) % 251 - 125).to(torch.int8)
    packed, scales = cpu_quant.pack_q8_x16(codes, torch.rand(n, 2).half())
    assert packed.shape == (2, 2, 16, 32) and scales.shape == (2, 2, 16)
    for j, b, c, i, h in [(0, 0, 0, 0, 0), (1, 1, 15, 15, 1), (1, 0, 9, 4, 0)]:
        assert packed[j, b, c, 2 * i + h] == codes[16 * j + i, 32 * b + 2 * c + h]


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_layouts_convert_exactly_both_ways(group_size: int) -> None:
    gen = torch.Generator().manual_seed(group_size)
    q4 = random_q4(48, 256, group_size, gen)
    q8 = random_q8(48, 256, group_size, gen)
    for w in (q4, q8):
        packed = w.to_x16()
        assert packed.layout == "x16" and packed.shape == w.shape == (48, 256)
        assert packed.num_bytes == w.num_bytes
        back = packed.to_rows()
        assert back.layout == "rows"
        assert torch.equal(back.qweight, w.qweight) and torch.equal(back.scales, w.scales)
        if isinstance(w, Q4Weight):
            assert isinstance(back, Q4Weight) and torch.equal(back.mins, w.mins)
        assert torch.equal(packed.dequantize(), w.dequantize())


@pytest.mark.parametrize("group_size", [32, 64])
def test_symmetric_q4_holds_no_mins_and_multiplies_as_if_it_did(group_size: int) -> None:
    """Every min -8 x its scale (GGUF's Q4_0, GPTQ's sym): the x16 layout holds no mins
    (4.5 bits a weight at groups of 32), and every path (a lone row, tiles, wide tiles of 8
    and 16 rows; 16- and 8-bit codes of x) gives the bits it gives with the mins held."""
    gen = torch.Generator().manual_seed(group_size)
    n, k = 80, 256
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = (0.02 + 0.2 * torch.rand(n, k // group_size, generator=gen)).half()
    w = Q4Weight(cpu_quant.pack_q4_codes(codes), scales, (scales.float() * -8).half(), group_size)
    packed = w.to_x16()
    assert packed.mins.numel() == 0
    assert packed.num_bytes == w.num_bytes - w.mins.numel() * 2
    back = packed.to_rows()
    assert torch.equal(back.mins, w.mins) and torch.equal(packed.dequantize(), w.dequantize())
    ids = torch.tensor([79, 0, 16, 17, 5])
    assert torch.equal(packed.lookup(ids), w.dequantize()[ids])
    mins = lanes(w.mins)  # the same mins, held in the x16 lanes
    for rows in (1, 3, 4, 8, 9, 16, 24):
        x = torch.randn(rows, k, generator=gen)
        for act_bits in (16, 8):
            without = cpu_quant.q4x16_matmul(x, packed.qweight, packed.scales, packed.mins,
                                             group_size, n, act_bits)  # fmt: skip
            with_mins = cpu_quant.q4x16_matmul(x, packed.qweight, packed.scales, mins,
                                               group_size, n, act_bits)  # fmt: skip
            assert torch.equal(without, with_mins), (rows, act_bits)
    # One min off -8 x its scale: the mins are held.
    off = w.mins.clone()
    off[3, 1] += 0.5
    assert Q4Weight(w.qweight, w.scales, off, group_size).to_x16().mins.numel() == off.numel()


def test_lookup_takes_the_same_rows_in_either_layout() -> None:
    gen = torch.Generator().manual_seed(2)
    ids = torch.tensor([47, 0, 16, 17, 47, 5, 31])  # repeats, several rows of one block
    for w in (random_q4(64, 96, 32, gen), random_q8(64, 96, 32, gen)):
        assert torch.equal(w.to_x16().lookup(ids), w.lookup(ids))
        assert torch.equal(w.lookup(ids), w.dequantize()[ids])


@pytest.mark.parametrize("group", [32, 64, 192])
def test_q8_x16_rows_are_the_python_gather_bit_for_bit(group: int) -> None:
    """The C++ lookup (ops.cpp q8x16_rows) against the torch gather and dequantization it
    replaces, per channel (G = K) and per group; no ids; an id past the table refused."""
    gen = torch.Generator().manual_seed(group)
    w = random_q8(48, 192, group, gen).to_x16()
    ids = torch.tensor([47, 0, 16, 17, 47, 5, 31, 32])
    codes, scales = cpu_quant.gather_q8_x16(w.qweight, w.scales, ids)
    expected = cpu_quant.dequantize_q8_ref(codes, scales, group)
    got = cpu_quant.q8x16_rows(w.qweight, w.scales, group, ids)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    assert cpu_quant.q8x16_rows(w.qweight, w.scales, group, ids[:0]).shape == (0, 192)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_quant.q8x16_rows(w.qweight, w.scales, group, torch.tensor([48]))


@pytest.mark.parametrize(("kind", "group", "k"), CASES)
def test_x16_matmul_matches_float64_reference(kind: str, group: int | str, k: int) -> None:
    gen = torch.Generator().manual_seed(k * 7 + len(str(group)))
    worst = worst_vs_rows = 0.0
    for n in N_VALUES:
        w = make_weight(kind, n, k, group, gen)
        dense = w.dequantize().double()
        for m in M_VALUES:
            x = torch.randn(m, k, generator=gen)
            out = x16_matmul(x, w)
            assert out.dtype == torch.float32 and out.shape == (m, n)
            ref = x.double() @ dense.t()
            err = (out.double() - ref).abs()
            where = f"{kind} G={group} M={m} K={k} N={n}"
            bound = error_bound(x, w, 16)
            assert bool((err <= bound).all()), f"{where}: {(err - bound).max().item():.3e} over"
            rel = (err.max() / ref.abs().max()).item()
            worst = max(worst, rel)
            assert rel <= REL_TOL[(kind, 16)], f"{where}: relative error {rel:.3e}"
            # The rows kernel's act_bits 16: the same integer sums, another float order.
            rows = packed_matmul(x, w, 16).double()
            apart = ((out.double() - rows).abs().max() / ref.abs().max()).item()
            worst_vs_rows = max(worst_vs_rows, apart)
            assert apart <= 1e-5, f"{where}: {apart:.3e} from the rows kernel"
    print(f"x16 {kind} G={group} K={k}: error / max|ref| {worst:.2e}, "
          f"from the rows kernel {worst_vs_rows:.2e}")  # fmt: skip


@pytest.mark.parametrize("act_bits", [16, 8])
@pytest.mark.parametrize(("kind", "group"), [("q4", 32), ("q4", 128), ("q8", 32), ("q8", 128), ("q8", ROW)])
def test_a_lone_rows_weights_in_four_runs_give_one_runs_bits(
    kind: str, group: int | str, act_bits: int
) -> None:
    """A lone row reads a thread's Q4x16 / Q8x16 n-blocks in 4 runs at once; each block's
    sums and float work are a one-block tile's, so the output is the same bits as one run,
    for every remainder of blocks past the runs and shares of many blocks (the head's 49152
    rows)."""
    gen = torch.Generator().manual_seed(31 + act_bits)
    try:
        for n in [16, 48, 80, 112, 304, 1040, 4112]:
            w = make_weight(kind, n, 256, group, gen)
            x = torch.randn(1, 256, generator=gen) * 3
            cpu_quant.set_row_streams(True)
            runs = x16_matmul(x, w, act_bits)
            cpu_quant.set_row_streams(False)
            one = x16_matmul(x, w, act_bits)
            assert torch.equal(runs.view(torch.int32), one.view(torch.int32)), n
            # ...and the one-row output is its row of a batch's (tiles of several rows).
            batch = torch.cat([x, torch.randn(4, 256, generator=gen)])
            assert torch.equal(x16_matmul(batch, w, act_bits)[:1], runs), n
    finally:
        cpu_quant.set_row_streams(True)


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_each_row_is_computed_alone(kind: str) -> None:
    """A row's output is the same bits in any batch: what makes a speculative verify row
    and a prefill row compute as the one-row decode step does."""
    gen = torch.Generator().manual_seed(9)
    w = make_weight(kind, 304, 576, 32, gen)
    x = torch.randn(11, 576, generator=gen)
    whole = x16_matmul(x, w)
    for lo, hi in [(0, 1), (3, 4), (2, 7), (5, 11), (10, 11)]:
        assert torch.equal(x16_matmul(x[lo:hi].contiguous(), w), whole[lo:hi]), (lo, hi)


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_zero_rows_give_zeros_and_mixed_magnitudes_stay_within_the_bound(kind: str) -> None:
    gen = torch.Generator().manual_seed(4)
    w = make_weight(kind, 48, 256, 64, gen)
    x = torch.randn(6, 256, generator=gen)
    x[:, 64:96] *= 1e4
    x[:, 96:128] *= 1e-4
    x[5] = 0
    out = x16_matmul(x, w)
    ref = x.double() @ w.dequantize().double().t()
    assert bool(((out.double() - ref).abs() <= error_bound(x, w, 16)).all())
    assert torch.equal(out[5], torch.zeros(48))


def test_q8_per_row_sums_do_not_overflow_on_long_rows() -> None:
    """One scale per row over K = 8192 of extreme codes: the int32 sums are converted every
    8 sub-blocks (each at most 256 * 32767 * 127 < 2^31), never wrapped."""
    k = 8192
    codes = torch.full((16, k), 127, dtype=torch.int8)
    codes[1::2] = -127
    w = Q8Weight(codes, torch.full((16, 1), 0.01).half(), k)
    x = torch.ones(2, k)
    out = x16_matmul(x, w)
    ref = x.double() @ w.dequantize().double().t()
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-6


def _args(kind: str) -> list:
    gen = torch.Generator().manual_seed(0)
    if kind == "q4":
        w = random_q4(32, 64, 32, gen).to_x16()
        return [torch.randn(2, 64), w.qweight, w.scales, w.mins, 32, 32]
    w8 = random_q8(32, 64, 32, gen).to_x16()
    return [torch.randn(2, 64), w8.qweight, w8.scales, 32, 32]


def _with(args: list, index: int, value: object) -> list:
    return [value if i == index else a for i, a in enumerate(args)]


@pytest.mark.parametrize(
    ("kind", "index", "value", "message"),
    [
        ("q4", 0, torch.randn(2, 64).double(), "x must be a contiguous float32"),
        ("q4", 0, torch.randn(2, 96), "qweight must be contiguous"),  # x's K != the weight's
        ("q4", 1, torch.zeros(2, 2, 4, 64, dtype=torch.int8), "uint8"),
        ("q4", 2, torch.ones(2, 2, 16), "scales must be contiguous float16"),
        ("q4", 3, torch.zeros(2, 1, 16).half(), "mins must be"),
        ("q4", 4, 48, "power of two"),
        ("q4", 5, 24, "multiple of 16"),
        ("q4", 5, 48, "qweight must be contiguous"),  # more rows than the codes hold
        ("q8", 1, torch.zeros(2, 2, 16, 32, dtype=torch.uint8), "int8"),
        ("q8", 2, torch.ones(2, 1, 16).half(), "scales must be"),
        ("q8", 4, 0, "multiple of 16"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_x16_matmuls_reject_bad_arguments(kind: str, index: int, value: object,
                                          message: str) -> None:  # fmt: skip
    fn = cpu_quant.q4x16_matmul if kind == "q4" else cpu_quant.q8x16_matmul
    with pytest.raises(RuntimeError, match=message):
        fn(*_with(_args(kind), index, value))


def test_packed_matmul_takes_the_x16_layout_where_it_applies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, 64, generator=gen)
    whole = random_q4(32, 64, 32, gen)
    assert PackedMatmul(whole, QuantCompute("cpp")).weight.layout == "x16"  # type: ignore[union-attr]
    ragged = PackedMatmul(random_q4(24, 64, 32, gen), QuantCompute("cpp"))  # N off 16
    assert ragged.weight is not None and ragged.weight.layout == "rows"
    out = PackedMatmul(whole, QuantCompute("cpp"))(x)
    assert torch.equal(out, x16_matmul(x, whole))
    # 8-bit activation codes: the x16 kernels' own int8 path.
    a8 = PackedMatmul(whole, QuantCompute("cpp", act_bits=8))
    assert a8.weight is not None and a8.weight.layout == "x16"
    assert torch.equal(a8(x), x16_matmul(x, whole, act_bits=8))
    monkeypatch.setattr(linear, "_x16_ok", False)
    rows = PackedMatmul(whole, QuantCompute("cpp"))
    assert rows.weight is not None and rows.weight.layout == "rows"
