"""The llama family: llama (SmolLM2, TinyLlama), mistral, qwen2 (qkv bias), qwen3 (q/k norm).

Shapes: T = tokens in the step (all sequences packed), H = hidden size, Hq/Hkv = query/kv
heads, D = head dim, I = intermediate size, V = vocab, L = layers, N = blocks, S = block size.
The model sees a flat batch; which token belongs to which sequence, and where its K/V live,
is the attention metadata's business.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from common.contract.model_spec import ModelSpec
from common.engine.attention import AttentionBackend, LayerKV
from common.models.layers import RMSNorm, ShardedLinear, ShardedParams, silu_and_mul
from common.models.rope import cos_sin_table

if TYPE_CHECKING:
    from common.engine.compression import QueryTap
    from common.models.moe import ExpertLoadRecorder
    from common.models.quant.fused_decode import FusedDecoder


class Attention(nn.Module):
    # SnapKV (common/engine/compression.py): copies chosen rows' queries, while set.
    query_tap: QueryTap | None = None

    def __init__(self, spec: ModelSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.scale = spec.head_dim**-0.5
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.qkv_proj = ShardedLinear(
            spec.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, spec.qkv_bias, dtype
        )
        self.o_proj = nn.Linear(q_size, spec.hidden_size, bias=spec.o_bias, dtype=dtype)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype) if spec.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        positions: torch.Tensor,  # [T]
        cos_sin: torch.Tensor,  # [P, D] the rotary table
        kv: LayerKV,
        backend: AttentionBackend,
        metadata: Any,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q = qkv[:, :q_size].view(num_tokens, self.num_heads, self.head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q, backend), self.k_norm(k, backend)
        q, k = backend.rotary(q, k, positions, cos_sin)
        if self.query_tap is not None:
            self.query_tap.record(q)
        out = backend.forward(q, k, v.contiguous(), kv, metadata, self.scale)
        return self.o_proj(out.reshape(num_tokens, q_size))


class MLP(nn.Module):
    def __init__(
        self, spec: ModelSpec, dtype: torch.dtype, intermediate_size: int | None = None
    ) -> None:
        super().__init__()
        size = intermediate_size or spec.intermediate_size
        self.gate_up_proj = ShardedLinear(
            spec.hidden_size, {"gate": size, "up": size}, spec.mlp_bias, dtype
        )
        self.down_proj = nn.Linear(size, spec.hidden_size, bias=spec.mlp_bias, dtype=dtype)
        self.intermediate_size = size

    def forward(self, x: torch.Tensor, ops: AttentionBackend | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        if ops is not None:
            return self.down_proj(ops.silu_and_mul(gate_up))
        return self.down_proj(silu_and_mul(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, mlp: nn.Module | None = None) -> None:
        """``mlp`` maps [T, H] -> [T, H]; default the dense MLP (MoE models pass theirs)."""
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.self_attn = Attention(spec, dtype)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.mlp = mlp if mlp is not None else MLP(spec, dtype)

    def forward(
        self,
        h: torch.Tensor,  # [T, H] the previous layer's output (the embeddings for layer 0)
        residual: torch.Tensor | None,  # [T, H] the residual stream before h is added to it
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv: LayerKV,
        backend: AttentionBackend,
        metadata: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp output, residual stream); their sum is this layer's hidden state."""
        if residual is None:
            residual = h
            x = self.input_layernorm(h, backend)
        else:
            x, residual = self.input_layernorm.forward_add(h, residual, backend)
        attn = self.self_attn(x, positions, cos_sin, kv, backend, metadata)
        x, residual = self.post_attention_layernorm.forward_add(attn, residual, backend)
        return self.mlp(x, backend), residual


# HF weight name -> (our module path, shard or None, param). One regex per family of names.
_LAYER_WEIGHT = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)_proj\.(weight|bias)")
_SHARDS = {("self_attn", "q"): "qkv", ("self_attn", "k"): "qkv", ("self_attn", "v"): "qkv",
           ("mlp", "gate"): "gate_up", ("mlp", "up"): "gate_up"}  # fmt: skip
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


