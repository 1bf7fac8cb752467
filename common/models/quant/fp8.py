"""FP8 E4M3 weights (compressed-tensors' ``float-quantized`` format: llm-compressor's FP8 and
FP8_DYNAMIC schemes) on the CPU.

# N = output features, K = input features, T = tokens

A weight is ``code * scale``: ``code`` one of E4M3's 256 values (stored as its byte), the
scale float per tensor or per output channel. No CPU here multiplies FP8, so the codes are
converted as they are read, exactly (every E4M3 value is a float32): for the rows of a
decode step by kernels/cpu/fp8_matmul.cpp, which shifts each byte into a float32's bits
and multiplies in float32, each row of x alone; for prefill rows
(common/models/quant/linear.py decides which) in chunks of weight rows converted by torch
for its float32 GEMM. The codes stay one byte each in memory, 16 rows interleaved as that
kernel reads them (common/models/quant/half.py's layout: one sequential stream per 16 rows).

The activations follow the checkpoint: FP8_DYNAMIC quantizes each token to E4M3 with scale
``max|x| / 448``, FP8 (static) with the calibrated ``input_scale`` of the whole tensor, as
compressed-tensors does (divide, clamp to +-448, round to E4M3, multiply back).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.models.quant.half import ROWS, pack_rows, unpack_rows

E4M3_MAX = 448.0


def fake_quantize_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x rounded to E4M3 codes of step ``scale`` (broadcast against x) and back, in x's
    precision: compressed-tensors' quantize-dequantize for FP8 activations."""
    codes = torch.clamp(x / scale, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.to(x.dtype) * scale


def token_scales(x: torch.Tensor) -> torch.Tensor:
    """[T, 1]: each token's dynamic E4M3 scale, ``max|x| / 448`` (float32's epsilon for a
    zero row)."""
    scale = x.abs().amax(dim=-1, keepdim=True) / E4M3_MAX
    return torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)


@dataclass
class Fp8Weight:
    """An FP8 E4M3 weight [N, K] with its scale, and how the checkpoint quantizes x."""

    packed: torch.Tensor  # uint8 [ceil(N / 16), K, 16], E4M3 bytes, 16 rows interleaved
    n: int  # rows
    scale: torch.Tensor  # float32 [N, 1] (per channel) or [1, 1] (per tensor)
    scale_dtype: torch.dtype  # the checkpoint's (its dequantization rounds to it)
    activations: str = "none"  # none | token (dynamic per token) | tensor (static)
    input_scale: torch.Tensor | None = None  # float32 [1, 1], activations "tensor"
    _kernel_scale: torch.Tensor | None = field(default=None, repr=False)

    layout = "fp8"
    kind = "fp8"

    @classmethod
    def of(
        cls,
        codes: torch.Tensor,
        scale: torch.Tensor,
        scale_dtype: torch.dtype,
        activations: str = "none",
        input_scale: torch.Tensor | None = None,
    ) -> Fp8Weight:
        """From row-major E4M3 bytes [N, K]."""
        assert codes.dim() == 2 and codes.dtype == torch.uint8, (codes.shape, codes.dtype)
        return cls(pack_rows(codes), codes.shape[0], scale, scale_dtype, activations, input_scale)

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.packed.shape[1]

    @property
    def codes(self) -> torch.Tensor:
        """uint8 [N, K], row-major (a copy)."""
        return unpack_rows(self.packed, 0, self.n)

    @property
    def qweight(self) -> torch.Tensor:
        return self.packed

    @property
    def group_size(self) -> int:
        return self.shape[1]

    @property
    def num_bytes(self) -> int:
        return self.packed.numel() + self.scale.numel() * 4

    def to_x16(self) -> Fp8Weight:
        return self

    @property
    def kernel_scale(self) -> torch.Tensor:
        """float32 [N]: the scale per row times 2^120, as kernels/cpu/fp8_matmul.cpp reads
        codes (each code times 2^-120, exactly)."""
        if self._kernel_scale is None:
            n = self.shape[0]
            self._kernel_scale = (self.scale.expand(n, 1).reshape(n) * 2.0**120).contiguous()
        return self._kernel_scale

    def __getitem__(self, index: int | slice | torch.Tensor) -> Fp8Weight:
        """Experts of a 3-D weight: FP8 experts are not served yet."""
        raise TypeError("FP8 weights are 2-D here; FP8 mixture-of-experts tensors are not served yet")

    def rows(self, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) as float32: ``code * scale``, exact in float32."""
        values = unpack_rows(self.packed, start, end).view(torch.float8_e4m3fn).float()
        scale = self.scale if self.scale.shape[0] == 1 else self.scale[start:end]
        return values * scale

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], ``code * scale`` exactly; rounded to ``scale_dtype`` it is what
        compressed-tensors' decompression gives."""
        return self.rows(0, self.shape[0])

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        scale = self.scale if self.scale.shape[0] == 1 else self.scale[ids]
        codes = self.packed[ids // ROWS, :, ids % ROWS]
        return codes.view(torch.float8_e4m3fn).float() * scale

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        if self.activations == "token":
            return fake_quantize_e4m3(x, token_scales(x))
        if self.activations == "tensor":
            assert self.input_scale is not None
            return fake_quantize_e4m3(x, self.input_scale)
        return x

    @staticmethod
    def cat(parts: list[Fp8Weight]) -> Fp8Weight:
        """Rows of several weights stacked (fused projections): the scales become per row."""
        first = parts[0]
        scales = [p.scale.expand(p.shape[0], 1) for p in parts]
        return Fp8Weight.of(
            torch.cat([p.codes for p in parts]), torch.cat(scales).contiguous(),
            first.scale_dtype, first.activations, first.input_scale,
        )  # fmt: skip

    def fusable_with(self, other: Fp8Weight) -> bool:
        """Whether one fused weight computes both exactly as they compute alone: the same
        activation scheme and, for static scales, the same input scale."""
        if self.activations != other.activations or self.scale_dtype != other.scale_dtype:
            return False
        if self.input_scale is None or other.input_scale is None:
            return self.input_scale is None and other.input_scale is None
        return torch.equal(self.input_scale, other.input_scale)
