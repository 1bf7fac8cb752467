"""Attention over the paged KV cache in plain torch: the CPU path and the reference seam.

Shapes: see base.py. Decode sequences are batched by gathering their blocks into a padded
[Bd, Hkv, M*S, D] view and masking; prefill chunks run one sequence at a time through
``scaled_dot_product_attention`` (a chunk with no cached prefix attends to its own fresh
K/V, exactly like a dense causal forward, unless the cache is quantized: then every query
reads the dequantized cache, as the Triton kernels do, so a prefix-cache hit or a chunk
boundary never changes what a token sees).

The norm and rotary ops repeat Hugging Face's arithmetic operation for operation (same
roundings, same order), so the torch path stays the numerical reference for transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.engine.attention.base import AttentionBatch, LayerKV
from common.engine.attention.torch_kv import gather_blocks, write_kv_torch
from common.models.layers import rms_norm_hf, silu_and_mul
from common.models.rope import apply_rotary


@dataclass
class TorchAttentionMetadata:
    batch: AttentionBatch
    decode_block_ids: torch.Tensor  # [Bd, Md] blocks to gather for the decode group
    decode_mask: torch.Tensor  # [Bd, 1, 1, Md*S] True where a position may be attended
    prefill_block_ids: list[torch.Tensor]  # per prefill sequence: its blocks [m_i]
    prefill_masks: list[torch.Tensor | None]  # per prefill sequence: [q, ctx] or None (causal)


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, sliding_window: int | None = None) -> None:
        self.sliding_window = sliding_window

    def prepare(self, batch: AttentionBatch, block_size: int) -> TorchAttentionMetadata:
        block_ids, decode_mask = self._prepare_decodes(batch, block_size)
        prefill_block_ids, prefill_masks = self._prepare_prefills(batch, block_size)
        return TorchAttentionMetadata(
            batch, block_ids, decode_mask, prefill_block_ids, prefill_masks
        )

    def _prepare_decodes(
        self, batch: AttentionBatch, block_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode group's blocks to gather [Bd, Md] and its mask [Bd, 1, 1, Md*S]."""
        window = self.sliding_window
        if not batch.num_decode_tokens:
            return torch.empty(0, 0, dtype=torch.long), torch.empty(0, 1, 1, 0, dtype=torch.bool)
        num_blocks = -(-batch.max_decode_seq_len // block_size)
        block_ids = batch.decode_block_tables[:, :num_blocks].long()
        positions = torch.arange(num_blocks * block_size)
        seq_lens = batch.decode_seq_lens.long()[:, None]
        mask = positions[None, :] < seq_lens
        if window is not None:
            mask &= positions[None, :] >= seq_lens - window
        return block_ids, mask[:, None, None, :]

    def _prepare_prefills(
        self, batch: AttentionBatch, block_size: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Per prefill sequence: its blocks [m_i], and its mask [q, ctx] (None = causal)."""
        window = self.sliding_window
        prefill_block_ids: list[torch.Tensor] = []
        prefill_masks: list[torch.Tensor | None] = []
        for i, (q_len, seq_len) in enumerate(
            zip(batch.prefill_query_lens_host, batch.prefill_seq_lens_host, strict=True)
        ):
            num_blocks = -(-seq_len // block_size)
            prefill_block_ids.append(batch.prefill_block_tables[i, :num_blocks].long())
            prefix_len = seq_len - q_len
            if prefix_len == 0 and (window is None or seq_len <= window):
                prefill_masks.append(None)
                continue
            q_pos = torch.arange(prefix_len, seq_len)[:, None]
            k_pos = torch.arange(seq_len)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
            prefill_masks.append(mask)
        return prefill_block_ids, prefill_masks

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKV,
        metadata: TorchAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        batch = metadata.batch
        write_kv_torch(k, v, kv, batch.slot_mapping)

        out = torch.empty_like(q)
        num_decodes = batch.num_decode_tokens
        if num_decodes:
            out[:num_decodes] = self._decode(q[:num_decodes], kv, metadata, scale)
        self._prefills(q, k, v, kv, metadata, scale, out)
        return out

    @staticmethod
    def _prefills(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKV,
        metadata: TorchAttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Attention of the prefill chunks (after the decode tokens) into ``out``."""
        start = metadata.batch.num_decode_tokens
        for i, q_len in enumerate(metadata.batch.prefill_query_lens_host):
            out[start : start + q_len] = prefill_chunk(q, k, v, kv, metadata, scale, i, start)
            start += q_len

    @staticmethod
    def _decode(
        q: torch.Tensor,  # [Bd, Hq, D]
        kv: LayerKV,
        metadata: TorchAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads = kv.k_cache.shape[2]
        group = num_heads // num_kv_heads
        block_ids = metadata.decode_block_ids
        dtype = q.dtype if kv.quantized else kv.k_cache.dtype
        keys = gather_blocks(kv.k_cache, kv.k_scale, block_ids, dtype)  # [Bd, Md, S, Hkv, D]
        values = gather_blocks(kv.v_cache, kv.v_scale, block_ids, dtype)
        keys = keys.flatten(1, 2).transpose(1, 2)  # [Bd, Hkv, Md*S, D], a strided view
        values = values.flatten(1, 2).transpose(1, 2)
        # The G query heads sharing a kv head act as G query rows against that head's keys:
        # GQA without copying K/V per query head, one fused kernel for the whole group.
        q_grouped = q.view(num_seqs, num_kv_heads, group, head_dim).to(keys.dtype)
        out = F.scaled_dot_product_attention(
            q_grouped, keys, values, attn_mask=metadata.decode_mask, scale=scale
        )  # [Bd, Hkv, G, D]
        return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm_hf(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        summed = residual + x
        return rms_norm_hf(summed, weight, eps), summed

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = cos_sin[positions]  # [T, D]
        return apply_rotary(q, rows), apply_rotary(k, rows)


def prefill_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: LayerKV,
    metadata: TorchAttentionMetadata,
    scale: float,
    i: int,
    start: int,
) -> torch.Tensor:
    """Prefill chunk ``i``'s attention (its rows start at ``start``): a fresh chunk over its
    own K/V, else over its sequence's gathered context."""
    batch = metadata.batch
    end = start + batch.prefill_query_lens_host[i]
    mask = metadata.prefill_masks[i]
    if mask is None and not kv.quantized:
        keys, values = k[start:end], v[start:end]
    else:
        # A fresh chunk's mask stays None (causal): its keys are exactly its queries'.
        block_ids = metadata.prefill_block_ids[i]
        seq_len = batch.prefill_seq_lens_host[i]
        keys = gather_blocks(kv.k_cache, kv.k_scale, block_ids, q.dtype)
        values = gather_blocks(kv.v_cache, kv.v_scale, block_ids, q.dtype)
        keys, values = keys.flatten(0, 1)[:seq_len], values.flatten(0, 1)[:seq_len]
    return _dense_attention(q[start:end], keys, values, mask, scale)


def _dense_attention(
    q: torch.Tensor,  # [q, Hq, D]
    k: torch.Tensor,  # [ctx, Hkv, D]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # [q, ctx] bool, None = causal over a fresh chunk
    scale: float,
) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k = k.to(q.dtype).repeat_interleave(group, dim=1) if group > 1 else k.to(q.dtype)
    v = v.to(q.dtype).repeat_interleave(group, dim=1) if group > 1 else v.to(q.dtype)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],  # [1, Hq, q, D]
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
    )
    return out[0].transpose(0, 1)  # [q, Hq, D]