class LlamaForCausalLM(nn.Module):
    # Tokens routed per expert, for MoE models (common/models/moe.py); None for dense ones.
    expert_load: ExpertLoadRecorder | None = None
    # Decode-only steps in one C++ call (common/models/quant/fused_decode.py), when set.
    fused_decoder: FusedDecoder | None = None
    query_tap: QueryTap | None = None

    def __init__(self, spec: ModelSpec, backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.spec = spec
        self.backend = backend
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(self.make_layer(i, dtype) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False, dtype=dtype)
        self.lm_head.weight.requires_grad_(False)
        self.tie_weights()
        table = cos_sin_table(spec.rope, spec.head_dim, spec.max_position_embeddings)
        self.cos_sin: torch.Tensor
        self.register_buffer("cos_sin", table, persistent=False)  # [P, D] float32

    def make_layer(self, index: int, dtype: torch.dtype) -> DecoderLayer:
        return DecoderLayer(self.spec, dtype)

    def set_query_tap(self, tap: QueryTap | None) -> None:
        """Every layer's queries go to ``tap`` (layer order) until it is set to None; while
        set, decode-only steps take the Python path, whose queries it sees."""
        self.query_tap = tap
        for module in self.modules():
            if isinstance(module, Attention):
                module.query_tap = tap

    def init_buffers(self, device: torch.device) -> None:
        """Rebuilds what is not a weight on the real device (after ``to_empty``)."""
        table = cos_sin_table(self.spec.rope, self.spec.head_dim, self.spec.max_position_embeddings)
        self.cos_sin.copy_(table)

    def tie_weights(self) -> None:
        """Shares the embedding with the output head; call again after moving devices."""
        quantized = not isinstance(self.lm_head, nn.Linear)  # quantized layers tie themselves
        if self.spec.tie_word_embeddings and not quantized:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv: Sequence[LayerKV],  # one per layer
        metadata: Any,
    ) -> torch.Tensor:  # [T, H] final-normed hidden states
        fused = self.fused_decoder
        if fused is not None and self.query_tap is None and fused.applies(metadata):
            return fused(input_ids, positions, metadata)
        h = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer, layer_kv in zip(self.layers, kv, strict=True):
            h, residual = layer(
                h, residual, positions, self.cos_sin, layer_kv, self.backend, metadata
            )
        assert residual is not None, "a model has at least one layer"
        return self.norm.forward_add(h, residual, self.backend)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # [n, V]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads HF-named tensors; raises on an unexpected name or a missing tensor."""
        params = dict(self.named_parameters())
        expected = set(params)
        loaded: set[str] = set()
        for name, tensor in weights:
            if _IGNORED.match(name):
                continue
            if name == "lm_head.weight" and self.spec.tie_word_embeddings:
                continue
            target = self._target(name)
            if target is None:
                raise ValueError(f"unexpected weight {name!r} for {self.spec.architecture}")
            module_path, shard, param_name = target
            if shard is not None:
                module = self.get_submodule(module_path)
                assert isinstance(module, ShardedParams), module_path
                for attr, covered in module.load_shard(shard, param_name, tensor):
                    loaded.add(f"{module_path}.{attr}#{covered}")
                continue
            full = f"{module_path}.{param_name}"
            if full not in params:
                raise ValueError(f"unexpected weight {name!r} for {self.spec.architecture}")
            if params[full].shape != tensor.shape:
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)} does not match the "
                    f"config's {tuple(params[full].shape)}"
                )
            params[full].data.copy_(tensor)
            loaded.add(full)
        missing = []
        for full in sorted(expected):
            module_path, _, param_name = full.rpartition(".")
            module = self.get_submodule(module_path)
            if isinstance(module, ShardedParams):
                missing += [
                    f"{module_path}.{param_name}#{shard}"
                    for shard in module.expected_shards(param_name)
                    if f"{module_path}.{param_name}#{shard}" not in loaded
                ]
            elif full not in loaded and not (
                full == "lm_head.weight" and self.spec.tie_word_embeddings
            ):
                missing.append(full)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}")

    def _target(self, name: str) -> tuple[str, str | None, str] | None:
        """HF name -> (our module path, shard or None, param name); None if unknown."""
        match = _LAYER_WEIGHT.fullmatch(name)
        if match:
            layer, block, proj, param = match.groups()
            fused = _SHARDS.get((block, proj))
            if fused is not None:
                return f"layers.{layer}.{block}.{fused}_proj", proj, param
            return f"layers.{layer}.{block}.{proj}_proj", None, param
        if name.startswith("model."):
            module_path, _, param = name[len("model.") :].rpartition(".")
            return module_path, None, param
        if name == "lm_head.weight":
            return "lm_head", None, "weight"
        return None
