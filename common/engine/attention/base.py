"""The attention seam: what the model calls, whatever computes it (torch, Triton, ...).

Shapes: T = tokens in the step, Hq/Hkv = query/kv heads, D = head dim, L = layers,
N = blocks in the pool, S = block size, Bd/Bp = decode/prefill sequences, M = max blocks.

Token order in a step is fixed: the ``num_decode_tokens`` single-token queries first (one
per sequence), then the prefill chunks back to back. A "decode" here is any sequence whose
query in this step is exactly one token, whatever its phase.

Contract: ``forward`` writes the step's new K/V into the layer's cache at ``slot_mapping``
and then attends; the backend never frees or allocates blocks (the KV manager does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


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
        k_cache: torch.Tensor,  # [N, S, Hkv, D]
        v_cache: torch.Tensor,  # [N, S, Hkv, D]
        metadata: Any,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        ...
