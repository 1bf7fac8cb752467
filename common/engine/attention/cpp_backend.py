"""The CPU step with fused C++ ops (kernels/cpu/ops.cpp): the fast CPU path.

Shapes: see base.py. Per layer, instead of a chain of torch ops each: RMS norm (with the
residual add, in place), rotary on q and k in place, the K/V write, and decode attention that
reads each sequence's own blocks through its table (no gather, no padding to the longest
sequence, no mask); SwiGLU's activation in one pass. Prefill chunks keep the torch backend's
``scaled_dot_product_attention`` (a fused flash kernel on CPU already).

The results differ from the torch backend's by float rounding (other summation orders, an
exp accurate to about 2e-7), which is why ``auto`` picks this backend only for quantized
weights, where transformers' exact numerics are not the reference anyway, and the torch
backend stays the bit-exact path for float weights. KV caches other than float32 (float16,
int8, fp8) and activations other than float32 take the torch backend's ops.
"""

from __future__ import annotations

import torch

from common.engine.attention.base import AttentionBatch, LayerKV
from common.engine.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata


class CppAttentionBackend(TorchAttentionBackend):
    name = "cpp"

    def __init__(self, sliding_window: int | None = None) -> None:
        from kernels.cpu import load

        super().__init__(sliding_window)
        self.ops = load()
        self.window = sliding_window or 0

    def prepare(self, batch: AttentionBatch, block_size: int) -> TorchAttentionMetadata:
        # Decode attention reads the tables directly: only prefills need gather ids or masks.
        prefill_block_ids, prefill_masks = self._prepare_prefills(batch, block_size)
        no_ids = torch.empty(0, 0, dtype=torch.long)
        no_mask = torch.empty(0, 1, 1, 0, dtype=torch.bool)
        return TorchAttentionMetadata(batch, no_ids, no_mask, prefill_block_ids, prefill_masks)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKV,
        metadata: TorchAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if q.dtype != torch.float32 or kv.k_cache.dtype != torch.float32:
            return self._torch_forward(q, k, v, kv, metadata, scale)
        batch = metadata.batch
        self.ops.write_kv(k, v, kv.k_cache, kv.v_cache, batch.slot_mapping)
        num_decodes = batch.num_decode_tokens
        decoded = None
        if num_decodes:
            decoded = self.ops.paged_decode_attention(
                q[:num_decodes], kv.k_cache, kv.v_cache, batch.decode_block_tables,
                batch.decode_seq_lens, scale, self.window,
            )  # fmt: skip
            if num_decodes == q.shape[0]:
                return decoded
        out = torch.empty_like(q)
        if decoded is not None:
            out[:num_decodes] = decoded
        self._prefills(q, k, v, kv, metadata, scale, out)
        return out

    def _torch_forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKV,
        metadata: TorchAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """The torch backend's path (quantized caches), with its decode metadata built now."""
        batch = metadata.batch
        block_size = kv.k_cache.shape[1]
        block_ids, decode_mask = self._prepare_decodes(batch, block_size)
        full = TorchAttentionMetadata(
            batch, block_ids, decode_mask, metadata.prefill_block_ids, metadata.prefill_masks
        )
        return super().forward(q, k, v, kv, full, scale)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype != torch.float32:
            return super().rms_norm(x, weight, eps)
        out: torch.Tensor = self.ops.rms_norm(x, weight, eps)
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Adds x into ``residual`` in place (the residual stream is the model's own)."""
        if x.dtype != torch.float32 or not residual.is_contiguous():
            return super().add_rms_norm(x, residual, weight, eps)
        out: torch.Tensor = self.ops.add_rms_norm_(x, residual, weight, eps)
        return out, residual

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates q and k in place (they are views into this step's projection output)."""
        if q.dtype != torch.float32:
            return super().rotary(q, k, positions, cos_sin)
        self.ops.rotary_(q, positions, cos_sin)
        self.ops.rotary_(k, positions, cos_sin)
        return q, k

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dtype != torch.float32 or not gate_up.is_contiguous():
            return super().silu_and_mul(gate_up)
        out: torch.Tensor = self.ops.silu_and_mul(gate_up)
        return out
