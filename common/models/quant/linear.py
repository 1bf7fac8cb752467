"""Layers over quantized weights: ``QuantLinear``, ``QuantEmbedding``, ``QuantExperts``.

# T = tokens, K = input features, N = output features, E = experts, I = expert size

Activations stay float32 in and out; what computes the product is the engine's choice:

- ``cpp`` (the CPU default): kernels/cpu/quant.py, packed weights read as they are. On a
  CPU with AVX-512 BW / VL and VNNI, a weight whose rows come in sixteens is repacked once
  into the x16 layout (``Q4Weight.to_x16``; 16 rows interleaved) for int16 activation
  codes, and its kernel takes every row count: it beat dequantize-and-GEMM up to 512 rows
  and was 12 % slower at 1024 (1385 against 1242 ms for 30 layers, 2 threads), so such a weight has one
  path and the rest of this paragraph does not apply to it. Elsewhere, for many rows
  (prefill) the weight is instead dequantized in chunks of rows and multiplied
  by torch's float32 GEMM, which is faster from ``DENSE_MIN_ROWS`` rows (measured in
  loadtest/bench_quant.py). The two paths round differently, so which one a row takes is
  decided by the row, not by the step it lands in: the model runner marks the dense rows
  of each step (``dense_rows``; common/engine/model_runner.py says which). The packed
  kernel computes each row alone, so a generated token's products do not depend on what
  it is batched with, in chunked prefill, after a migration or in a speculative verify
  (tests/unit/test_quant_row_paths.py). Outside a step, a call with ``DENSE_MIN_ROWS``
  rows or more takes the dense path.
- ``torch``: torch's own packed CPU kernels, which take bfloat16 activations
  (``_weight_int4pack_mm_for_cpu`` for Q4, ``_weight_int8pack_mm`` for per-channel Q8) and,
  for blocked Q8 (GGUF's Q8_0), chunked dequantization and a float32 GEMM. A reference and
  the fallback where the C++ kernels cannot be built.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from common.models.quant.fp8 import Fp8Weight
from common.models.quant.half import HalfWeight
from common.models.quant.weights import Q4Weight, Q8Weight, QuantWeight
from kernels.cpu import quant as cpu_quant
from kernels.cpu.kquant import KQx16, kq_available, kq_x16_matmul

KERNELS = ("cpp", "torch")


@dataclass(frozen=True)
class QuantCompute:
    """How quantized weights are multiplied: the kernel, and for the C++ one the precision
    x is quantized to inside it (16 or 8 bits per element, a scale per 32)."""

    kernel: str = "cpp"
    act_bits: int = 16

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise ValueError(f"unknown quantized kernel {self.kernel!r}; choose one of {KERNELS}")
        if self.act_bits not in (8, 16):
            raise ValueError(f"activation bits must be 8 or 16, got {self.act_bits}")


# At or above this many rows, dequantize-and-GEMM beats the packed kernel (about 48-64 on a
# 2-core AVX2 machine for SmolLM2's shapes; loadtest/bench_quant.py prints the crossover).
DENSE_MIN_ROWS = 48
_CHUNK_ELEMENTS = 1 << 20  # float32 elements dequantized at once (4 MiB)


@dataclass(frozen=True)
class _RowPaths:
    """A step's rows, [T]: those the dense path computes; the packed kernel takes the rest."""

    dense: torch.Tensor  # bool [T]
    dense_index: torch.Tensor  # int64, the rows dense marks
    packed_index: torch.Tensor  # int64, the others

    @classmethod
    def of(cls, dense: torch.Tensor) -> _RowPaths:
        return cls(dense, dense.nonzero().view(-1), (~dense).nonzero().view(-1))


_ROW_PATHS: ContextVar[_RowPaths | None] = ContextVar("pdserve_quant_row_paths", default=None)


@contextmanager
def dense_rows(dense: torch.Tensor) -> Iterator[None]:
    """Within: a quantized layer given the step's T rows (``dense``, bool [T]) computes the
    rows ``dense`` marks on the dense path and the others on the packed kernel; a layer
    given a subset of them (an expert's tokens: see ``row_subset``) follows the subset's
    marks; a layer given other rows (the head's sampled rows) takes the packed kernel."""
    token = _ROW_PATHS.set(_RowPaths.of(dense))
    try:
        yield
    finally:
        _ROW_PATHS.reset(token)


