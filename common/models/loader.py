"""Builds our model for a checkpoint directory: config via AutoConfig, weights from safetensors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from common.engine.attention import AttentionBackend
from common.models.llama import LlamaForCausalLM
from common.models.rope import cos_sin_table
from common.models.spec import LLAMA_FAMILY, ModelSpec, UnsupportedModelError

CausalLM = LlamaForCausalLM


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors weights")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def build_model(
    spec: ModelSpec,
    model_dir: str | Path,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
) -> CausalLM:
    if spec.model_type not in LLAMA_FAMILY:
        raise UnsupportedModelError(f"unsupported architecture {spec.architecture!r}")
    with torch.device("meta"):
        model = LlamaForCausalLM(spec, backend, dtype)
    model = model.to_empty(device=device)
    model.tie_weights()
    # Buffers are not weights: rebuild the rope table on the real device.
    model.cos_sin.copy_(cos_sin_table(spec.rope, spec.head_dim, spec.max_position_embeddings))
    model.load_weights(iter_safetensors(Path(model_dir)))
    return model.eval()
