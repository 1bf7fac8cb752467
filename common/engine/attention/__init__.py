"""Attention backends behind one seam; ``select_backend`` picks one per engine."""

from __future__ import annotations

import torch

from common.engine.attention.base import AttentionBackend, AttentionBatch, LayerKV
from common.engine.attention.torch_backend import TorchAttentionBackend

BACKEND_NAMES = ("auto", "torch", "triton", "cpp")


def resolve_backend_name(name: str, device: torch.device, quantized: bool = False) -> str:
    """``auto`` is Triton on CUDA; on the CPU the fused C++ ops (cpp) for quantized weights
    when they build, else torch, the bit-exact reference for float weights. Other names are
    forced."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKEND_NAMES}")
    if name != "auto":
        return name
    if device.type == "cuda":
        return "triton"
    if quantized:
        from kernels.cpu import available

        if available():
            return "cpp"
    return "torch"


def select_backend(
    name: str,
    device: torch.device,
    sliding_window: int | None,
    quantized: bool = False,
    prefill_attention: str = "auto",
) -> AttentionBackend:
    chosen = resolve_backend_name(name, device, quantized)
    if chosen == "triton":
        # Imported only when chosen: Triton is not needed by a CPU engine on the torch path.
        from common.engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(device, sliding_window)
    if chosen == "cpp":
        if device.type != "cpu":
            raise ValueError(f"the cpp attention backend runs on the CPU, not {device}")
        from common.engine.attention.cpp_backend import CppAttentionBackend

        return CppAttentionBackend(sliding_window, prefill_attention)
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
