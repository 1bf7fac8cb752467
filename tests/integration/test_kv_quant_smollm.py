"""SmolLM2-135M-Instruct, float32 model on the torch backend: int8 KV against float32 KV.

Eight chat prompts (about 35 to 275 tokens), 32 greedy tokens each. Measured on the 2-core CPU
reference machine:

    kv         until 1st divergence   overall   teacher-forced top-1   first divergence per prompt
    int8       0.746                  0.746     0.969                  [26, 32, 14, 32, 9, 27, 32, 19]
    fp8        0.531                  0.543     0.957                  [0, 32, 32, 2, 29, 3, 19, 19]
    bfloat16   1.000                  1.000     1.000                  (all 32)

"Teacher-forced" feeds the int8 engine the float run's tokens and compares each step's argmax,
so one early flip does not hide how often the two agree. In this model a (block, kv head)'s
K absmax is about 6x its RMS (measured; V 4.5x), so the power-of-two int8 step costs roughly
2-3% RMS error per value: greedy runs drift apart after near-ties although ~97% of single
steps agree. fp8 (relative error up to 2^-4) does worse. The floors sit under the measurements.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.contract.sampling import SamplingParams
from common.engine.config import EngineConfig
from common.engine.llm import LLM
from common.engine.sampler import SampleResult
from tests.prompts import prompt_with_context

pytestmark = pytest.mark.slow

CONTEXT_SIZES = [0, 1, 2, 4, 6, 8, 12, 16]
NEW_TOKENS = 32
MIN_AGREEMENT = 0.65  # until first divergence, measured 0.746
MIN_FORCED_TOP1 = 0.9  # measured 0.969


def _generate(
    model_dir: Path, kv_dtype: str, forced: list[list[int]] | None = None
) -> list[list[int]]:
    """Each step's argmax per prompt: the greedy output, or with ``forced`` the argmax while
    the engine continues with the forced tokens instead (teacher forcing)."""
    llm = LLM(
        EngineConfig(
            model=str(model_dir),
            device="cpu",
            dtype="float32",
            kv_dtype=kv_dtype,
            quantization="none",
        )
    )
    prompts = [llm.encode(prompt_with_context(n, i)) for i, n in enumerate(CONTEXT_SIZES)]
    # LLM.generate numbers its requests llm-0, llm-1, ... in prompt order.
    index = {f"llm-{i}": i for i in range(len(prompts))}
    argmax: list[list[int]] = [[] for _ in prompts]
    sampler = llm.engine.sampler

    def forcing_sampler(logits: torch.Tensor, requests: list) -> SampleResult:
        result = sampler(logits, requests)
        for req, token_id in zip(requests, result.token_ids, strict=True):
            argmax[index[req.request_id]].append(token_id)
        if forced is not None:
            result.token_ids = [forced[index[r.request_id]][r.num_output_tokens] for r in requests]
        return result

    llm.engine.sampler = forcing_sampler  # type: ignore[assignment]
    completions = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    if forced is None:
        assert [c.token_ids for c in completions] == argmax
    return argmax


def test_int8_kv_agrees_with_float_kv(smollm_dir: Path) -> None:
    want = _generate(smollm_dir, "float32")
    got = _generate(smollm_dir, "int8")
    total = len(want) * NEW_TOKENS
    divergence = [
        next((i for i, (a, b) in enumerate(zip(w, g, strict=True)) if a != b), NEW_TOKENS)
        for w, g in zip(want, got, strict=True)
    ]
    until_divergence = sum(divergence) / total
    overall = sum(a == b for w, g in zip(want, got, strict=True) for a, b in zip(w, g, strict=True))
    forced = _generate(smollm_dir, "int8", forced=want)
    forced_top1 = sum(
        a == b for w, f in zip(want, forced, strict=True) for a, b in zip(w, f, strict=True)
    )
    print(
        f"SmolLM2 int8 KV vs float32 KV: {until_divergence:.3f} of tokens agree until the first "
        f"divergence, {overall / total:.3f} overall, teacher-forced top-1 {forced_top1 / total:.3f}; "
        f"first divergence per prompt {divergence}"
    )
    assert until_divergence >= MIN_AGREEMENT
    assert forced_top1 / total >= MIN_FORCED_TOP1
    # Up to each prompt's first divergence the forced run saw the free run's context, so it
    # picked the same tokens, the diverging one included.
    for g, f, d in zip(got, forced, divergence, strict=True):
        assert f[: d + 1] == g[: d + 1]
