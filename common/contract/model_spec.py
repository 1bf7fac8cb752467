"""ModelSpec: the architecture parameters the engine needs, read once from a HF config."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture (or one of its options) is not implemented here."""


# model_type -> the family module that implements it: common/models/llama.py for the dense
# llama family, common/models/moe.py for the mixture-of-experts models built on it.
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
MOE_FAMILY = ("mixtral", "qwen2_moe", "qwen3_moe")
SUPPORTED_MODEL_TYPES = LLAMA_FAMILY + MOE_FAMILY


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class MoeSpec:
    """The sparse MLP of a mixture-of-experts model.

    Routing: softmax over the router logits (float32), the top ``top_k`` experts, their
    probabilities renormalised to sum to 1 when ``norm_topk_prob`` (Mixtral always, Qwen
    MoE per config). Layers not in ``layers`` keep a dense MLP of ``intermediate_size``.
    """

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    layers: tuple[int, ...]  # the decoder layers whose MLP is sparse, ascending
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: one always-on expert, sigmoid-gated
    # Mixtral scales expert outputs by float32 routing weights; Qwen MoE casts them to the
    # model dtype first (the same thing in float32, not in bfloat16).
    float32_routing_weights: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise UnsupportedModelError(
                f"num_experts_per_tok ({self.top_k}) must be in [1, num_experts={self.num_experts}]"
            )


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeSpec
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    moe: MoeSpec | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def is_moe(self) -> bool:
        return self.moe is not None


def _rope_from_config(config: Any) -> RopeSpec:
    # transformers >= 5 folds rope_theta and rope_scaling into rope_parameters.
    params = getattr(config, "rope_parameters", None)
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ("default", "linear", "llama3"):
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported (supported: default, linear, llama3)"
        )
    return RopeSpec(
        theta=float(params.get("rope_theta", 10000.0)),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _moe_from_config(config: Any, model_type: str) -> MoeSpec | None:
    if model_type not in MOE_FAMILY:
        return None
    num_layers = int(config.num_hidden_layers)
    if model_type == "mixtral":
        num_experts = int(getattr(config, "num_local_experts", None) or config.num_experts)
        return MoeSpec(
            num_experts=num_experts,
            top_k=int(config.num_experts_per_tok),
            expert_intermediate_size=int(config.intermediate_size),
            norm_topk_prob=True,  # softmax over the top-k logits
            layers=tuple(range(num_layers)),
            float32_routing_weights=True,
        )
    # qwen2_moe, qwen3_moe: decoder_sparse_step and mlp_only_layers pick the sparse layers.
    num_experts = int(getattr(config, "num_experts", 0) or 0)
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    layers = tuple(
        i for i in range(num_layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0
    )
    return MoeSpec(
        num_experts=max(num_experts, 1),
        top_k=int(config.num_experts_per_tok) if num_experts else 1,
        expert_intermediate_size=int(config.moe_intermediate_size),
        norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)),
        layers=layers,
        shared_expert_intermediate_size=(
            int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
            if model_type == "qwen2_moe"
            else 0
        ),
    )


def _unsupported(architecture: str, model_type: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"unsupported architecture {architecture!r} (model_type {model_type!r}); "
        f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
    )


def spec_from_config(config: Any) -> ModelSpec:
    model_type = getattr(config, "model_type", "?")
    architectures = getattr(config, "architectures", None) or [f"{model_type}ForCausalLM"]
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise _unsupported(architectures[0], model_type)
    hidden_act = getattr(config, "hidden_act", "silu")
    if hidden_act != "silu":
        raise UnsupportedModelError(f"hidden_act {hidden_act!r} is not supported (only silu)")
    num_heads = int(config.num_attention_heads)
    num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    sliding_window = getattr(config, "sliding_window", None)
    qwen = model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
    if qwen and not getattr(config, "use_sliding_window", False):
        sliding_window = None
    if sliding_window and qwen:
        raise UnsupportedModelError(
            f"{model_type} with use_sliding_window=True (per-layer windows) is not supported"
        )
    return ModelSpec(
        model_type=model_type,
        architecture=architectures[0],
        vocab_size=int(config.vocab_size),
        hidden_size=int(config.hidden_size),
        intermediate_size=int(config.intermediate_size),
        num_layers=int(config.num_hidden_layers),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=int(head_dim),
        rms_norm_eps=float(config.rms_norm_eps),
        max_position_embeddings=int(config.max_position_embeddings),
        rope=_rope_from_config(config),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2"
        or (model_type == "qwen2_moe" and bool(getattr(config, "qkv_bias", True)))
        or bool(getattr(config, "attention_bias", False)),
        o_bias=bool(getattr(config, "attention_bias", False)),
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        sliding_window=int(sliding_window) if sliding_window else None,
        bos_token_id=getattr(config, "bos_token_id", None),
        eos_token_ids=_eos_ids(getattr(config, "eos_token_id", None)),
        moe=_moe_from_config(config, model_type),
    )


def load_spec(model_dir: str | Path) -> ModelSpec:
    """Reads ``config.json`` through ``transformers.AutoConfig`` (no modeling code)."""
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json: not a checkpoint directory")
    raw = json.loads((model_dir / "config.json").read_text())
    model_type = raw.get("model_type", "?")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise _unsupported((raw.get("architectures") or [model_type])[0], model_type)
    return spec_from_config(AutoConfig.from_pretrained(model_dir))
