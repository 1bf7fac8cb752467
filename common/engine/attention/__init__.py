"""Attention backends behind one seam; ``select_backend`` picks one per engine."""

from __future__ import annotations

import torch

from common.engine.attention.base import AttentionBackend, AttentionBatch, LayerKV
from common.engine.attention.torch_backend import TorchAttentionBackend

BACKEND_NAMES = ("auto", "torch", "triton")


def resolve_backend_name(name: str, device: torch.device) -> str:
    """``auto`` is Triton on CUDA and torch elsewhere; ``torch`` and ``triton`` are forced."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKEND_NAMES}")
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return name


def select_backend(name: str, device: torch.device, sliding_window: int | None) -> AttentionBackend:
    if resolve_backend_name(name, device) == "triton":
        # Imported only when chosen: Triton is not needed by a CPU engine on the torch path.
        from common.engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(device, sliding_window)
    return TorchAttentionBackend(sliding_window)


__all__ = [
    "BACKEND_NAMES",
    "AttentionBackend",
    "AttentionBatch",
    "LayerKV",
    "TorchAttentionBackend",
    "resolve_backend_name",
    "select_backend",
]
