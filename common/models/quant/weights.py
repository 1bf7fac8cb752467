"""Quantized weight tensors: what a checkpoint's linear weight becomes in a packed format.

# E = experts (MoE: optional leading dim), N = output features, K = input features,
# G = group size (a power of two >= 32)

``Q4Weight``: 4-bit codes with a float16 scale and min per group of G along K,
``w = q * scale + min`` (GGUF's Q4_1; Q4_0 is min = -8 * scale). ``Q8Weight``: int8 codes
with a float16 scale per group (G = 32 is GGUF's Q8_0; G = K is one scale per output row),
``w = q * scale``. The byte layout is kernels/cpu/quant.py's. Both may carry leading expert
dimensions: ``weight[e]`` is expert e's [N, K] weight.

``layout`` says how the bytes lie: ``rows`` (row after row, the layout above, in which
weights are loaded, quantized, sliced and fused) or ``x16`` (16 rows interleaved for the
AVX-512 kernels, kernels/cpu/quant_x16.cpp; 2-D only, N a multiple of 16). ``to_x16`` /
``to_rows`` convert exactly; a weight in the x16 layout serves matmuls, dequantization and
row lookups (``lookup``), nothing else. Where those kernels are not built (AVX2), a weight in
groups of 32 goes instead into the KQx16 layout (``to_kq_x16``, kernels/cpu/kquant.py), whose
AVX2 path multiplies int8 activation codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.models.quant.fp8 import Fp8Weight
from common.models.quant.half import HalfWeight
from kernels.cpu.kquant import KQx16
from kernels.cpu.quant import (
    SUB_BLOCK,
    X16,
    dequantize_q4_ref,
    dequantize_q8_ref,
    gather_q4_x16,
    pack_q4_codes,
    pack_q4_x16,
    pack_q8_x16,
    q8x16_rows,
    unpack_q4_codes,
    unpack_q4_x16,
    unpack_q8_x16,
)


def check_group_size(group_size: int, in_features: int) -> None:
    if group_size < SUB_BLOCK or group_size & (group_size - 1):
        raise ValueError(f"group size must be a power of two >= 32, got {group_size}")
    if in_features % group_size:
        raise ValueError(
            f"group size {group_size} does not divide the input features ({in_features})"
        )


@dataclass
class Q4Weight:
    qweight: torch.Tensor  # uint8 [..., N, K/2]
    scales: torch.Tensor  # float16 [..., N, K/G]
    mins: torch.Tensor  # float16 [..., N, K/G]
    group_size: int
    layout: str = "rows"  # x16: qweight [N/16, K/32, 4, 64], scales, mins [N/16, K/G, 16]

    kind = "q4"

    @property
    def shape(self) -> tuple[int, int]:
        if self.layout == "x16":
            return self.qweight.shape[0] * X16, self.qweight.shape[1] * SUB_BLOCK
        return self.qweight.shape[-2], self.qweight.shape[-1] * 2

    def to_x16(self) -> Q4Weight:
        assert self.layout == "rows" and self.qweight.dim() == 2, (self.layout, self.qweight.shape)
        return Q4Weight(*pack_q4_x16(self.qweight, self.scales, self.mins), self.group_size, "x16")

    def to_rows(self) -> Q4Weight:
        if self.layout == "rows":
            return self
        return Q4Weight(*unpack_q4_x16(self.qweight, self.scales, self.mins), self.group_size)

    def to_kq_x16(self) -> KQx16:
        """The same weights in the KQx16 layout (groups of 32 only), exactly: Q4_0 where
        every min is -8 times its scale (a Q4_0 file's blocks), else Q4_1."""
        assert self.layout == "rows" and self.qweight.dim() == 2, (self.layout, self.qweight.shape)
        assert self.group_size == SUB_BLOCK, self.group_size
        codes = unpack_q4_codes(self.qweight)
        ones = torch.ones(self.scales.shape, dtype=torch.int16)
        d, mins = self.scales.float(), self.mins.float()
        if torch.equal(mins, d * -8):
            return KQx16.pack("Q4_0", codes, d, ones, None, None, 8, 1.0)
        return KQx16.pack("Q4_1", codes, d, ones, mins, ones, 0, 1.0)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` [T] dequantized, float32 [T, K] (an embedding table's lookup)."""
        if self.layout == "rows":
            return self[ids].dequantize()
        rows = gather_q4_x16(self.qweight, self.scales, self.mins, ids)
        return Q4Weight(*rows, self.group_size).dequantize()

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.mins))

    def dequantize(self) -> torch.Tensor:
        """float32 [..., N, K], bit for bit GGUF's dequantization of the same blocks."""
        if self.layout != "rows":
            return self.to_rows().dequantize()
        lead = self.qweight.shape[:-2]
        n, k = self.shape
        out = dequantize_q4_ref(
            self.qweight.reshape(-1, k // 2),
            self.scales.reshape(-1, k // self.group_size),
            self.mins.reshape(-1, k // self.group_size),
            self.group_size,
        )
        return out.view(*lead, n, k)

    def __getitem__(self, index: int | slice | torch.Tensor) -> Q4Weight:
        """Selects along the first dim (rows of a 2-D weight, experts of a 3-D one)."""
        assert self.layout == "rows", "select rows of an x16 weight with lookup"
        return Q4Weight(
            self.qweight[index].contiguous(),
            self.scales[index].contiguous(),
            self.mins[index].contiguous(),
            self.group_size,
        )

    @staticmethod
    def cat(parts: list[Q4Weight]) -> Q4Weight:
        """Rows of several weights stacked (fused projections); same K and group size."""
        assert len({p.group_size for p in parts}) == 1, "fused Q4 parts differ in group size"
        assert all(p.layout == "rows" for p in parts), "fuse weights before packing them x16"
        return Q4Weight(
            torch.cat([p.qweight for p in parts], dim=-2),
            torch.cat([p.scales for p in parts], dim=-2),
            torch.cat([p.mins for p in parts], dim=-2),
            parts[0].group_size,
        )

    @staticmethod
    def quantize(weight: torch.Tensor, group_size: int) -> Q4Weight:
        """Round-to-nearest over each group's [min, max] (asymmetric, like GGUF's Q4_1).

        Scale and min are rounded to float16 first and the codes computed against the rounded
        values, so ``dequantize`` is the nearest point of the grid actually stored."""
        k = weight.shape[-1]
        check_group_size(group_size, k)
        lead, n = weight.shape[:-2], weight.shape[-2]
        w = weight.detach().float().reshape(-1, k // group_size, group_size)
        low, high = w.amin(dim=-1), w.amax(dim=-1)
        scales = ((high - low) / 15).to(torch.float16)
        mins = low.to(torch.float16)
        step = scales.float()
        inv = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))
        codes = torch.round((w - mins.float()[..., None]) * inv[..., None]).clamp_(0, 15)
        packed = pack_q4_codes(codes.to(torch.uint8).reshape(-1, k))
        return Q4Weight(
            packed.view(*lead, n, k // 2),
            scales.view(*lead, n, k // group_size),
            mins.view(*lead, n, k // group_size),
            group_size,
        )


@dataclass
class Q8Weight:
    qweight: torch.Tensor  # int8 [..., N, K]
    scales: torch.Tensor  # float16 [..., N, K/G]
    group_size: int
    layout: str = "rows"  # x16: qweight [N/16, K/32, 16, 32], scales [N/16, K/G, 16]

    kind = "q8"

    @property
    def shape(self) -> tuple[int, int]:
        if self.layout == "x16":
            return self.qweight.shape[0] * X16, self.qweight.shape[1] * SUB_BLOCK
        return self.qweight.shape[-2], self.qweight.shape[-1]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales))

    def to_x16(self) -> Q8Weight:
        assert self.layout == "rows" and self.qweight.dim() == 2, (self.layout, self.qweight.shape)
        return Q8Weight(*pack_q8_x16(self.qweight, self.scales), self.group_size, "x16")

    def to_rows(self) -> Q8Weight:
        if self.layout == "rows":
            return self
        return Q8Weight(*unpack_q8_x16(self.qweight, self.scales), self.group_size)

    def to_kq_x16(self) -> KQx16:
        """The same weights in the KQx16 layout (groups of 32 only), exactly: Q8_0, each
        code plus 128 with bias 128."""
        assert self.layout == "rows" and self.qweight.dim() == 2, (self.layout, self.qweight.shape)
        assert self.group_size == SUB_BLOCK, self.group_size
        codes = (self.qweight.to(torch.int16) + 128).to(torch.uint8)
        ones = torch.ones(self.scales.shape, dtype=torch.int16)
        return KQx16.pack("Q8_0", codes, self.scales.float(), ones, None, None, 128, 1.0)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` [T] dequantized, float32 [T, K] (an embedding table's lookup)."""
        if self.layout == "rows":
            return self[ids].dequantize()
        return q8x16_rows(self.qweight, self.scales, self.group_size, ids)

    def dequantize(self) -> torch.Tensor:
        if self.layout != "rows":
            return self.to_rows().dequantize()
        lead = self.qweight.shape[:-2]
        n, k = self.shape
        out = dequantize_q8_ref(
            self.qweight.reshape(-1, k), self.scales.reshape(-1, k // self.group_size),
            self.group_size,
        )  # fmt: skip
        return out.view(*lead, n, k)

    def __getitem__(self, index: int | slice | torch.Tensor) -> Q8Weight:
        assert self.layout == "rows", "select rows of an x16 weight with lookup"
        return Q8Weight(
            self.qweight[index].contiguous(), self.scales[index].contiguous(), self.group_size
        )

    @staticmethod
    def cat(parts: list[Q8Weight]) -> Q8Weight:
        assert len({p.group_size for p in parts}) == 1, "fused Q8 parts differ in group size"
        assert all(p.layout == "rows" for p in parts), "fuse weights before packing them x16"
        return Q8Weight(
            torch.cat([p.qweight for p in parts], dim=-2),
            torch.cat([p.scales for p in parts], dim=-2),
            parts[0].group_size,
        )

    @staticmethod
    def quantize_per_channel(weight: torch.Tensor) -> Q8Weight:
        """Symmetric int8, one scale per output row: ``scale = max |w| / 127``."""
        k = weight.shape[-1]
        w = weight.detach().float()
        scales = (w.abs().amax(dim=-1, keepdim=True) / 127).to(torch.float16)
        step = scales.float()
        inv = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))
        codes = torch.round(w * inv).clamp_(-127, 127).to(torch.int8)
        return Q8Weight(codes.contiguous(), scales.contiguous(), k)


# KQx16: GGUF's K-quants and checkpoints' integer codes (kernels/cpu/kquant.py); Fp8Weight:
# FP8 E4M3 (common/models/quant/fp8.py).
# HalfWeight: a checkpoint's bfloat16 / float16 head (common/models/quant/half.py).
QuantWeight = Q4Weight | Q8Weight | KQx16 | Fp8Weight | HalfWeight
