"""The tiny K-quant files (tests/data/kquants/, made by llama.cpp's llama-quantize) served by
the engine from their packed blocks (KQx16) against transformers' greedy generate on the
same file (transformers dequantizes it with the gguf package: the same float weights).

The engine rounds activations to int16 codes (one step per row) where transformers
multiplies in float32, so its greedy tokens may part from transformers' only at a near-tie
of transformers' own logits; every prompt must agree up to there and most prompts entirely.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.contract.sampling import SamplingParams
from common.engine.config import EngineConfig
from common.engine.llm import LLM
from common.models.default_model import resolve_model
from common.models.quant.linear import QuantExperts
from kernels.cpu import available
from kernels.cpu.kquant import kq_available
from loadtest.baselines.greedy_reference import NEW_TOKENS, greedy_reference
from tests.quant_parity import assert_parts_only_at_near_ties

FILES = Path(__file__).resolve().parents[1] / "data" / "kquants"
PRESETS = ["Q2_K", "Q3_K_M", "Q4_K_S", "Q4_K_M", "Q5_K_M", "Q6_K", "Q5_0", "Q5_1"]
# Every preset of llama; one mix of qwen2 (q/k/v biases), qwen3 (q/k norms) and the qwen3moe
# MoE model (its experts read from 3-D tensors), and that model in Q4_0.
FILES_SERVED = [("llama", p) for p in PRESETS] + [
    ("qwen2", "Q4_K_M"),
    ("qwen3", "Q4_K_M"),
    ("qwen3moe", "Q4_K_M"),
    ("qwen3moe", "Q4_0"),
]
PROMPTS = [[5, 77, 300], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], list(range(40, 140)), [901] * 7]
NEAR_TIE = 0.02  # of logits spanning about 1 (a random model): 20x the largest error seen

pytestmark = pytest.mark.skipif(
    not available() or not kq_available(),
    reason="the K-quant kernel needs AVX2 or AVX-512 VNNI",
)


def transformers_greedy(path: Path) -> tuple[list[list[int]], list[torch.Tensor]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    # The config the engine runs, which sets what transformers' GGUF reader leaves at its
    # defaults (Qwen3-MoE's expert size and normalized top-k: common/models/gguf_dir.py).
    config = AutoConfig.from_pretrained(resolve_model(str(path)))
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, config=config
    ).eval()
    tokens, logits, _ = greedy_reference(model, PROMPTS, draws=0)
    return tokens, logits


@pytest.mark.parametrize(("arch", "preset"), FILES_SERVED)
def test_greedy_tokens_match_transformers_on_the_same_file(arch: str, preset: str) -> None:
    path = FILES / f"tiny-{arch}-{preset}.gguf"
    llm = LLM(EngineConfig(model=resolve_model(str(path)), device="cpu", quantization="gguf",
                           kv_cache_memory="64MiB"))  # fmt: skip
    # Its own KV identity (a block computed under one format is never reused under another),
    # and its layers on the packed blocks, not float.
    assert llm.engine.weight_identity == f"gguf-MOSTLY_{preset}/a16"
    model = llm.engine.runner.model
    formats = {getattr(m, "format", "") for m in model.modules()}
    packed = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q5_0", "q5_1", "q4/")
    assert any(f.startswith(packed) for f in formats), formats
    if arch == "qwen3moe":
        experts = [m for m in model.modules() if isinstance(m, QuantExperts)]
        assert len(experts) == 2 and all(e.num_experts == 4 for e in experts)
        assert all(e.format.startswith(packed) for e in experts), [e.format for e in experts]
        # As llama.cpp runs the file (transformers' GGUF reader would leave its defaults:
        # experts of 768 and unnormalized top-k weights).
        moe = model.spec.moe
        assert moe is not None and moe.norm_topk_prob and moe.expert_intermediate_size == 256
    expected, logits = transformers_greedy(path)
    completions = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert_parts_only_at_near_ties(
        f"{arch}-{preset}", [c.token_ids for c in completions], expected, logits, NEAR_TIE
    )
