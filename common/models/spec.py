"""ModelSpec: the architecture parameters the engine needs, read once from a HF config."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture (or one of its options) is not implemented here."""


# model_type -> the family module that implements it.
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads


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


def spec_from_config(config: Any) -> ModelSpec:
    model_type = getattr(config, "model_type", "?")
    architectures = getattr(config, "architectures", None) or [f"{model_type}ForCausalLM"]
    if model_type not in LLAMA_FAMILY:
        raise UnsupportedModelError(
            f"unsupported architecture {architectures[0]!r} (model_type {model_type!r}); "
            f"supported model types: {', '.join(LLAMA_FAMILY)}"
        )
    num_heads = int(config.num_attention_heads)
    num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    sliding_window = getattr(config, "sliding_window", None)
    if model_type in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
        sliding_window = None
    if sliding_window is not None and model_type in ("qwen2", "qwen3"):
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
        qkv_bias=model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
        o_bias=bool(getattr(config, "attention_bias", False)),
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        sliding_window=int(sliding_window) if sliding_window else None,
        bos_token_id=getattr(config, "bos_token_id", None),
        eos_token_ids=_eos_ids(getattr(config, "eos_token_id", None)),
    )


def load_spec(model_dir: str | Path) -> ModelSpec:
    """Reads ``config.json`` through ``transformers.AutoConfig`` (no modeling code)."""
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json: not a checkpoint directory")
    raw = json.loads((model_dir / "config.json").read_text())
    model_type = raw.get("model_type", "?")
    if model_type not in LLAMA_FAMILY:
        arch = (raw.get("architectures") or [model_type])[0]
        raise UnsupportedModelError(
            f"unsupported architecture {arch!r} (model_type {model_type!r}); "
            f"supported model types: {', '.join(LLAMA_FAMILY)}"
        )
    return spec_from_config(AutoConfig.from_pretrained(model_dir))