@contextmanager
def row_subset(index: torch.Tensor) -> Iterator[None]:
    """Within ``dense_rows``: the layers called next get the step's rows ``index``."""
    paths = _ROW_PATHS.get()
    if paths is None:
        yield
        return
    token = _ROW_PATHS.set(_RowPaths.of(paths.dense[index]))
    try:
        yield
    finally:
        _ROW_PATHS.reset(token)


class _TorchQ4:
    """A Q4 weight in torch's int4pack layout: codes converted once, (scale, zero) bfloat16
    [K/G, N, 2] with ``zero = min + 8 * scale`` (torch computes ``(q - 8) * scale + zero``).
    torch packs rows in sixteens: other row counts are padded with zero rows, sliced off."""

    def __init__(self, weight: Q4Weight) -> None:
        n = weight.shape[0]
        self.num_rows = n
        pad = -n % 16
        codes = cpu_quant.unpack_q4_codes(weight.qweight).to(torch.int32)
        scales, mins = weight.scales.float(), weight.mins.float()
        if pad:
            codes = F.pad(codes, (0, 0, 0, pad))
            scales, mins = F.pad(scales, (0, 0, 0, pad)), F.pad(mins, (0, 0, 0, pad))
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        zeros = mins + 8 * scales
        self.scale_zeros = (
            torch.stack([scales.t(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous()
        )
        self.group_size = weight.group_size

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale_zeros))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self.packed, self.group_size, self.scale_zeros
        )
        return out[:, : self.num_rows].float()


