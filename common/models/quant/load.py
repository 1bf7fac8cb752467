"""Putting quantized layers into a model: quantize a loaded float model, or load a GGUF.

Which layers: every decoder projection (``qkv_proj``, ``o_proj``, ``gate_up_proj``,
``down_proj``, shared experts included), the MoE experts and the output head. The MoE router
(``mlp.gate``), the shared-expert gate, norms and untied embeddings stay float.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from common.models.layers import ShardedLinear
from common.models.llama import LlamaForCausalLM
from common.models.moe import Experts
from common.models.quant.compressed import CtCheckpoint
from common.models.quant.formats import WeightFormat
from common.models.quant.fp8 import Fp8Weight
from common.models.quant.gguf import GgufCheckpoint
from common.models.quant.gptq import GptqAwqCheckpoint
from common.models.quant.half import HALF_DTYPES, HalfWeight
from common.models.quant.linear import QuantCompute, QuantEmbedding, QuantExperts, QuantLinear
from common.models.quant.weights import Q4Weight, Q8Weight, QuantWeight
from kernels.cpu.kquant import KQx16, same_columns

log = logging.getLogger(__name__)

_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_EMBED, _HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _replace(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def _quantize(weight: torch.Tensor, fmt: WeightFormat) -> QuantWeight:
    if fmt.name == "int4":
        return Q4Weight.quantize(weight, fmt.group_size)
    return Q8Weight.quantize_per_channel(weight)


def quantize_model(model: LlamaForCausalLM, fmt: WeightFormat) -> None:
    """Replaces the float layers of a loaded model by quantized ones (int8 / int4), one
    layer at a time, so that memory peaks at the float model plus one layer."""
    assert fmt.name in ("int8", "int4"), fmt
    for path, module in list(model.named_modules()):
        leaf = path.rpartition(".")[2]
        if isinstance(module, Experts):
            _replace(model, path, QuantExperts(
                _quantize(module.gate_up_proj.data, fmt), _quantize(module.down_proj.data, fmt),
                fmt.compute,
            ))  # fmt: skip
        elif isinstance(module, nn.Linear) and leaf in _PROJECTIONS:
            offsets = module.shard_offsets if isinstance(module, ShardedLinear) else None
            quantized = QuantLinear(
                [_quantize(module.weight.data, fmt)], module.bias, fmt.compute, offsets
            )
            _replace(model, path, quantized)
    head = Q8Weight.quantize_per_channel(model.lm_head.weight.data)
    model.lm_head = QuantLinear([head], None, fmt.compute)  # type: ignore[assignment]
    if model.spec.tie_word_embeddings:
        model.embed_tokens = QuantEmbedding(_table_of(model.lm_head, head))  # type: ignore[assignment]


# What load_gguf_layers reads: a file or directory whose tensors() yields (name, value) by
# Hugging Face name, the value a packed weight or a float tensor.
PackedCheckpoint = GgufCheckpoint | CtCheckpoint | GptqAwqCheckpoint


def load_gguf_layers(
    model: LlamaForCausalLM, checkpoint: PackedCheckpoint, compute: QuantCompute
) -> list[tuple[str, torch.Tensor]]:
    """Puts the file's (or a compressed-tensors checkpoint's) quantized tensors into ``model`` as quantized layers (the model may
    still be on the meta device: nothing float is allocated for them) and returns the float
    tensors, by Hugging Face name, for ``model.load_weights``."""
    floats: list[tuple[str, torch.Tensor]] = []
    quantized: dict[str, dict[str | None, QuantWeight]] = {}  # module path -> shard -> weight
    biases: dict[str, dict[str | None, torch.Tensor]] = {}
    embed: QuantWeight | None = None
    head: QuantWeight | None = None
    # A checkpoint's (not a GGUF file's) bfloat16 / float16 head stays at 2 bytes a weight.
    half_head = not isinstance(checkpoint, GgufCheckpoint)
    for tensor in checkpoint.tensors():
        value = tensor.value
        if (
            half_head
            and isinstance(value, torch.Tensor)
            and value.dtype in HALF_DTYPES
            and (tensor.name == _HEAD or (tensor.name == _EMBED and model.spec.tie_word_embeddings))
        ):
            value = HalfWeight.of(value)
        if tensor.name == _EMBED and not isinstance(value, torch.Tensor):
            embed = value
            continue
        if tensor.name == _HEAD and not isinstance(value, torch.Tensor):
            head = value
            continue
        target = model._target(tensor.name)
        if target is None:
            raise ValueError(f"{checkpoint.path.name}: unexpected tensor {tensor.name!r}")
        module_path, shard, param = target
        if isinstance(tensor.value, torch.Tensor):
            if param == "bias":
                biases.setdefault(module_path, {})[shard] = tensor.value
            floats.append((tensor.name, tensor.value))
            continue
        if param != "weight":
            raise ValueError(f"{checkpoint.path.name}: quantized {param} {tensor.name!r}")
        quantized.setdefault(module_path, {})[shard] = tensor.value
    for module_path, shards in quantized.items():
        module = model.get_submodule(module_path)
        if isinstance(module, Experts):
            _replace(model, module_path, _experts(checkpoint, module_path, module, shards, compute))
            continue
        if not isinstance(module, nn.Linear) or module_path.rpartition(".")[2] not in _PROJECTIONS:
            raise ValueError(f"{checkpoint.path.name}: {module_path} cannot be quantized here")
        order: list[str | None] = (
            list(module.shard_offsets) if isinstance(module, ShardedLinear) else [None]
        )
        missing = [s for s in order if s not in shards]
        if missing:
            raise ValueError(f"{checkpoint.path.name}: {module_path} lacks {missing}")
        parts = _fuse([shards[s] for s in order])
        bias = None
        if module.bias is not None:
            pieces = biases.get(module_path, {})
            if any(s not in pieces for s in order):
                raise ValueError(f"{checkpoint.path.name}: {module_path} lacks its bias")
            bias = torch.cat([pieces[s] for s in order])
        offsets = module.shard_offsets if isinstance(module, ShardedLinear) else None
        _replace(model, module_path, QuantLinear(parts, bias, compute, offsets))
    # Biases of the replaced layers went into them; the float loader must not see them.
    floats = [(n, t) for n, t in floats if _module_of(model, n) not in quantized]
    if embed is not None and model.spec.tie_word_embeddings and head is None:
        head = embed
    if head is not None:
        model.lm_head = QuantLinear([head], None, compute)  # type: ignore[assignment]
    if embed is not None:
        table = _table_of(model.lm_head, embed) if head is embed else embed
        model.embed_tokens = QuantEmbedding(table)  # type: ignore[assignment]
    return floats


def _experts(
    checkpoint: PackedCheckpoint,
    module_path: str,
    module: Experts,
    shards: dict[str | None, QuantWeight],
    compute: QuantCompute,
) -> QuantExperts:
    """The quantized experts of one MoE layer from each expert's gate, up and down weights
    (every one of them quantized: a layer whose experts are partly float is refused)."""
    missing = [s for s in module.expected_shards("gate_up_proj") + module.expected_shards("down_proj")
               if s not in shards]  # fmt: skip
    if missing:
        raise ValueError(
            f"{checkpoint.path.name}: {module_path} lacks quantized weights for {missing[:4]}"
            f"{' ...' if len(missing) > 4 else ''} (its experts must all be quantized, or none)"
        )
    size, hidden = module.intermediate, module.gate_up_proj.shape[2]
    gate_up, down = [], []
    for e in range(module.num_experts):
        gate, up, out = shards[f"gate:{e}"], shards[f"up:{e}"], shards[f"down:{e}"]
        for what, weight, shape in (("gate", gate, (size, hidden)), ("up", up, (size, hidden)),
                                    ("down", out, (hidden, size))):  # fmt: skip
            if tuple(weight.shape) != shape:
                raise ValueError(
                    f"{checkpoint.path.name}: {module_path}.{e}.{what} has shape "
                    f"{tuple(weight.shape)}; the config says {shape}"
                )
        gate_up.append(_fuse([gate, up]))
        down.append([out])
    return QuantExperts.of_parts(gate_up, down, compute)


def _table_of(head: nn.Module, table: QuantWeight) -> QuantWeight:
    """A tied table as the head holds it (in its kernel's layout), so it is held once."""
    assert isinstance(head, QuantLinear), type(head)
    held = head.parts[0].weight
    return table if held is None else held


def _module_of(model: LlamaForCausalLM, name: str) -> str | None:
    target = model._target(name)
    return None if target is None else target[0]


def dequantized_tensors(checkpoint: PackedCheckpoint) -> Iterable[tuple[str, torch.Tensor]]:
    """Every tensor of the file as float32, by Hugging Face name (``--quantization none``)."""
    for tensor in checkpoint.tensors():
        value = tensor.value
        yield tensor.name, value if isinstance(value, torch.Tensor) else value.dequantize()


def _fuse(parts: list[QuantWeight]) -> list[QuantWeight]:
    """One packed weight when the parts share a kind and group size, else the parts."""
    kinds = {(type(p), p.group_size) for p in parts}
    if len(parts) == 1 or len(kinds) > 1:
        return parts
    first = parts[0]
    if isinstance(first, KQx16):
        same = [
            p for p in parts
            if isinstance(p, KQx16) and p.type_name == first.type_name
            and p.int8_tokens == first.int8_tokens and same_columns(first, p)
        ]  # fmt: skip
        return [KQx16.cat(same)] if len(same) == len(parts) else parts
    if isinstance(first, Fp8Weight):
        fp8 = [p for p in parts if isinstance(p, Fp8Weight) and first.fusable_with(p)]
        return [Fp8Weight.cat(fp8)] if len(fp8) == len(parts) else parts
    if isinstance(parts[0], Q4Weight):
        return [Q4Weight.cat([p for p in parts if isinstance(p, Q4Weight)])]
    return [Q8Weight.cat([p for p in parts if isinstance(p, Q8Weight)])]


def matmul_layouts(model: nn.Module) -> dict[str, int]:
    """How many of the model's packed matmuls hold each layout (rows, x16) or torch's."""
    counts: dict[str, int] = {}
    for module in model.modules():
        matmuls = []
        if isinstance(module, QuantLinear):
            matmuls = module.parts
        elif isinstance(module, QuantExperts):
            matmuls = module.matmuls
        for matmul in matmuls:
            layout = "torch" if matmul.weight is None else matmul.weight.layout
            counts[layout] = counts.get(layout, 0) + 1
    return counts


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as held: packed layers at their packed size."""
    # Keyed by the tensors themselves (kept alive here, so ids cannot be reused): a tied head
    # and embedding share one table, counted once.
    held: dict[int, tuple[torch.Tensor, int]] = {}
    for module in model.modules():
        matmuls = []
        if isinstance(module, QuantLinear):
            matmuls = module.parts
            if module.bias is not None:
                held[id(module.bias)] = (module.bias, module.bias.numel() * 4)
        elif isinstance(module, QuantExperts):
            matmuls = module.matmuls
        elif isinstance(module, QuantEmbedding):
            held[id(module.table.qweight)] = (module.table.qweight, module.table.num_bytes)
        for matmul in matmuls:
            held[id(matmul.storage)] = (matmul.storage, matmul.num_bytes)
    total = sum(num_bytes for _, num_bytes in held.values())
    total += sum(p.numel() * p.element_size() for p in model.parameters())
    return total
