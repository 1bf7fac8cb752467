"""Rotary position embedding (HF "rotate_half" convention) with default/linear/llama3 scaling.

Shapes: T = tokens, H = heads, D = head dim.
The cos/sin table is computed in float32 exactly as transformers computes it, so the
rotated queries and keys are bit-identical to the reference implementation.
"""

from __future__ import annotations

import math

import torch

from common.contract.model_spec import RopeSpec


def inverse_frequencies(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)  # [D/2]
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    old_context = rope.original_max_position_embeddings
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def cos_sin_table(rope: RopeSpec, head_dim: int, max_positions: int) -> torch.Tensor:
    """[max_positions, D]: cos of the angles in the first D/2 columns, sin in the last D/2."""
    inv_freq = inverse_frequencies(rope, head_dim)
    positions = torch.arange(max_positions, dtype=torch.float)
    angles = positions[:, None] * inv_freq[None, :]  # [P, D/2]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def rotation_rows(rope: RopeSpec, head_dim: int, delta: int) -> torch.Tensor:
    """[1, D] cos/sin of ``delta`` positions' angles (computed in float64: ``delta`` may be
    large), for turning keys written at position p into keys at p + delta."""
    inv_freq = inverse_frequencies(rope, head_dim).double()
    angles = delta * inv_freq
    return torch.cat([angles.cos(), angles.sin()]).float()[None, :]


def apply_rotary(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos_sin: [T, D] rows of the table for each token's position."""
    half = x.shape[-1] // 2
    cos = cos_sin[:, None, :half].to(x.dtype)  # [T, 1, D/2]
    sin = cos_sin[:, None, half:].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    # Same products and sums as HF's x * cat(cos, cos) + rotate_half(x) * cat(sin, sin).
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
