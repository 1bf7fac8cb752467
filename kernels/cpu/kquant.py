"""The KQx16 layout: GGUF's K-quants (and Q5_0 / Q5_1; on AVX2, Q4_0 / Q4_1 / Q8_0 too) packed
for 16-lane kernels, at their own bit widths.

# N = output features (weight rows), K = input features, NB = N / 16, SB = K / 32,
# G = group size (16 or 32), L = the type's block of float scales (256, or 32 for Q5_0/1)

A weight is ``(u - bias) * (d * sc) + sign * (dmin * m)`` (common/models/quant/kquants.py):
unsigned codes ``u`` of ``bits`` bits, a float ``d`` (and ``dmin``) per block of L weights
and a small integer scale ``sc`` (and min ``m``) per group of G. Here, as the Q4x16 layout
(kernels/cpu/quant.py) lays 4-bit codes, 16 weight rows share each 512-bit vector:

- codes in bit planes of width 4, 2 or 1, low bits first (Q4_K: 4; Q5_K, Q5_0, Q5_1: 4 + 1;
  Q6_K: 4 + 2; Q3_K: 2 + 1; Q2_K: 2). A plane of width w is uint8 [NB, SB, w, 64]: chunk c
  of n-block j, sub-block b is 32 little-endian 16-bit words, word 2i + h (lane i, h = 0 / 1)
  holding in its bits w t .. w t + w - 1 the plane's bits of u[16j + i, 32b + (32 / w) c +
  2t + h]. Width 4 is exactly the Q4x16 code layout; each chunk unpacks with shifts and a
  mask into int16 lanes that pair with x[k], x[k + 1] as the Q4x16 kernel pairs them.
- ``d`` (and ``dmin``) float32 [NB, K / L, 16]; ``sc`` (and ``m``) int8 [NB, K / G, 16];
  lane i is row 16j + i's.
- Half scales: where a type has one float per group (L = G: Q5_0, Q5_1, and checkpoints'
  integer codes in groups of 32), every small integer is 1 and every float is a float16 value
  (a GGUF file's ``d`` and ``m`` are float16), ``d`` (and ``dmin``) are held as float16 and
  ``sc`` / ``m`` not at all (None): a Q5_0 weight takes 5.5 bits, as in its file, not 6.25.
  The kernels widen each float16 exactly, so the products are those of the float32 form.

``dequantize`` forms each weight with the same float32 operations as the gguf package, so a
packed tensor dequantizes bit for bit as its file does (tests/unit/test_kquant_x16.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from kernels.cpu.quant import SUB_BLOCK, X16

# type -> (bits, code planes low first, group G, float block L)
KQ_LAYOUTS: dict[str, tuple[int, tuple[int, ...], int, int]] = {
    "Q2_K": (2, (2,), 16, 256),
    "Q3_K": (3, (2, 1), 16, 256),
    "Q4_K": (4, (4,), 32, 256),
    "Q5_K": (5, (4, 1), 32, 256),
    "Q6_K": (6, (4, 2), 16, 256),
    "Q5_0": (5, (4, 1), 32, 32),
    "Q5_1": (5, (4, 1), 32, 32),
    # The non-K types in groups of 32, for CPUs without the x16 kernels (AVX2): a Q4 / Q8
    # weight read from a file (or quantized here) takes this layout there when x is coded
    # in int8 (``Q4Weight.to_kq_x16``, common/models/quant/weights.py). Q4_0: bias 8, no
    # min; Q4_1: the min term with m 1 and sign +1; Q8_0: the int8 code plus 128, bias 128.
    "Q4_0": (4, (4,), 32, 32),
    "Q4_1": (4, (4,), 32, 32),
    "Q8_0": (8, (4, 4), 32, 32),
}

# The integer codes of GPTQ, AWQ and compressed-tensors checkpoints: "W{bits}G{L}", codes of
# ``bits`` bits, a float scale (and with a zero point, the min term) per quantization group
# of L along K. sc is 1 per group of 32; an asymmetric weight's zero point z goes into m with
# dmin = d, so ``(u - bias) * d - d * z``; ``dequantize`` subtracts the zero point first
# (``(u - bias - z) * d``, each term an exact integer), as those tools dequantize.
AFFINE_WIDTHS: dict[int, tuple[int, ...]] = {4: (4,), 8: (4, 4)}


def affine_type(bits: int, group: int) -> str:
    """The KQx16 type of ``bits``-bit integer codes with a scale per ``group`` along K."""
    if bits not in AFFINE_WIDTHS:
        raise ValueError(f"integer codes of {bits} bits are not served (4 and 8 are)")
    if group % SUB_BLOCK:
        raise ValueError(f"quantization groups must be multiples of 32 elements, got {group}")
    return f"W{bits}G{group}"


def kq_layout(type_name: str) -> tuple[int, tuple[int, ...], int, int]:
    """(bits, code planes low first, group G, float block L) of a KQx16 type."""
    if type_name in KQ_LAYOUTS:
        return KQ_LAYOUTS[type_name]
    match = re.fullmatch(r"W(\d+)G(\d+)", type_name)
    if match is None:
        raise KeyError(f"unknown KQx16 type {type_name!r}")
    bits, block = int(match[1]), int(match[2])
    return bits, AFFINE_WIDTHS[bits], SUB_BLOCK, block


def is_affine(type_name: str) -> bool:
    return type_name.startswith("W")


def pack_plane(values: torch.Tensor, width: int) -> torch.Tensor:
    """uint8 [N, K] of ``width`` bits each (N a multiple of 16, K of 32) -> uint8
    [NB, SB, width, 64] in the x16 word order."""
    n, k = values.shape
    per_word = 16 // width
    v = values.to(torch.int32).view(n // X16, X16, k // SUB_BLOCK, width, per_word, 2)  # j i b c t h
    v = v.permute(0, 2, 3, 1, 5, 4)  # j b c i h t
    shifts = torch.arange(per_word, dtype=torch.int32) * width
    words = (v << shifts).sum(dim=-1)  # j b c i h, < 2^16
    data = torch.stack([words & 0xFF, words >> 8], dim=-1).to(torch.uint8)
    return data.reshape(n // X16, k // SUB_BLOCK, width, 64).contiguous()


def unpack_plane(packed: torch.Tensor, width: int) -> torch.Tensor:
    """The inverse of ``pack_plane``: uint8 [N, K]."""
    blocks, num_sub = packed.shape[:2]
    per_word = 16 // width
    data = packed.view(blocks, num_sub, width, X16, 2, 2).to(torch.int32)  # j b c i h byte
    words = data[..., 0] | (data[..., 1] << 8)
    shifts = torch.arange(per_word, dtype=torch.int32) * width
    v = (words[..., None] >> shifts) & ((1 << width) - 1)  # j b c i h t
    v = v.permute(0, 3, 1, 2, 5, 4)  # j i b c t h
    return v.reshape(blocks * X16, num_sub * SUB_BLOCK).to(torch.uint8)


def lanes(per_row: torch.Tensor) -> torch.Tensor:
    """[N, X] -> [NB, X, 16]."""
    n = per_row.shape[0]
    return per_row.reshape(n // X16, X16, -1).transpose(1, 2).contiguous()


def rows(per_lane: torch.Tensor) -> torch.Tensor:
    """[NB, X, 16] -> [N, X]."""
    return per_lane.transpose(1, 2).reshape(per_lane.shape[0] * X16, -1).contiguous()


@dataclass
class KQx16:
    """One tensor in the KQx16 layout."""

    type_name: str
    planes: list[torch.Tensor]  # uint8 [NB, SB, w, 64], widths as KQ_LAYOUTS says
    d: torch.Tensor  # float32 [NB, K / L, 16]; float16 where scales are half (L = G)
    sc: torch.Tensor | None  # int8 [NB, K / G, 16]; None: every one is 1 (half scales)
    dmin: torch.Tensor | None  # as d
    m: torch.Tensor | None  # as sc; None with dmin given: every one is 1 (half scales)
    bias: int
    sign: float  # of the min term: -1 (K-quants), +1 (Q5_1)
    # Act-order checkpoints (GPTQ's desc_act, compressed-tensors' actorder "group"): packed
    # column c is the original column perm[c], so that groups are contiguous; the kernel
    # reads x[:, perm]. None: the original order.
    perm: torch.Tensor | None = None
    # How x is quantized inside the kernel: False, int16 codes per row; True, int8 codes
    # per token as a W8A8 checkpoint's dynamic activations are (kernels.h).
    int8_tokens: bool = False

    layout = "x16"  # as the Q4 / Q8 weights' x16 layout: it serves matmuls and lookups

    @property
    def kind(self) -> str:
        return self.type_name.lower()

    @property
    def qweight(self) -> torch.Tensor:
        """The tensor that identifies the weight's storage (its low code plane)."""
        return self.planes[0]

    def to_x16(self) -> KQx16:
        return self

    def blocks(self, index: torch.Tensor | slice) -> KQx16:
        """n-blocks ``index`` (16 rows each) as a weight of their own."""

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index].contiguous()

        planes = [p[index].contiguous() for p in self.planes]
        d = pick(self.d)
        assert d is not None
        return replace(self, planes=planes, d=d, sc=pick(self.sc), dmin=pick(self.dmin),
                       m=pick(self.m))  # fmt: skip

    def __getitem__(self, index: int | slice | torch.Tensor) -> KQx16:
        """KQx16 weights are 2-D: a file's 3-D expert tensor is read expert by expert
        (common/models/quant/gguf.py), each expert a weight of its own."""
        raise TypeError(
            f"{self.type_name} weights are 2-D; select experts before packing (one KQx16 "
            "weight per expert)"
        )

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` [T] dequantized, float32 [T, K] (an embedding table's lookup): only
        the n-blocks holding them are dequantized."""
        blocks, where = torch.unique(ids // X16, return_inverse=True)
        values = self.blocks(blocks).dequantize()
        return values[where * X16 + ids % X16]

    @staticmethod
    def cat(parts: list[KQx16]) -> KQx16:
        """Rows of several weights of one type stacked (fused projections)."""
        assert len({p.type_name for p in parts}) == 1, "fused KQx16 parts differ in type"
        assert len({p.d.dtype for p in parts}) == 1, "fused KQx16 parts differ in scale form"
        assert all(same_columns(parts[0], p) for p in parts), "fused parts differ in columns"

        def joined(ts: list[torch.Tensor | None]) -> torch.Tensor | None:
            return None if ts[0] is None else torch.cat(ts, dim=0)  # type: ignore[arg-type]

        first = parts[0]
        planes = [torch.cat([p.planes[i] for p in parts]) for i in range(len(first.planes))]
        d = joined([p.d for p in parts])
        assert d is not None
        return replace(
            first, planes=planes, d=d, sc=joined([p.sc for p in parts]),
            dmin=joined([p.dmin for p in parts]),
            m=joined([p.m for p in parts]),
        )  # fmt: skip

    @property
    def shape(self) -> tuple[int, int]:
        blocks, num_sub = self.planes[0].shape[:2]
        return blocks * X16, num_sub * SUB_BLOCK

    @property
    def group_size(self) -> int:
        return kq_layout(self.type_name)[2]

    @property
    def num_bytes(self) -> int:
        parts = [*self.planes, self.d, self.sc, self.dmin, self.m, self.perm]
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    @staticmethod
    def pack(
        type_name: str,
        u: torch.Tensor,
        d: torch.Tensor,
        sc: torch.Tensor,
        dmin: torch.Tensor | None,
        m: torch.Tensor | None,
        bias: int,
        sign: float,
        perm: torch.Tensor | None = None,
        int8_tokens: bool = False,
    ) -> KQx16:
        """From the rows: codes uint8 [N, K], d / dmin float32 [N, K / L], sc / m integer
        [N, K / G] (columns in ``perm``'s order where one is given). Held as half scales
        (the module's docstring) wherever that is exact."""
        bits, widths, _, _ = kq_layout(type_name)
        assert int(u.max()) < 1 << bits, f"{type_name} codes exceed {bits} bits"
        planes, shift = [], 0
        for width in widths:
            planes.append(pack_plane((u >> shift) & ((1 << width) - 1), width))
            shift += width
        big = [None if t is None else t.float() for t in (d, dmin)]
        if _half_exact(type_name, big, sc, m):
            halves = [None if t is None else lanes(t.half()) for t in big]
            return KQx16(
                type_name, planes, halves[0], None, halves[1], None, bias, sign, perm,  # type: ignore[arg-type]
                int8_tokens,
            )  # fmt: skip
        small = [None if t is None else lanes(t.to(torch.int8)) for t in (sc, m)]
        big = [None if t is None else lanes(t) for t in big]
        return KQx16(
            type_name, planes, big[0], small[0], big[1], small[1], bias, sign,  # type: ignore[arg-type]
            perm, int8_tokens,
        )  # fmt: skip

    def codes(self) -> torch.Tensor:
        """The unsigned codes, uint8 [N, K], in the packed column order."""
        _, widths, _, _ = kq_layout(self.type_name)
        u, shift = None, 0
        for width, plane in zip(widths, self.planes, strict=True):
            part = unpack_plane(plane, width).to(torch.int32) << shift
            u = part if u is None else u | part
            shift += width
        assert u is not None
        return u.to(torch.uint8)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K] in the original column order. GGUF types: ``(u - bias) * (d *
        sc)`` plus or minus ``dmin * m``, each product and the sum in float32, as the gguf
        package computes them. Integer-code types: ``(u - bias - z) * d``."""
        n, k = self.shape
        _, _, g, block = kq_layout(self.type_name)
        per = block // g  # groups per float block
        d = rows(self.d).float().repeat_interleave(per, dim=1)  # [N, K / G]
        scales = d if self.sc is None else d * rows(self.sc).float()
        codes = (self.codes().to(torch.int16) - self.bias).view(n, k // g, g)
        if is_affine(self.type_name):
            if self.m is not None:
                codes = codes - rows(self.m).to(torch.int16)[..., None]
            values = codes.float() * scales[..., None]
        else:
            values = codes.float() * scales[..., None]
            if self.dmin is not None:
                mins = rows(self.dmin).float().repeat_interleave(per, dim=1)
                if self.m is not None:
                    mins = mins * rows(self.m).float()
                values = values + (mins if self.sign > 0 else -mins)[..., None]
        values = values.view(n, k)
        if self.perm is None:
            return values
        out = torch.empty_like(values)
        out[:, self.perm] = values
        return out


def _half_exact(
    type_name: str, floats: list[torch.Tensor | None], sc: torch.Tensor, m: torch.Tensor | None
) -> bool:
    """Whether a weight's scales hold exactly as half scales: one float per group, every
    small integer 1, every float a float16 value. (Checkpoints' integer codes keep a zero
    point's m, which ``dequantize`` subtracts from the codes.)"""
    _, _, group, block = kq_layout(type_name)
    if block != group or not bool((sc == 1).all()):
        return False
    if m is not None and (is_affine(type_name) or floats[1] is None or not bool((m == 1).all())):
        return False
    return all(t is None or torch.equal(t.half().float(), t) for t in floats)


def same_columns(a: KQx16, b: KQx16) -> bool:
    """Whether two weights read x in the same column order (so they may be fused)."""
    if a.perm is None or b.perm is None:
        return a.perm is None and b.perm is None
    return torch.equal(a.perm, b.perm)


def kq_available() -> bool:
    """Whether the KQx16 kernels are built here: AVX-512 VNNI, or their AVX2 path."""
    from kernels.cpu import available, load

    return available() and bool(load().has_kq())


def kq_x16_matmul(x: torch.Tensor, w: KQx16, act_bits: int = 16) -> torch.Tensor:
    """x [M, K] float32 @ w [N, K]^T -> [M, N] float32 (kquant_x16.cpp). ``act_bits`` 8
    codes x in int8 per 32 values (llama.cpp's activations), with AVX-512 VNNI or on the AVX2
    path, the same floats on both; a W8A8 weight's ``int8_tokens`` take the int8 path
    whatever ``act_bits`` says."""
    from kernels.cpu import load

    _, widths, group, block = kq_layout(w.type_name)
    hi = w.planes[1] if len(w.planes) > 1 else None
    if w.perm is not None:
        x = x.index_select(1, w.perm)
    out: torch.Tensor = load().kq_x16_matmul(
        x, w.planes[0], hi, widths[0], widths[1] if hi is not None else 0, w.bias, group,
        block, w.d, w.sc, w.dmin, w.m, w.sign, w.shape[0], w.int8_tokens, act_bits,
    )  # fmt: skip
    return out


def kq_int8_available() -> bool:
    """Whether the KQx16 kernels code activations in int8 here when asked (act_bits 8): with
    AVX-512 VNNI and on the AVX2 path, every type."""
    return kq_available()

