"""Attention backends behind one seam; ``select_backend`` picks one per engine."""

from __future__ import annotations

import torch

from common.engine.attention.base import AttentionBackend, AttentionBatch
from common.engine.attention.torch_backend import TorchAttentionBackend

BACKEND_NAMES = ("auto", "torch", "triton")


def select_backend(name: str, device: torch.device, sliding_window: int | None) -> AttentionBackend:
    """``auto`` is Triton on CUDA and torch elsewhere; either can be forced."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKEND_NAMES}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        from common.engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(sliding_window)
    return TorchAttentionBackend(sliding_window)


__all__ = ["AttentionBackend", "AttentionBatch", "TorchAttentionBackend", "select_backend"]
