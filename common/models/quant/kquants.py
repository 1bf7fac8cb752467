"""GGUF's K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) and Q5_0 / Q5_1, read into one exact form.

# N = rows (output features), K = input features (a multiple of the type's block)

Every one of these types stores, per group of 16 or 32 weights along K, integer codes and a
float32-exact affine map from code to weight:

    w = code * scale            (Q3_K, Q6_K, Q5_0: symmetric)
    w = code * scale + offset   (Q2_K, Q4_K, Q5_K, Q5_1)

with ``scale`` and ``offset`` the products llama.cpp forms before it multiplies: a block's
float16 ``d`` (and ``dmin``) times the group's small integer scale (and min), each exact in
float32 (an 11-bit significand times at most 8 bits). ``AffineCodes`` holds that form:
int8 codes [N, K], float32 scales and offsets [N, K / group]. ``dequantize`` computes each
weight with the same two float32 operations llama.cpp and the ``gguf`` package do (one
product, then one subtraction of the min term, or one addition of Q5_1's min), so it is bit
for bit the ``gguf`` package's dequantization of the same bytes (tests/unit/test_kquants.py).
The packed layouts the C++ kernels multiply are built from this form and checked against it.

Block layouts (bytes per block; ``e`` = the weight's index in its block):

- Q4_K, 144 per 256: d, dmin (float16), 12 bytes of eight 6-bit scales and mins, 128 bytes
  of nibbles. Group g = e // 32; its codes are the low nibbles of bytes 32 (g // 2) .. +31
  for even g, the high nibbles for odd g. w = (d sc_g) q - (dmin m_g).
- Q5_K, 176 per 256: as Q4_K plus 32 bytes ``qh`` after the scales: bit g of qh[e % 32] is
  the code's fifth bit.
- Q6_K, 210 per 256: 128 bytes ``ql``, 64 bytes ``qh``, 16 int8 scales, d. With
  e = 128 h + r: the low nibble t = r // 64 of ql[64 h + r % 64], the two bits 2 (r // 32)
  of qh[32 h + r % 32]; code = (low | high << 4) - 32; group of 16: w = (d sc_{e // 16}) code.
- Q3_K, 110 per 256: 32 bytes ``hmask``, 64 bytes ``qs``, 12 bytes of sixteen 6-bit scales,
  d. With e = 128 h + 32 s + p: two bits 2 s of qs[32 h + p]; minus 4 unless bit e // 32
  of hmask[e % 32] is set; scale_i = 6 bits - 32; groups of 16: w = (d scale) code.
- Q2_K, 84 per 256: 16 bytes of (4-bit scale, 4-bit min) pairs, 64 bytes ``qs`` (two bits
  as Q3_K's), d, dmin; groups of 16: w = (d sc) q - (dmin m).
- Q5_0, 22 per 32: d, 4 bytes ``qh`` (bit e, little-endian), 16 bytes of nibbles (low for
  e < 16, high after); code = (low | high << 4) - 16; w = d code.
- Q5_1, 24 per 32: d, m, qh, nibbles as Q5_0; w = d q + m.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.cpu.kquant import KQx16

QK_K = 256
# type name -> (weights per block, bytes per block, group size)
KQUANT_TYPES: dict[str, tuple[int, int, int]] = {
    "Q2_K": (QK_K, 84, 16),
    "Q3_K": (QK_K, 110, 16),
    "Q4_K": (QK_K, 144, 32),
    "Q5_K": (QK_K, 176, 32),
    "Q6_K": (QK_K, 210, 16),
    "Q5_0": (32, 22, 32),
    "Q5_1": (32, 24, 32),
}


@dataclass
class AffineCodes:
    """Weights as ``code * scale (+ offset)`` per group of ``group_size`` along K."""

    codes: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # float32 [N, K / group_size]
    offsets: torch.Tensor | None  # float32 [N, K / group_size]; None: symmetric
    group_size: int
    type_name: str  # the GGUF type it was read from

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.codes.shape[0]), int(self.codes.shape[1])

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: one product (and one addition of the offset) per weight, in
        float32, as llama.cpp and the gguf package compute it."""
        n, k = self.shape
        g = self.group_size
        values = self.codes.view(n, k // g, g).float() * self.scales[..., None]
        if self.offsets is not None:
            values = values + self.offsets[..., None]
        return values.view(n, k)

    def __getitem__(self, index: int | slice | torch.Tensor) -> AffineCodes:
        """Rows ``index``."""
        offsets = None if self.offsets is None else self.offsets[index].contiguous()
        return AffineCodes(
            self.codes[index].contiguous(), self.scales[index].contiguous(), offsets,
            self.group_size, self.type_name,
        )  # fmt: skip


def read_kquant(type_name: str, data: np.ndarray, rows: int, k: int) -> AffineCodes:
    """The tensor whose raw GGUF bytes are ``data`` (uint8, rows x K/block x bytes), in the
    affine form. K must be a multiple of the type's block (256 for K-quants)."""
    group = KQUANT_TYPES[type_name][2]
    codes, scales, offsets = block_parts(type_name, data, rows, k).affine()
    return AffineCodes(
        torch.from_numpy(codes.reshape(rows, k)),
        torch.from_numpy(scales.reshape(rows, k // group)),
        None if offsets is None else torch.from_numpy(offsets.reshape(rows, k // group)),
        group,
        type_name,
    )


# -- per type: blocks uint8 [B, bytes] -> the block's parts ----------------------------------


@dataclass
class KParts:
    """One type's blocks taken apart, [B] blocks of ``per_block`` weights: unsigned codes
    ``u`` (the code plus ``bias``), the block's float16 ``d`` (and ``dmin``) as float32, and
    per group its integer scale ``sc`` (and min ``m``). The weight is
    ``(u - bias) * (d * sc) + sign * (dmin * m)``, with ``sign`` -1 for the K-quants' mins
    and +1 for Q5_1's (whose ``m`` is 1 and ``dmin`` its float16 min)."""

    u: np.ndarray  # uint8 [B, per_block], < 2 ** bits
    bits: int
    bias: int
    d: np.ndarray  # float32 [B, 1]
    sc: np.ndarray  # int16 [B, groups]
    dmin: np.ndarray | None = None  # float32 [B, 1]
    m: np.ndarray | None = None  # int16 [B, groups]
    sign: float = -1.0

    def affine(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        codes = (self.u.astype(np.int16) - self.bias).astype(np.int8)
        scales = self.d * self.sc.astype(np.float32)
        if self.dmin is None or self.m is None:
            return codes, scales, None
        mins = self.dmin * self.m.astype(np.float32)
        return codes, scales, (-mins if self.sign < 0 else mins)


def block_parts(type_name: str, data: np.ndarray, rows: int, k: int) -> KParts:
    """The tensor whose raw GGUF bytes are ``data`` taken apart, blocks in row order."""
    per_block, block_bytes, _ = KQUANT_TYPES[type_name]
    if k % per_block:
        raise ValueError(f"{type_name} needs K to be a multiple of {per_block}, got {k}")
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows * (k // per_block), block_bytes)
    return _READERS[type_name](blocks)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of each block, as float32 [B, 1]."""
    return blocks[:, at : at + 2].copy().view(np.float16).astype(np.float32)


def _bits(data: np.ndarray, shift: np.ndarray, width: int) -> np.ndarray:
    """``width`` bits of ``data`` from bit ``shift`` (broadcast)."""
    return np.asarray((data >> shift) & np.uint8((1 << width) - 1), dtype=np.uint8)


def _six_bit_pairs(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins [B, 8].

    Groups 0-3: scale = low 6 bits of byte g, min = low 6 bits of byte g + 4. Groups 4-7:
    the low 4 bits come from byte g + 4 (scale: its low nibble, min: its high one) and the
    top 2 from the spare top bits of bytes g - 4 (scale) and g (min)."""
    s = packed.astype(np.uint8)
    low_sc, low_m, mixed = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = np.concatenate([low_sc & 63, (mixed & 15) | ((low_sc >> 6) << 4)], axis=1)
    mins = np.concatenate([low_m & 63, (mixed >> 4) | ((low_m >> 6) << 4)], axis=1)
    return scales.astype(np.int16), mins.astype(np.int16)


def _nibbles_by_32(qs: np.ndarray) -> np.ndarray:
    """128 bytes -> 256 4-bit codes: group g takes bytes 32 (g // 2) .. +31, low nibbles
    for even g, high for odd."""
    pairs = qs.reshape(-1, 4, 1, 32)
    return _bits(pairs, np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1), 4).reshape(-1, QK_K)


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """64 bytes -> 256 2-bit values: e = 128 h + 32 s + p is bits 2 s of byte 32 h + p."""
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return _bits(qs.reshape(-1, 2, 1, 32), shifts, 2).reshape(-1, QK_K)


def _bit_planes(bits: np.ndarray, planes: int) -> np.ndarray:
    """[B, 32] bytes -> [B, 32 * planes]: e = 32 b + p is bit b of byte p."""
    shifts = np.arange(planes, dtype=np.uint8).reshape(1, planes, 1)
    return _bits(bits.reshape(-1, 1, 32), shifts, 1).reshape(-1, 32 * planes)


def _q4_k(blocks: np.ndarray) -> KParts:
    sc, m = _six_bit_pairs(blocks[:, 4:16])
    u = _nibbles_by_32(blocks[:, 16:144])
    return KParts(u, 4, 0, _f16(blocks, 0), sc, _f16(blocks, 2), m)


def _q5_k(blocks: np.ndarray) -> KParts:
    sc, m = _six_bit_pairs(blocks[:, 4:16])
    u = _nibbles_by_32(blocks[:, 48:176]) | (_bit_planes(blocks[:, 16:48], 8) << 4)
    return KParts(u, 5, 0, _f16(blocks, 0), sc, _f16(blocks, 2), m)


def _q6_k(blocks: np.ndarray) -> KParts:
    ql, qh = blocks[:, 0:128], blocks[:, 128:192]
    sc = blocks[:, 192:208].copy().view(np.int8).astype(np.int16)
    # e = 128 h + r: low nibble r // 64 of ql[64 h + r % 64], bits 2 (r // 32) of qh[32 h + r % 32].
    low = _bits(ql.reshape(-1, 2, 1, 64), np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1), 4)
    high = _bits(qh.reshape(-1, 2, 1, 32), np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1), 2)
    u = low.reshape(-1, QK_K) | (high.reshape(-1, QK_K) << 4)
    return KParts(u, 6, 32, _f16(blocks, 208), sc)


def _q3_k(blocks: np.ndarray) -> KParts:
    hmask, qs, packed = blocks[:, 0:32], blocks[:, 32:96], blocks[:, 96:108]
    # Scale i: low 4 bits from nibble i // 8 of byte i % 8, top 2 from bits 2 (i // 4) of
    # byte 8 + i % 4; stored + 32.
    low = _bits(packed[:, 0:8].reshape(-1, 1, 8), np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1), 4)
    top = _bits(packed[:, 8:12].reshape(-1, 1, 4), np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1), 2)
    sc = (low.reshape(-1, 16) | (top.reshape(-1, 16) << 4)).astype(np.int16) - 32
    # code = two bits - 4 unless the mask bit is set: u = two bits + 4 * mask, bias 4.
    u = _crumbs(qs) | (_bit_planes(hmask, 8) << 2)
    return KParts(u, 3, 4, _f16(blocks, 108), sc)


def _q2_k(blocks: np.ndarray) -> KParts:
    packed = blocks[:, 0:16]
    sc, m = (packed & 15).astype(np.int16), (packed >> 4).astype(np.int16)
    return KParts(_crumbs(blocks[:, 16:80]), 2, 0, _f16(blocks, 80), sc, _f16(blocks, 82), m)


def _q5_small(blocks: np.ndarray, at: int) -> np.ndarray:
    """Q5_0 / Q5_1's 5-bit codes [B, 32] from qh at byte ``at`` and the 16 nibble bytes after."""
    qh = blocks[:, at : at + 4].copy().view("<u4")  # [B, 1]
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    qs = blocks[:, at + 4 : at + 20]
    low = np.concatenate([qs & 15, qs >> 4], axis=1)
    return np.asarray(low | (high << 4), dtype=np.uint8)


def _q5_0(blocks: np.ndarray) -> KParts:
    one = np.ones((blocks.shape[0], 1), dtype=np.int16)
    return KParts(_q5_small(blocks, 2), 5, 16, _f16(blocks, 0), one)


def _q5_1(blocks: np.ndarray) -> KParts:
    one = np.ones((blocks.shape[0], 1), dtype=np.int16)
    return KParts(_q5_small(blocks, 4), 5, 0, _f16(blocks, 0), one, _f16(blocks, 2), one, 1.0)


_READERS = {
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
}


def read_kq_x16(type_name: str, data: np.ndarray, rows: int, k: int) -> KQx16:
    """The tensor whose raw GGUF bytes are ``data`` in the KQx16 layout (rows a multiple of
    16): its codes at their own widths, its float and integer scales as stored."""
    parts = block_parts(type_name, data, rows, k)
    per_block, _, group = KQUANT_TYPES[type_name]

    def per_row(a: np.ndarray | None, width: int) -> torch.Tensor | None:
        return None if a is None else torch.from_numpy(np.ascontiguousarray(a)).reshape(rows, width)

    u = per_row(parts.u, k)
    d = per_row(parts.d, k // per_block)
    sc = per_row(parts.sc, k // group)
    assert u is not None and d is not None and sc is not None
    return KQx16.pack(
        type_name, u, d, sc, per_row(parts.dmin, k // per_block), per_row(parts.m, k // group),
        parts.bias, parts.sign,
    )  # fmt: skip
