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
from kernels.cpu import available
from kernels.cpu import quant as cpu_quant

FILES = Path(__file__).resolve().parents[1] / "data" / "kquants"
PRESETS = ["Q2_K", "Q3_K_M", "Q4_K_S", "Q4_K_M", "Q5_K_M", "Q6_K", "Q5_0", "Q5_1"]
PROMPTS = [[5, 77, 300], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], list(range(40, 140)), [901] * 7]
NEW_TOKENS = 24
NEAR_TIE = 0.02  # of logits spanning about 1 (a random model): 20x the largest error seen

pytestmark = pytest.mark.skipif(
    not available() or not cpu_quant.has_x16(),
    reason="the K-quant kernel needs AVX-512 VNNI (the AVX2 path is not written yet)",
)


def transformers_greedy(path: Path) -> tuple[list[list[int]], list[torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    model.generation_config.eos_token_id = None
    tokens, logits = [], []
    with torch.inference_mode():
        for prompt in PROMPTS:
            out = model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                return_dict_in_generate=True, pad_token_id=0,
            )  # fmt: skip
            tokens.append(out.sequences[0, len(prompt) :].tolist())
            logits.append(torch.cat(out.logits).float())
    return tokens, logits


@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_tokens_match_transformers_on_the_same_file(preset: str) -> None:
    path = FILES / f"tiny-llama-{preset}.gguf"
    llm = LLM(EngineConfig(model=resolve_model(str(path)), device="cpu", quantization="gguf",
                           kv_cache_memory="64MiB"))  # fmt: skip
    # Its own KV identity (a block computed under one format is never reused under another),
    # and its layers on the packed K-quant blocks, not float.
    assert llm.engine.weight_identity == f"gguf-MOSTLY_{preset}/a16"
    formats = {getattr(m, "format", "") for m in llm.engine.runner.model.modules()}
    assert any(f.startswith(("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q5_0", "q5_1")) for f in formats), formats
    expected, logits = transformers_greedy(path)
    completions = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    identical = 0
    for completion, want, ref in zip(completions, expected, logits, strict=True):
        got = completion.token_ids
        first = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        if first is None:
            identical += 1
            continue
        margin = (ref[first, want[first]] - ref[first, got[first]]).item()
        print(f"{preset}: parts at token {first}, transformers' margin {margin:.5f}")
        assert 0 <= margin < NEAR_TIE, (preset, first, margin)
    assert identical >= len(PROMPTS) // 2, (preset, identical)
