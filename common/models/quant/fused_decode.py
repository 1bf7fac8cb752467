"""A decode step in one C++ call: kernels/cpu/decode_model.cpp runs every layer of a dense
llama-family model with quantized projections back to back.

# B = sequences in the step (one new token each), H = hidden size

Why: on a 135M model a decode step's kernels take a few milliseconds, and Python's dispatch
of the ~40 small ops around them per layer (module calls, views, slices, the wrappers) took
about as long again (measured with py-spy over a decode step; issue 13's note). The C++ model calls the same
kernels in the same order as the Python path (common/models/llama.py on the cpp backend), so
its hidden states are bit for bit that path's (tests/kernels/test_fused_decode.py).

It applies to steps whose every sequence decodes one token (prefill chunks take the Python
path) in models whose layers are all dense, with single-part projections on the C++ kernels,
the cpp attention backend and a KV cache its kernels take (float32, float16 or bfloat16; not
int8 / fp8); ``build`` returns None otherwise, and the model keeps the
Python path for every step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from common.engine.attention.base import LayerKV
from common.models.llama import MLP, DecoderLayer, LlamaForCausalLM
from common.models.quant.fp8 import Fp8Weight
from common.models.quant.half import HalfWeight
from common.models.quant.linear import PackedMatmul, QuantLinear
from common.models.quant.weights import Q4Weight
from kernels.cpu.kquant import KQx16, kq_layout

log = logging.getLogger(__name__)

# Fp8Weight.activations -> decode_model.cpp's Fp8Parts.activations
_FP8_ACTIVATIONS = {"none": 0, "token": 1, "tensor": 2}


def _projection(ops: Any, layer: object, act_bits: list[int]) -> Any | None:
    """The C++ projection of a QuantLinear whose parts all run on the C++ kernels (several
    parts, as a K-quant file's q / k / v of different types, are joined), else None."""
    if not isinstance(layer, QuantLinear):
        return None
    if len(layer.parts) == 1:
        return _part(ops, layer.parts[0], act_bits, layer.bias)
    parts = [_part(ops, part, act_bits) for part in layer.parts]
    if any(p is None for p in parts):
        return None
    return ops.joined_projection(parts, layer.bias)


def _part(ops: Any, part: PackedMatmul, act_bits: list[int], bias: Any = None) -> Any | None:
    weight = part.weight
    if part.kernel != "cpp" or weight is None or isinstance(weight, HalfWeight):
        return None  # a half-precision weight is a head, never a layer's
    if isinstance(weight, Fp8Weight):
        act_bits.append(16)  # the FP8 kernel multiplies float32: no activation codes
        return ops.fp8_projection(
            weight.packed, weight.kernel_scale, _FP8_ACTIVATIONS[weight.activations],
            weight.input_scale, weight.shape[0], bias,
        )  # fmt: skip
    if isinstance(weight, KQx16):
        act_bits.append(part.act_bits)  # int16 or int8 codes (int8 tokens: int8 either way)
        _, widths, group, block = kq_layout(weight.type_name)
        hi = weight.planes[1] if len(weight.planes) > 1 else None
        return ops.kq_projection(
            weight.planes[0], hi, widths[0], widths[1] if hi is not None else 0, weight.bias,
            group, block, weight.d, weight.sc, weight.dmin, weight.m, weight.sign,
            weight.shape[0], weight.int8_tokens, weight.perm, bias,
        )  # fmt: skip
    act_bits.append(part.act_bits)
    q4 = isinstance(weight, Q4Weight)
    return ops.projection(
        q4, weight.layout == "x16", weight.qweight, weight.scales,
        weight.mins if isinstance(weight, Q4Weight) else None, weight.group_size,
        weight.shape[0], bias,
    )  # fmt: skip


class FusedDecoder:
    def __init__(self, model: LlamaForCausalLM, decode_model: Any) -> None:
        self.model = model
        self.decode_model = decode_model

    @classmethod
    def build(cls, model: LlamaForCausalLM, layer_kv: Sequence[LayerKV]) -> FusedDecoder | None:
        """The fused decoder of ``model`` with its KV cache views, or None where it does not
        apply (the reason is logged)."""
        from kernels.cpu import load

        ops = load()
        reason = cls._unsupported(model, layer_kv, ops)
        if reason is not None:
            log.info("decode steps take the Python path: %s", reason)
            return None
        spec = model.spec
        act_bits: list[int] = []
        layers: list[tuple[DecoderLayer, list[Any]]] = []
        for layer in model.layers:
            assert isinstance(layer, DecoderLayer) and isinstance(layer.mlp, MLP), layer
            attn, mlp = layer.self_attn, layer.mlp
            projections = [
                _projection(ops, p, act_bits)
                for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            ]
            if any(p is None for p in projections):
                log.info("decode steps take the Python path: a projection is not on the C++ kernels")
                return None
            layers.append((layer, projections))
        if len(set(act_bits)) != 1:
            log.info("decode steps take the Python path: layers differ in activation bits")
            return None
        decode_model = ops.DecodeModel(
            spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.rms_norm_eps,
            spec.head_dim**-0.5, spec.sliding_window or 0, act_bits[0], model.norm.weight,
        )  # fmt: skip
        for (layer, projections), kv in zip(layers, layer_kv, strict=True):
            attn = layer.self_attn
            q_norm, k_norm = attn.q_norm, attn.k_norm
            decode_model.add_layer(
                *projections, layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                q_norm.weight if q_norm is not None else None,
                k_norm.weight if k_norm is not None else None,
                kv.k_cache, kv.v_cache,
            )  # fmt: skip
        log.info("decode steps run fused in C++ (%d layers)", len(layers))
        return cls(model, decode_model)

    @staticmethod
    def _unsupported(model: LlamaForCausalLM, layer_kv: Sequence[LayerKV], ops: Any) -> str | None:
        if model.backend.name != "cpp":
            return f"the {model.backend.name} attention backend"
        if model.expert_load is not None or not all(isinstance(layer.mlp, MLP) for layer in model.layers):
            return "mixture-of-experts layers"
        if any(kv.quantized or not ops.attention_takes(kv.k_cache) for kv in layer_kv):
            return f"a {layer_kv[0].k_cache.dtype} KV cache the C++ attention does not take here"
        if model.norm.weight.dtype != torch.float32:
            return "float weights other than float32"
        return None

    @staticmethod
    def applies(metadata: Any) -> bool:
        """Whether a step (the cpp backend's metadata) has only one-token decodes."""
        batch = metadata.batch
        return batch.num_prefills == 0 and batch.num_decode_tokens > 0

    def __call__(
        self,
        input_ids: torch.Tensor,  # [B]
        positions: torch.Tensor,  # [B] int64
        metadata: Any,
    ) -> torch.Tensor:  # [B, H] final-normed hidden states
        batch = metadata.batch
        hidden: torch.Tensor = self.decode_model.forward(
            self.model.embed_tokens(input_ids).contiguous(), positions, self.model.cos_sin,
            batch.slot_mapping, batch.decode_block_tables, batch.decode_seq_lens,
        )  # fmt: skip
        return hidden
