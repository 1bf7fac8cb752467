"""The KQx16 layout: GGUF's K-quants (and Q5_0 / Q5_1) packed for 16-lane kernels, at their
own bit widths.

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

``dequantize`` forms each weight with the same float32 operations as the gguf package, so a
packed tensor dequantizes bit for bit as its file does (tests/unit/test_kquant_x16.py).
"""

from __future__ import annotations

from dataclasses import dataclass

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
}


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
    d: torch.Tensor  # float32 [NB, K / L, 16]
    sc: torch.Tensor  # int8 [NB, K / G, 16]
    dmin: torch.Tensor | None  # float32 [NB, K / L, 16]
    m: torch.Tensor | None  # int8 [NB, K / G, 16]
    bias: int
    sign: float  # of the min term: -1 (K-quants), +1 (Q5_1)

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
        d, sc = pick(self.d), pick(self.sc)
        assert d is not None and sc is not None
        return KQx16(self.type_name, planes, d, sc, pick(self.dmin), pick(self.m), self.bias, self.sign)

    def __getitem__(self, index: int | slice | torch.Tensor) -> KQx16:
        """Experts of a 3-D weight: K-quant experts are not served yet."""
        raise TypeError(
            f"{self.type_name} weights are 2-D here; mixture-of-experts K-quant tensors are "
            "not served yet"
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

        def joined(ts: list[torch.Tensor | None]) -> torch.Tensor | None:
            return None if ts[0] is None else torch.cat(ts, dim=0)  # type: ignore[arg-type]

        first = parts[0]
        planes = [torch.cat([p.planes[i] for p in parts]) for i in range(len(first.planes))]
        d, sc = joined([p.d for p in parts]), joined([p.sc for p in parts])
        assert d is not None and sc is not None
        return KQx16(
            first.type_name, planes, d, sc, joined([p.dmin for p in parts]),
            joined([p.m for p in parts]), first.bias, first.sign,
        )  # fmt: skip

    @property
    def shape(self) -> tuple[int, int]:
        blocks, num_sub = self.planes[0].shape[:2]
        return blocks * X16, num_sub * SUB_BLOCK

    @property
    def group_size(self) -> int:
        return KQ_LAYOUTS[self.type_name][2]

    @property
    def num_bytes(self) -> int:
        parts = [*self.planes, self.d, self.sc, self.dmin, self.m]
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
    ) -> KQx16:
        """From the rows: codes uint8 [N, K], d / dmin float32 [N, K / L], sc / m integer
        [N, K / G]."""
        bits, widths, _, _ = KQ_LAYOUTS[type_name]
        assert int(u.max()) < 1 << bits, f"{type_name} codes exceed {bits} bits"
        planes, shift = [], 0
        for width in widths:
            planes.append(pack_plane((u >> shift) & ((1 << width) - 1), width))
            shift += width
        small = [None if t is None else lanes(t.to(torch.int8)) for t in (sc, m)]
        big = [None if t is None else lanes(t.float()) for t in (d, dmin)]
        return KQx16(type_name, planes, big[0], small[0], big[1], small[1], bias, sign)  # type: ignore[arg-type]

    def codes(self) -> torch.Tensor:
        """The unsigned codes, uint8 [N, K]."""
        _, widths, _, _ = KQ_LAYOUTS[self.type_name]
        u, shift = None, 0
        for width, plane in zip(widths, self.planes, strict=True):
            part = unpack_plane(plane, width).to(torch.int32) << shift
            u = part if u is None else u | part
            shift += width
        assert u is not None
        return u.to(torch.uint8)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: ``(u - bias) * (d * sc)`` plus or minus ``dmin * m``, each
        product and the sum in float32, as the gguf package computes them."""
        n, k = self.shape
        _, _, g, block = KQ_LAYOUTS[self.type_name]
        per = block // g  # groups per float block
        d = rows(self.d).repeat_interleave(per, dim=1)  # [N, K / G]
        scales = d * rows(self.sc).float()
        codes = (self.codes().to(torch.int16) - self.bias).float().view(n, k // g, g)
        values = codes * scales[..., None]
        if self.dmin is not None and self.m is not None:
            mins = rows(self.dmin).repeat_interleave(per, dim=1) * rows(self.m).float()
            values = values + (mins if self.sign > 0 else -mins)[..., None]
        return values.view(n, k)


def kq_x16_matmul(x: torch.Tensor, w: KQx16) -> torch.Tensor:
    """x [M, K] float32 @ w [N, K]^T -> [M, N] float32 (kquant_x16.cpp)."""
    from kernels.cpu import load

    _, widths, group, block = KQ_LAYOUTS[w.type_name]
    hi = w.planes[1] if len(w.planes) > 1 else None
    out: torch.Tensor = load().kq_x16_matmul(
        x, w.planes[0], hi, widths[0], widths[1] if hi is not None else 0, w.bias, group,
        block, w.d, w.sc, w.dmin, w.m, w.sign, w.shape[0],
    )  # fmt: skip
    return out
