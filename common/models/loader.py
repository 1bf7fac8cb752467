"""Builds our model for a checkpoint directory: config via AutoConfig, weights from safetensors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from common.engine.attention import AttentionBackend
from common.models.llama import LlamaForCausalLM
from common.models.moe import MoeForCausalLM
from common.models.spec import (
    LLAMA_FAMILY,
    MOE_FAMILY,
    ModelSpec,
    UnsupportedModelError,
)

# Every model class is a LlamaForCausalLM: the MoE ones replace the MLP of sparse layers.
CausalLM = LlamaForCausalLM


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors weights")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def model_class_for(spec: ModelSpec) -> type[LlamaForCausalLM]:
    """The class implementing a checkpoint's architecture (by its config's model_type)."""
    if spec.model_type in MOE_FAMILY and spec.moe is not None:
        return MoeForCausalLM
    if spec.model_type in LLAMA_FAMILY:
        return LlamaForCausalLM
    raise UnsupportedModelError(f"unsupported architecture {spec.architecture!r}")


def build_model(
    spec: ModelSpec,
    model_dir: str | Path,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
) -> CausalLM:
    model_class = model_class_for(spec)
    with torch.device("meta"):
        model = model_class(spec, backend, dtype)
    model = model.to_empty(device=device)
    model.tie_weights()
    # Buffers are not weights: rebuild the rope table (and the expert counters) on the device.
    model.init_buffers(device)
    model.load_weights(iter_safetensors(Path(model_dir)))
    return model.eval()
