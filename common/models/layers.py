"""Building blocks shared by the model families. Shapes: T = tokens, H = hidden size."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from common.engine.attention.base import AttentionBackend


def rms_norm_hf(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm computed in float32 and cast back before the weight, as transformers does."""
    input_dtype = x.dtype
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    x32 = x32 * torch.rsqrt(variance + eps)
    return weight * x32.to(input_dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: gate_up [T, 2I] (gate | up) -> silu(gate) * up [T, I]."""
    size = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :size]) * gate_up[..., size:]


class RMSNorm(nn.Module):
    """An RMS norm's weight and eps; the arithmetic is the attention backend's (see
    common/engine/attention/base.py), so a fused kernel can replace it."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: AttentionBackend) -> torch.Tensor:
        """x: [T, H], or [T, heads, H] for a per-head norm."""
        if x.dim() == 2:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)

    def forward_add(
        self, x: torch.Tensor, residual: torch.Tensor, ops: AttentionBackend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) for x, residual: [T, H]."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


@runtime_checkable
class ShardedParams(Protocol):
    """A module whose parameters are filled from several HF tensors, each a named shard."""

    def load_shard(
        self, shard: str, param_name: str, tensor: torch.Tensor
    ) -> list[tuple[str, str]]:
        """Copies ``tensor`` in; returns the (parameter attribute, shard) pairs it filled."""
        ...

    def expected_shards(self, attr: str) -> list[str]:
        """Every shard parameter ``attr`` needs before the model is complete."""
        ...


class ShardedLinear(nn.Linear):
    """A linear layer whose output rows are the concatenation of several HF weights.

    ``shard_sizes`` names the row ranges, e.g. q/k/v or gate/up, so that one matmul
    replaces several while each HF tensor still loads by its own name.
    """

    def __init__(
        self, in_features: int, shard_sizes: dict[str, int], bias: bool, dtype: torch.dtype
    ) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias, dtype=dtype)
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size

    def expected_shards(self, attr: str) -> list[str]:
        return list(self.shard_offsets)

    def load_shard(
        self, shard: str, param_name: str, tensor: torch.Tensor
    ) -> list[tuple[str, str]]:
        start, size = self.shard_offsets[shard]
        target = self.weight if param_name == "weight" else self.bias
        if target is None:
            raise ValueError(f"checkpoint has a {shard} bias but the config says there is none")
        rows = target.data[start : start + size]
        if rows.shape != tensor.shape:
            raise ValueError(
                f"{shard}.{param_name}: checkpoint shape {tuple(tensor.shape)} does not match "
                f"the config's {tuple(rows.shape)}"
            )
        rows.copy_(tensor)
        return [(param_name, shard)]
