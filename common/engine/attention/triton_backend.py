"""Attention over the paged KV cache with the Triton kernels of kernels/ (the CUDA path).

Shapes: see base.py. Per layer: ``write_kv`` stores the step's K/V (quantizing for an int8 /
fp8 cache), then ``paged_decode_attention`` serves the first ``num_decode_tokens`` queries and
``paged_prefill_attention`` the prefill chunks after them; both read K/V from the cache only.
The norm and rotary ops are the fused kernels (RMSNorm with the residual add, rotary on q and
k in one launch); they round differently from transformers by an ulp or so, which is why the
torch backend, not this one, is the bit-exact reference.

The kernels validate shapes, dtypes and contiguity and raise ValueError; this module hands
them contiguous tensors (the model's q/k/v are views into one projection output).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from common.engine.attention.base import AttentionBatch, LayerKV
from common.models.layers import silu_and_mul
from kernels.kv_write import write_kv
from kernels.paged_decode_attention import paged_decode_attention
from kernels.paged_prefill_attention import paged_prefill_attention
from kernels.rms_norm import rms_norm
from kernels.rotary import apply_rotary


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [Bd, M] int32
    decode_seq_lens: torch.Tensor  # [Bd] int32
    num_prefills: int
    prefill_block_tables: torch.Tensor  # [Bp, M] int32
    prefill_query_start_loc: torch.Tensor  # [Bp + 1] int32, from 0 inside the prefill part
    prefill_seq_lens: torch.Tensor  # [Bp] int32


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, device: torch.device, sliding_window: int | None = None) -> None:
        if device.type != "cuda" and not (device.type == "cpu" and triton.knobs.runtime.interpret):
            raise ValueError(
                f"the triton attention backend needs a CUDA device, got {device}; use "
                "--attention-backend torch (on CPU, Triton's interpreter runs the kernels only "
                "when TRITON_INTERPRET=1 is set before start, which is for tests)"
            )
        self.sliding_window = sliding_window

    def prepare(self, batch: AttentionBatch, block_size: int) -> TritonAttentionMetadata:
        return TritonAttentionMetadata(
            slot_mapping=batch.slot_mapping.contiguous(),
            num_decode_tokens=batch.num_decode_tokens,
            decode_block_tables=batch.decode_block_tables.to(torch.int32).contiguous(),
            decode_seq_lens=batch.decode_seq_lens.to(torch.int32).contiguous(),
            num_prefills=batch.num_prefills,
            prefill_block_tables=batch.prefill_block_tables.to(torch.int32).contiguous(),
            prefill_query_start_loc=batch.prefill_query_start_loc.to(torch.int32).contiguous(),
            prefill_seq_lens=batch.prefill_seq_lens.to(torch.int32).contiguous(),
        )

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv: LayerKV,
        metadata: TritonAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        out_dtype = q.dtype
        if not kv.quantized and kv.k_cache.dtype != q.dtype:
            # A float cache in another dtype than the model's: attend in the cache's dtype.
            q, k, v = (t.to(kv.k_cache.dtype) for t in (q, k, v))
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        write_kv(k, v, kv.k_cache, kv.v_cache, metadata.slot_mapping, kv.k_scale, kv.v_scale)

        num_decodes = metadata.num_decode_tokens
        parts = []
        if num_decodes:
            decode_out = paged_decode_attention(
                q[:num_decodes], kv.k_cache, kv.v_cache, metadata.decode_block_tables,
                metadata.decode_seq_lens, scale, self.sliding_window, kv.k_scale, kv.v_scale,
            )  # fmt: skip
            parts.append(decode_out)
        if metadata.num_prefills:
            prefill_out = paged_prefill_attention(
                q[num_decodes:], kv.k_cache, kv.v_cache, metadata.prefill_block_tables,
                metadata.prefill_query_start_loc, metadata.prefill_seq_lens, scale,
                self.sliding_window, kv.k_scale, kv.v_scale,
            )  # fmt: skip
            parts.append(prefill_out)
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out.to(out_dtype)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = rms_norm(x.contiguous(), weight, eps)
        assert isinstance(out, torch.Tensor), "rms_norm without a residual returns one tensor"
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = rms_norm(x.contiguous(), weight, eps, residual.contiguous())
        assert isinstance(out, tuple), "rms_norm with a residual returns (out, new_residual)"
        return out

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(q.contiguous(), k.contiguous(), positions.contiguous(), cos_sin)
