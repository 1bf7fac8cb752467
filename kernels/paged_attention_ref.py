"""Pure-torch pieces shared by the decode and prefill attention references.

# L = context tokens of one sequence, n = queries of one sequence, Hq = query heads,
# Hkv = kv heads, D = head dim, N = num blocks, S = block size, M = max blocks per sequence

These are deliberately plain (gather the sequence out of the paged cache, dequantize, repeat
kv heads, masked softmax in float32) so that they are easy to trust; the tests check them in
turn against torch's scaled_dot_product_attention on unpaged tensors.
"""

from __future__ import annotations

import torch

from kernels.kv_quant import dequantize_ref


def gather_kv_ref(
    cache: torch.Tensor,  # [N, S, Hkv, D]
    scale: torch.Tensor | None,  # [N, Hkv] float32, quantized cache only
    block_table: torch.Tensor,  # [M]
    seq_len: int,
) -> torch.Tensor:
    """The first seq_len tokens of one sequence as float32: [L, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].long()  # [nb]
    x = cache[blocks].float()  # [nb, S, Hkv, D]
    if scale is not None:
        x = dequantize_ref(x, scale[blocks][:, None, :, None])
    return x.reshape(-1, *cache.shape[2:])[:seq_len]


def attend_ref(
    q: torch.Tensor,  # [n, Hq, D]
    k: torch.Tensor,  # [L, Hkv, D] float32
    v: torch.Tensor,  # [L, Hkv, D] float32
    q_positions: torch.Tensor,  # [n] position of each query in the sequence
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Causal (optionally windowed) attention of n queries over L keys: [n, Hq, D] float32."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # [L, Hq, D]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale  # [Hq, n, L]
    key_positions = torch.arange(k.shape[0], device=q.device)  # [L]
    distance = q_positions[:, None] - key_positions[None, :]  # [n, L]
    allowed = distance >= 0
    if sliding_window is not None:
        allowed &= distance < sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [Hq, n, L]
    return torch.einsum("hnl,lhd->nhd", probs, v)
