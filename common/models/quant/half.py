"""A checkpoint's float output head (and tied embedding table) at its own 2 bytes a weight,
and the 16-rows-interleaved layout it shares with FP8 codes (common/models/quant/fp8.py).

GPTQ, AWQ and compressed-tensors checkpoints leave the output head unquantized, in the
model's bfloat16 or float16. Upcast to float32 it would be the largest tensor the engine
reads each decode step (SmolLM2's tied 49152 x 576 table: 113 MB against 54 MB for all its
4-bit layers), so it is held as stored, 16 rows interleaved (``packed[b, j, l]`` is row
``16 b + l``, column ``j``; the last block padded with zero rows):
kernels/cpu/fp8_matmul.cpp's ``half_x16_matmul`` converts each weight to float32 as it reads
it (exact) and multiplies in float32, each output in one fixed order whatever the batch.
A bfloat16 head multiplies as a bfloat16 linear layer does, on x rounded to bfloat16 (each
product exact, float32 sums): with AVX512-BF16 the kernel's vdpbf16ps then does twice the
multiply-adds of float32 FMAs (SmolLM2's head at 16 rows: 2.8 ms against 5.6, Zen 4,
loadtest/bench_half_head.py), and every path (the kernel, the float GEMM of many rows)
rounds x the same way first, so a row's logits do not depend on the path. A float16 head
keeps float32 x (no instruction here multiplies float16 pairs).
Row-major, the same kernel read four rows a pass as four streams and got half the memory
bandwidth (3.1 ms for SmolLM2's head against 1.5 ms; at 16 rows 13.8 ms against 6.6).
Prefill rows take torch's float32 GEMM over converted chunks, as the packed formats do
(common/models/quant/linear.py); embedding lookups gather their rows from the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HALF_DTYPES = (torch.bfloat16, torch.float16)
ROWS = 16  # rows a block interleaves


def pack_rows(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 16), K, 16], the last block's missing rows zero."""
    n, k = weight.shape
    blocks = -(-n // ROWS)
    padded = weight
    if blocks * ROWS != n:
        padded = torch.cat([weight, weight.new_zeros(blocks * ROWS - n, k)])
    return padded.view(blocks, ROWS, k).transpose(1, 2).contiguous()


def unpack_rows(packed: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Rows [start, end) of a packed [ceil(N / 16), K, 16] matrix, row-major [end - start, K]."""
    first, last = start // ROWS, -(-end // ROWS)
    block = packed[first:last].transpose(1, 2).reshape(-1, packed.shape[1])
    return block[start - first * ROWS : end - first * ROWS]


@dataclass
class HalfWeight:
    packed: torch.Tensor  # bfloat16 or float16 [ceil(N / 16), K, 16]
    n: int  # rows

    layout = "half"

    def __post_init__(self) -> None:
        assert self.packed.dim() == 3 and self.packed.shape[2] == ROWS, self.packed.shape
        assert 0 < self.n <= self.packed.shape[0] * ROWS, (self.n, self.packed.shape)

    @classmethod
    def of(cls, weight: torch.Tensor) -> HalfWeight:
        """A [N, K] bfloat16 / float16 matrix, packed."""
        assert weight.dim() == 2 and weight.dtype in HALF_DTYPES, (weight.shape, weight.dtype)
        return cls(pack_rows(weight), weight.shape[0])

    @property
    def kind(self) -> str:
        return "bf16" if self.packed.dtype == torch.bfloat16 else "f16"

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.packed.shape[1]

    @property
    def qweight(self) -> torch.Tensor:
        return self.packed

    @property
    def group_size(self) -> int:
        return self.shape[1]

    @property
    def num_bytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()

    def round_input(self, x: torch.Tensor) -> torch.Tensor:
        """x as this head multiplies it: rounded to bfloat16 (to nearest even) for a bfloat16
        head, unchanged for a float16 one."""
        if self.packed.dtype != torch.bfloat16:
            return x
        return x.to(torch.bfloat16).to(torch.float32)

    def to_x16(self) -> HalfWeight:
        return self

    def rows(self, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) as float32 [end - start, K]."""
        return unpack_rows(self.packed, start, end).float()

    def dequantize(self) -> torch.Tensor:
        return self.rows(0, self.n)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return self.packed[ids // ROWS, :, ids % ROWS].float()

    def __getitem__(self, index: int | slice | torch.Tensor) -> HalfWeight:
        raise TypeError("half-precision weights are 2-D heads here, not experts")
