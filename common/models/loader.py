"""Builds our model for a checkpoint directory: config via AutoConfig, weights from
safetensors or a GGUF file, in the weight format the engine chose (common/models/quant/)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from common.contract.model_spec import (
    LLAMA_FAMILY,
    MOE_FAMILY,
    ModelSpec,
    UnsupportedModelError,
)
from common.engine.attention import AttentionBackend
from common.models.llama import LlamaForCausalLM
from common.models.moe import MoeForCausalLM
from common.models.quant.formats import WeightFormat

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
    weights: WeightFormat | None = None,
) -> CausalLM:
    """The model with its weights loaded in ``weights``' format (default: float).

    Float weights come from the directory's safetensors (a compressed-tensors, GPTQ or AWQ
    checkpoint's dequantized), else from its GGUF file, dequantized; int8 / int4 quantize them layer by layer after loading; gguf reads the
    file's packed tensors (compressed-tensors: the checkpoint's) into quantized layers while
    the model is still on the meta device, so no float copy of them is ever made."""
    from common.models.quant.compressed import CtCheckpoint, is_compressed_tensors
    from common.models.quant.gguf import find_gguf, open_checkpoint, release_checkpoints
    from common.models.quant.gptq import GptqAwqCheckpoint, gptq_awq_method
    from common.models.quant.load import (
        dequantized_tensors,
        load_gguf_layers,
        quantize_model,
    )

    weights = weights or WeightFormat("none")
    if weights.quantized and device.type != "cpu":
        raise ValueError(
            f"--quantization {weights.name} runs on the CPU only so far; use --quantization "
            "none on CUDA"
        )
    model_class = model_class_for(spec)
    with torch.device("meta"):
        model = model_class(spec, backend, dtype)
    gguf_file = find_gguf(model_dir)
    floats: Iterable[tuple[str, torch.Tensor]]
    if weights.name == "gguf":
        assert gguf_file is not None, f"{model_dir}: the gguf format needs a .gguf file"
        floats = load_gguf_layers(model, open_checkpoint(gguf_file), weights.compute)
    elif weights.name == "compressed-tensors":
        floats = load_gguf_layers(model, CtCheckpoint(model_dir), weights.compute)
    elif weights.name in ("gptq", "awq"):
        floats = load_gguf_layers(model, GptqAwqCheckpoint(model_dir), weights.compute)
    elif is_compressed_tensors(model_dir):
        floats = dequantized_tensors(CtCheckpoint(model_dir))
    elif gptq_awq_method(model_dir) is not None:
        floats = dequantized_tensors(GptqAwqCheckpoint(model_dir))
    elif gguf_file is not None and not any(Path(model_dir).glob("*.safetensors")):
        floats = dequantized_tensors(open_checkpoint(gguf_file))
    else:
        floats = iter_safetensors(Path(model_dir))
    model = model.to_empty(device=device)
    model.tie_weights()
    # Buffers are not weights: rebuild the rope table (and the expert counters) on the device.
    model.init_buffers(device)
    model.load_weights(floats)
    if weights.name in ("int8", "int4"):
        quantize_model(model, weights)
    release_checkpoints()  # the packed tensors were copied out of the file's mapping
    return model.eval()
