"""Small factories the tests share: tiny random checkpoints, engines, HF references."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from common.contract.sampling import SamplingParams
from common.engine.config import EngineConfig
from common.engine.engine import Engine

# Tiny shapes per family; initializer_range is large so logits are far from ties.
TINY_BASE: dict[str, Any] = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.2,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


# Tiny mixture-of-experts configs (hidden 64, 2 layers, 4-8 experts) per family.
TINY_MOE: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": (
        "qwen2_moe",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
        ),
    ),
    "qwen3_moe": (
        "qwen3_moe",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            head_dim=32,
            norm_topk_prob=True,
        ),
    ),
}


def make_tiny_moe_checkpoint(path: Path, family: str, seed: int = 0, **overrides: Any) -> Path:
    model_type, base = TINY_MOE[family]
    return make_tiny_checkpoint(path, model_type, seed=seed, **{**base, **overrides})


def make_tiny_checkpoint(
    path: Path, model_type: str = "llama", seed: int = 0, **overrides: Any
) -> Path:
    """Builds a random checkpoint with transformers and saves it as safetensors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {**TINY_BASE, **overrides}
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_greedy(
    model_dir: Path | str,
    prompts: list[list[int]],
    max_new_tokens: int,
    dtype: torch.dtype = torch.float32,
    ignore_eos: bool = True,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """transformers' greedy generate, one prompt at a time: (new tokens, per-step logits)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    if ignore_eos:
        model.generation_config.eos_token_id = None
    tokens, logits = [], []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            tokens.append(out.sequences[0, len(prompt) :].tolist())
            logits.append(torch.stack([step[0] for step in out.logits]).float())
    return tokens, logits


def tiny_engine(model_dir: Path | str, **overrides: Any) -> Engine:
    params: dict[str, Any] = dict(num_kv_blocks=256, block_size=16, device="cpu", dtype="float32")
    params.update(overrides)
    return Engine(EngineConfig(model=str(model_dir), **params))


def next_logits(engine: Engine, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The logits [V'] that a request resumed after ``output`` samples its next token from."""
    rows: list[torch.Tensor] = []
    sampler = engine.sampler

    def recording(batch: torch.Tensor, requests: list) -> Any:
        rows.append(batch[0].clone())
        return sampler(batch, requests)

    engine.sampler = recording  # type: ignore[assignment]
    try:
        sampling = SamplingParams(max_tokens=len(output) + 1, ignore_eos=True)
        engine.add_request("next-logits", prompt, sampling, output_token_ids=output)
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.sampler = sampler
    return rows[0]


def run_to_completion(
    engine: Engine, prompts: dict[str, list[int]], sampling: SamplingParams, **add_kwargs: Any
) -> dict[str, list[int]]:
    """Adds every prompt, steps until all finish, returns generated ids per request id."""
    outputs: dict[str, list[int]] = {rid: [] for rid in prompts}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, sampling, **add_kwargs)
    pending = set(prompts)
    while pending:
        for out in engine.step():
            if out.request_id not in outputs:
                continue  # a request the caller added itself
            outputs[out.request_id] += out.new_token_ids
            if out.finished:
                pending.discard(out.request_id)
    return outputs


def random_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]
