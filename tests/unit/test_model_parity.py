"""Our model definitions against transformers, token for token, on tiny random checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from common.contract.model_spec import UnsupportedModelError, load_spec
from common.contract.sampling import SamplingParams
from common.engine.engine import Engine
from tests.factories import (
    TINY_MOE,
    hf_greedy,
    make_tiny_checkpoint,
    random_prompts,
    tiny_engine,
)

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa": ("llama", {}),
    "llama-mha-tied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama-mqa": ("llama", dict(num_key_value_heads=1)),
    "tinyllama-shape": (
        "llama",
        dict(num_attention_heads=8, num_key_value_heads=1, hidden_size=128),
    ),
    "llama-rope-llama3": (
        "llama",
        dict(
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "llama-rope-linear": ("llama", dict(rope_scaling=dict(rope_type="linear", factor=4.0))),
    "mistral-window": ("mistral", dict(sliding_window=24, head_dim=16)),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-qknorm": ("qwen3", dict(head_dim=32)),
    # Mixture of experts (common/models/moe.py).
    "mixtral-8e-top2": TINY_MOE["mixtral"],
    # norm_topk_prob false (the Qwen2-MoE default) with the gated shared expert.
    "qwen2-moe-shared": TINY_MOE["qwen2_moe"],
    # Dense layers among sparse ones: mlp_only_layers and decoder_sparse_step; top-1.
    "qwen2-moe-dense-layers": (
        "qwen2_moe",
        dict(
            num_hidden_layers=3,
            num_experts=4,
            num_experts_per_tok=1,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=True,
            mlp_only_layers=[0],
            decoder_sparse_step=1,
        ),
    ),
    "qwen3-moe-norm-topk": TINY_MOE["qwen3_moe"],
    "qwen3-moe-sparse-step": (
        "qwen3_moe",
        dict(
            num_experts=4,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            head_dim=32,
            norm_topk_prob=False,
            decoder_sparse_step=2,
        ),
    ),
}

PROMPT_LENGTHS = [1, 7, 16, 33, 70]
NEW_TOKENS = 24


def _greedy_with_logits(engine: Engine, prompts: list[list[int]], max_tokens: int):
    recorded: dict[str, list[torch.Tensor]] = {}
    sampler = engine.sampler

    def recording_sampler(logits: torch.Tensor, requests: list) -> Any:
        for row, req in zip(logits, requests, strict=True):
            recorded.setdefault(req.request_id, []).append(row.clone())
        return sampler(logits, requests)

    engine.sampler = recording_sampler  # type: ignore[assignment]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
    return [outputs[f"r{i}"] for i in range(len(prompts))], [
        torch.stack(recorded[f"r{i}"]) for i in range(len(prompts))
    ]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_transformers(family: str, tmp_path: Path) -> None:
    model_type, overrides = FAMILIES[family]
    ckpt = make_tiny_checkpoint(tmp_path / family, model_type, **overrides)
    prompts = random_prompts(384, PROMPT_LENGTHS)
    expected, expected_logits = hf_greedy(ckpt, prompts, NEW_TOKENS)

    # A small token budget forces chunked prefill mixed with decodes.
    engine = tiny_engine(ckpt, max_num_batched_tokens=40)
    got, got_logits = _greedy_with_logits(engine, prompts, NEW_TOKENS)

    max_diff = max(
        (a - b).abs().max().item() for a, b in zip(got_logits, expected_logits, strict=True)
    )
    print(f"{family}: max |logit diff| vs transformers = {max_diff:.3e}")
    assert got == expected
    assert max_diff < 1e-3
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_bfloat16_runs_close_to_transformers(tmp_path: Path) -> None:
    ckpt = make_tiny_checkpoint(tmp_path / "bf16", "llama")
    prompts = random_prompts(384, [9, 40])
    _, expected_logits = hf_greedy(ckpt, prompts, 1, dtype=torch.bfloat16)
    engine = tiny_engine(ckpt, dtype="bfloat16")
    _, got_logits = _greedy_with_logits(engine, prompts, 1)
    assert engine.runner.kv_cache.dtype == torch.bfloat16
    for got, want in zip(got_logits, expected_logits, strict=True):
        # First-token logits from identical bf16 weights: bf16 rounding, not a wrong model.
        assert (got - want).abs().max().item() < 0.1
        assert got.argmax() == want.argmax()


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    ckpt = make_tiny_checkpoint(tmp_path / "gpt2", "gpt2", n_layer=1, n_embd=32, n_head=2)
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_spec(ckpt)
