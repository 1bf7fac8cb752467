"""GPTQ checkpoints made by gptqmodel (tests/data/gptq/) and AWQ checkpoints made by AutoAWQ
(the ``awq_checkpoints`` fixture) served from their packed weights against transformers'
greedy generate on the same weights. transformers reads GPTQ and AWQ only through those
tools, which need other versions of transformers and torch than the engine's, so the
reference model is the checkpoint dequantized (our dequantization, equal bit for bit to each
tool's own: checked here first, as in tests/unit/test_gptq_awq.py) and saved as a float
checkpoint. How tokens may part: tests/quant_parity.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.llm import LLM
from common.models.quant.gptq import GptqAwqCheckpoint
from common.models.quant.linear import QuantExperts
from common.text.tokenizer import Tokenizer
from kernels.cpu import available
from kernels.cpu.kquant import kq_available
from tests.quant_parity import assert_greedy_matches, float_checkpoint
from tests.unit.test_gptq_awq import AWQ_FILES, GPTQ, GPTQ_FILES, check_against_tool

pytestmark = pytest.mark.skipif(
    not available() or not kq_available(),
    reason="the integer-code kernels need AVX2 or AVX-512 VNNI",
)


def run(path: Path, tmp_path: Path, method: str, tokenizer_dir: Path) -> None:
    check_against_tool(path)  # our dequantization is the tool's, bit for bit
    weights = {
        t.name.removesuffix(".weight"): t.value.dequantize().to(torch.float16)
        for t in GptqAwqCheckpoint(path).tensors()
        if not isinstance(t.value, torch.Tensor)
    }  # fmt: skip
    reference = float_checkpoint(path, tmp_path / "float", weights)
    # The files carry no tokenizer (prompts are token ids): the default model's decodes.
    tokenizer = Tokenizer(str(tokenizer_dir))
    llm = LLM(EngineConfig(model=str(path), device="cpu", kv_cache_memory="64MiB"), tokenizer)
    identity = llm.engine.weight_identity
    assert identity is not None and identity.startswith(f"{method}-w"), identity
    formats = {getattr(m, "format", "") for m in llm.engine.runner.model.modules()}
    assert any(f.startswith(("w4g", "w8g", "q4/", "q8/")) for f in formats), formats
    if path.name.startswith("qwen3_moe"):  # every expert of both layers from its codes
        experts = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantExperts)]
        assert len(experts) == 2 and all(e.num_experts == 4 for e in experts), experts
    # The tools leave the head in the model's half precision: held so, not upcast.
    assert llm.engine.runner.model.lm_head.format in ("bf16", "f16"), llm.engine.runner.model.lm_head
    assert_greedy_matches(llm, reference, path.name, quantized_inputs=False)


@pytest.mark.parametrize("name", GPTQ_FILES)
def test_gptq_greedy_tokens_match_transformers(tmp_path: Path, smollm_dir: Path, name: str) -> None:
    run(GPTQ / name, tmp_path, "gptq", smollm_dir)


@pytest.mark.parametrize("name", AWQ_FILES)
def test_awq_greedy_tokens_match_transformers(
    awq_checkpoints: Path, tmp_path: Path, smollm_dir: Path, name: str
) -> None:
    run(awq_checkpoints / name, tmp_path, "awq", smollm_dir)
