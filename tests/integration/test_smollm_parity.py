"""SmolLM2-135M-Instruct, float32: the engine's greedy output equals transformers' generate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.llm import LLM
from common.engine.sampling_params import SamplingParams
from tests.factories import hf_greedy
from tests.prompts import prompt_with_context

pytestmark = pytest.mark.slow

# Context sentences per prompt: about 30 to 650+ tokens after the chat template.
CONTEXT_SIZES = [0, 1, 4, 8, 14, 22, 31, 42]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def llm(smollm_dir: Path) -> LLM:
    return LLM(EngineConfig(model=str(smollm_dir), device="cpu", dtype="float32"))


def test_concurrent_batch_matches_transformers(llm: LLM, smollm_dir: Path) -> None:
    prompts = [llm.encode(prompt_with_context(n, i)) for i, n in enumerate(CONTEXT_SIZES)]
    lengths = [len(p) for p in prompts]
    assert min(lengths) <= 40 and max(lengths) >= 600, lengths

    recorded: dict[str, list[torch.Tensor]] = {}
    sampler = llm.engine.sampler

    def recording_sampler(logits: torch.Tensor, requests: list) -> object:
        for row, req in zip(logits, requests, strict=True):
            recorded.setdefault(req.request_id, []).append(row.clone())
        return sampler(logits, requests)

    llm.engine.sampler = recording_sampler  # type: ignore[assignment]
    try:
        completions = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    finally:
        llm.engine.sampler = sampler
    expected, expected_logits = hf_greedy(smollm_dir, prompts, NEW_TOKENS)

    diffs = [
        (torch.stack(recorded[c.request_id]) - ref).abs().max().item()
        for c, ref in zip(completions, expected_logits, strict=True)
    ]
    print(f"prompt lengths {lengths}; max |logit diff| per prompt: {[f'{d:.2e}' for d in diffs]}")
    for completion, want in zip(completions, expected, strict=True):
        assert completion.token_ids == want
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks


def test_cli_json_matches_transformers(smollm_dir: Path, tmp_path: Path) -> None:
    prompts = [prompt_with_context(0, 0), prompt_with_context(3, 5)]
    env = {**os.environ, "PDSERVE_LOG_LEVEL": "WARNING"}
    result = subprocess.run(
        [sys.executable, "-m", "pdserve", "generate", "--local", "--json",
         "--model", str(smollm_dir), "--max-tokens", "48", *prompts],
        capture_output=True, text=True, env=env, timeout=600, check=True,
    )  # fmt: skip
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["prompt"] for r in records] == prompts

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm_dir))
    encoded = []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True
        )
        encoded.append(list(ids["input_ids"] if not isinstance(ids, list) else ids))
    expected, _ = hf_greedy(smollm_dir, encoded, 48, ignore_eos=False)
    for record, prompt_ids, want in zip(records, encoded, expected, strict=True):
        assert record["prompt_token_ids"] == prompt_ids
        # transformers stops at EOS (inclusive); so does the engine.
        assert record["token_ids"] == want
        assert record["text"] == tokenizer.decode(want, skip_special_tokens=True)
        assert record["finish_reason"] == ("stop" if want[-1] == 2 else "length")
