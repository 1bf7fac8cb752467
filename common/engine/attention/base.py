"""The attention seam: what the model calls, whatever computes it (torch, Triton, ...).

Shapes: T = tokens in the step, Hq/Hkv = query/kv heads, D = head dim, L = layers,
N = blocks in the pool, S = block size, Bd/Bp = decode/prefill sequences, M = max blocks,
H = hidden size, P = rotary table positions.

Token order in a step is fixed: the ``num_decode_tokens`` single-token queries first (one
per sequence), then the prefill chunks back to back. A "decode" here is any sequence whose
query in this step is exactly one token, whatever its phase.

Contract: ``forward`` writes the step's new K/V into the layer's cache at ``slot_mapping``
and then attends; the backend never frees or allocates blocks (the KV manager does).
A quantized cache (int8 / fp8 codes, see kernels/kv_quant.py) is quantized on that write and
dequantized inside attention; a write that covers offset 0 of a block starts the block
afresh (new scale), so a reused block never inherits its previous owner's scale.

A backend also supplies the elementwise ops around attention, ``rms_norm`` / ``add_rms_norm``
(fused with the residual add), ``rotary`` and the MLP's ``silu_and_mul``, so the model stays
backend-agnostic: the torch
backend keeps Hugging Face's exact numerics, the Triton backend uses fused kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

QUANTIZED_KV_DTYPES = (torch.int8, torch.float8_e4m3fn)


@dataclass(frozen=True)
class LayerKV:
    """One layer's paged KV cache: views into the runner's cache tensors, never copies."""

    k_cache: torch.Tensor  # [N, S, Hkv, D] float, or int8 / fp8 codes
    v_cache: torch.Tensor  # [N, S, Hkv, D]
    k_scale: torch.Tensor | None = None  # [N, Hkv] float32, quantized caches only
    v_scale: torch.Tensor | None = None  # [N, Hkv] float32

    def __post_init__(self) -> None:
        quantized = self.k_cache.dtype in QUANTIZED_KV_DTYPES
        has_scales = self.k_scale is not None and self.v_scale is not None
        assert quantized == has_scales, (
            f"a {self.k_cache.dtype} cache needs scales exactly when it is quantized"
        )

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None


@dataclass
class AttentionBatch:
    """The backend-independent description of one step's attention layout."""

    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [Bd, M] int32
    decode_seq_lens: torch.Tensor  # [Bd] int32, context length incl. the new token
    prefill_block_tables: torch.Tensor  # [Bp, M] int32
    prefill_query_start_loc: torch.Tensor  # [Bp + 1] int32, offsets inside the prefill part
    prefill_seq_lens: torch.Tensor  # [Bp] int32, context length incl. the chunk
    max_decode_seq_len: int
    prefill_query_lens_host: list[int]
    prefill_seq_lens_host: list[int]

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_seq_lens_host)


class AttentionBackend(Protocol):
    name: str

    def prepare(self, batch: AttentionBatch, block_size: int) -> Any:
        """Per-step metadata, built once and shared by every layer."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv: LayerKV,
        metadata: Any,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        ...

    def rms_norm(
        self,
        x: torch.Tensor,  # [T, H]
        weight: torch.Tensor,  # [H]
        eps: float,
    ) -> torch.Tensor:  # [T, H]
        ...

    def add_rms_norm(
        self,
        x: torch.Tensor,  # [T, H]
        residual: torch.Tensor,  # [T, H]
        weight: torch.Tensor,  # [H]
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused with the norm after it."""
        ...

    def rotary(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        positions: torch.Tensor,  # [T] int64
        cos_sin: torch.Tensor,  # [P, D] float32: cos in [:, :D/2], sin in [:, D/2:]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated q and k (HF ``rotate_half`` convention)."""
        ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
        """SwiGLU's activation: silu(gate) * up."""
        ...