def _dense_in_chunks(x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    """x @ dequantize(weight).T, dequantizing at most _CHUNK_ELEMENTS at a time."""
    if isinstance(weight, HalfWeight):  # as the kernel does: a bfloat16 head's x rounded
        x = weight.round_input(x)
    n, k = weight.shape
    rows = max(16, _CHUNK_ELEMENTS // k)
    if rows >= n:
        return F.linear(x, _dequantize_rows(weight, 0, n))
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    for start in range(0, n, rows):
        end = min(n, start + rows)
        out[:, start:end] = F.linear(x, _dequantize_rows(weight, start, end))
    return out


def _dequantize_rows(weight: QuantWeight, start: int, end: int) -> torch.Tensor:
    if isinstance(weight, KQx16):  # x16 weights take the packed kernel: not reached in a step
        return weight.dequantize()[start:end]
    if isinstance(weight, Fp8Weight | HalfWeight):
        return weight.rows(start, end)
    if isinstance(weight, Q4Weight) and cpu_quant_available():
        return cpu_quant.q4_dequantize(
            weight.qweight, weight.scales, weight.mins, weight.group_size, start, end
        )
    return weight[start:end].dequantize()


_cpp_ok: bool | None = None
_x16_ok: bool | None = None


def cpu_quant_available() -> bool:
    global _cpp_ok
    if _cpp_ok is None:
        from kernels.cpu import available

        _cpp_ok = available()
    return _cpp_ok


def x16_available() -> bool:
    """Whether the C++ kernels here have the x16 (AVX-512) matmuls."""
    global _x16_ok
    if _x16_ok is None:
        _x16_ok = cpu_quant_available() and cpu_quant.has_x16()
    return _x16_ok


def kernel_layout(weight: QuantWeight, compute: QuantCompute) -> QuantWeight:
    """``weight`` in the layout its kernel reads, for a 2-D weight whose rows come in
    sixteens: x16 where those kernels are built; else, with x coded in int8 and groups of 32,
    KQx16 (whose AVX2 path multiplies int8 codes: one row through 30 Llama-shaped layers of
    Q8_0 in 5.0 ms against the rows kernel's 6.8, Q4_0 2.7-3.7 against 4.0-4.6, 16 rows
    1.2-1.6x faster; with int16 codes the rows kernels are as fast or faster, and keep
    them); else as is."""
    if (
        compute.kernel != "cpp"
        or weight.layout != "rows"
        or weight.qweight.dim() != 2
        or weight.shape[0] % 16
        or weight.shape[1] % 32
    ):
        return weight
    if x16_available():
        return weight.to_x16()
    if (
        isinstance(weight, Q4Weight | Q8Weight)
        and compute.act_bits == 8
        and weight.group_size == 32
        and kq_available()
    ):
        return weight.to_kq_x16()
    return weight


class PackedMatmul:
    """One quantized weight [N, K] bound to a kernel: ``__call__(x [T, K]) -> [T, N]``."""

    def __init__(self, weight: QuantWeight, compute: QuantCompute) -> None:
        self.kernel = compute.kernel
        self.act_bits = compute.act_bits
        self.shape = weight.shape
        self.description = _describe(weight)
        if isinstance(weight, KQx16) and self.kernel != "cpp":
            raise ValueError(
                f"{weight.type_name} weights run on the C++ kernels only (--quant-kernel cpp)"
            )
        if self.kernel == "cpp" and weight.shape[1] % 32 and not isinstance(weight, Fp8Weight):
            raise ValueError(
                f"the C++ kernels need input features in multiples of 32; this layer has "
                f"{weight.shape[1]} (use --quant-kernel torch, or --quantization none)"
            )
        # torch's Q4 kernel reads its own layout: converted once, the original dropped; the
        # C++ kernels may read the x16 layout (kernel_layout).
        weight = kernel_layout(weight, compute)
        self.weight: QuantWeight | None = weight
        self._torch_q4: _TorchQ4 | None = None
        if self.kernel == "torch" and isinstance(weight, Q4Weight):
            self._torch_q4 = _TorchQ4(weight)
            self.weight = None
        held = self._torch_q4 if self._torch_q4 is not None else weight
        self.num_bytes = held.num_bytes
        # The tensor held, by identity: a table shared by two layers (a tied head) counts once.
        self.storage = held.packed if isinstance(held, _TorchQ4) else weight.qweight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._torch_q4 is not None:
            return self._torch_q4(x)
        w = self.weight
        assert w is not None, "a PackedMatmul keeps its weight unless torch's Q4 layout has it"
        if isinstance(w, Fp8Weight):  # x quantized as the checkpoint says (fp8.py)
            x = w.quantize_input(x)
        if isinstance(w, Fp8Weight | HalfWeight) and (
            self.kernel == "torch" or not cpu_quant_available()
        ):
            return _dense_in_chunks(x, w)
        if self.kernel == "torch":
            assert isinstance(w, Q8Weight), type(w)
            if w.group_size == w.shape[1]:
                scales = w.scales.view(-1).to(torch.bfloat16)
                return torch.ops.aten._weight_int8pack_mm(
                    x.to(torch.bfloat16), w.qweight, scales
                ).float()
            return _dense_in_chunks(x, w)
        if w.layout == "x16":
            return self._packed(x, w)
        paths = _ROW_PATHS.get()
        if paths is None:
            if x.shape[0] >= DENSE_MIN_ROWS:
                return _dense_in_chunks(x, w)
            return self._packed(x, w)
        if x.shape[0] != paths.dense.shape[0] or not paths.dense_index.numel():
            return self._packed(x, w)
        if not paths.packed_index.numel():
            return _dense_in_chunks(x, w)
        out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
        out[paths.dense_index] = _dense_in_chunks(x[paths.dense_index], w)
        out[paths.packed_index] = self._packed(x[paths.packed_index].contiguous(), w)
        return out

    def _packed(self, x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
        if isinstance(w, KQx16):
            return kq_x16_matmul(x, w, self.act_bits)
        if isinstance(w, Fp8Weight):  # its input already quantized (__call__)
            return cpu_quant.fp8_x16_matmul(x, w.packed, w.kernel_scale, w.n)
        if isinstance(w, HalfWeight):
            return cpu_quant.half_x16_matmul(x, w.packed, w.n)
        if w.layout == "x16":
            n = w.shape[0]
            if isinstance(w, Q4Weight):
                return cpu_quant.q4x16_matmul(
                    x, w.qweight, w.scales, w.mins, w.group_size, n, self.act_bits
                )
            return cpu_quant.q8x16_matmul(x, w.qweight, w.scales, w.group_size, n, self.act_bits)
        if isinstance(w, Q4Weight):
            return cpu_quant.q4_matmul(x, w.qweight, w.scales, w.mins, w.group_size, self.act_bits)
        assert isinstance(w, Q8Weight), type(w)
        return cpu_quant.q8_matmul(x, w.qweight, w.scales, w.group_size, self.act_bits)


class QuantLinear(nn.Module):
    """A linear layer whose weight is one or more quantized row blocks (fused projections
    whose parts came in different formats stay separate parts; the outputs are concatenated).

    ``shard_offsets`` keeps the float layer's row ranges (q/k/v, gate/up) for callers that
    split the output."""

    def __init__(
        self,
        parts: list[QuantWeight],
        bias: torch.Tensor | None,
        compute: QuantCompute,
        shard_offsets: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        super().__init__()
        assert parts, "a QuantLinear needs at least one weight"
        assert len({p.shape[1] for p in parts}) == 1, "parts differ in input features"
        self.parts = [PackedMatmul(p, compute) for p in parts]
        self.in_features = parts[0].shape[1]
        self.out_features = sum(p.shape[0] for p in parts)
        # A plain attribute, not a buffer: a model built on the meta device gets its quantized
        # layers before ``to_empty``, which would otherwise replace the bias with garbage.
        self.bias = None if bias is None else bias.detach().float().clone()
        self.shard_offsets = dict(shard_offsets or {})
        self.format = "+".join(sorted({p.description for p in self.parts}))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float().contiguous()
        if len(self.parts) == 1:
            out = self.parts[0](x2)
        else:
            out = torch.cat([part(x2) for part in self.parts], dim=-1)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*lead, self.out_features)

    @property
    def num_weight_bytes(self) -> int:
        return sum(p.num_bytes for p in self.parts)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, format={self.format}"


class QuantEmbedding(nn.Module):
    """Token embeddings from a quantized [V, H] table: only the looked-up rows are
    dequantized (a tied output head shares the table)."""

    def __init__(self, weight: QuantWeight) -> None:
        super().__init__()
        self.table = weight
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        return self.table.lookup(ids)


class QuantExperts(nn.Module):
    """E SwiGLU experts over quantized weights, the interface of common/models/moe.py's
    ``Experts`` for the loop path. Built from ``gate_up [E, 2I, H]`` and ``down [E, H, I]``
    (a quantized float model), or by ``of_parts`` from each expert's own weights as a
    checkpoint stores them (gate and up fused where their layouts allow, else two parts)."""

    def __init__(self, gate_up: QuantWeight, down: QuantWeight, compute: QuantCompute) -> None:
        num_experts = gate_up.qweight.shape[0]
        self._build(
            [[gate_up[e]] for e in range(num_experts)], [[down[e]] for e in range(num_experts)],
            compute,
        )  # fmt: skip

    @classmethod
    def of_parts(
        cls,
        gate_up: list[list[QuantWeight]],
        down: list[list[QuantWeight]],
        compute: QuantCompute,
    ) -> QuantExperts:
        """Expert e's gate_up rows are the parts ``gate_up[e]`` in order (gate rows, then
        up), its down rows ``down[e]``."""
        experts = cls.__new__(cls)
        experts._build(gate_up, down, compute)
        return experts

    def _build(
        self, gate_up: list[list[QuantWeight]], down: list[list[QuantWeight]], compute: QuantCompute
    ) -> None:
        super().__init__()
        assert gate_up and len(gate_up) == len(down), "one gate_up and one down per expert"
        self.num_experts = len(gate_up)
        self.intermediate = sum(p.shape[0] for p in gate_up[0]) // 2
        self.gate_up_parts = [[PackedMatmul(p, compute) for p in parts] for parts in gate_up]
        self.down_parts = [[PackedMatmul(p, compute) for p in parts] for parts in down]
        self.format = "+".join(sorted({m.description for m in self.matmuls}))

    @property
    def matmuls(self) -> list[PackedMatmul]:
        """Every packed matmul of every expert."""
        return [m for parts in self.gate_up_parts + self.down_parts for m in parts]

    @staticmethod
    def _run(parts: list[PackedMatmul], x: torch.Tensor) -> torch.Tensor:
        if len(parts) == 1:
            return parts[0](x)
        return torch.cat([part(x) for part in parts], dim=-1)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = self._run(self.gate_up_parts[e], x.float().contiguous())  # [n, 2I]
        gate, up = gate_up[:, : self.intermediate], gate_up[:, self.intermediate :]
        return self._run(self.down_parts[e], (F.silu(gate) * up).contiguous())


def _describe(weight: QuantWeight) -> str:
    if isinstance(weight, Fp8Weight):
        return f"fp8/{weight.activations}"
    if isinstance(weight, HalfWeight):
        return weight.kind
    if isinstance(weight, Q8Weight) and weight.group_size == weight.shape[1]:
        return "q8/row"
    return f"{weight.kind}/g{weight.group_size}"
