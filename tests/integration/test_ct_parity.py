"""compressed-tensors checkpoints made by llm-compressor (the ``ct_checkpoints`` fixture)
served from their packed weights against transformers' greedy generate on the same
checkpoint: transformers loads it through compressed-tensors (decompressed weights, and the
scheme's activation quantization: int8 per token for W8A8, FP8 for the FP8 schemes).
transformers 5.24 cannot load an asymmetric pack-quantized checkpoint (it expects the zero
points unpacked), so for that one the reference is transformers on the weights
compressed-tensors decompresses, saved as a float checkpoint (the scheme quantizes no
activations, so that is the same model). Nor can it load the MoE model's W8A8 and FP8
checkpoints (it does not fold their per-expert weights back into its fused experts): for
those, llm-compressor's own in-memory model recorded the reference when it made them
(make_ct_checkpoints.py; it equals transformers' on every checkpoint transformers loads).
How tokens may part: tests/quant_parity.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from common.contract.sampling import SamplingParams
from common.engine.config import EngineConfig
from common.engine.llm import LLM
from common.models.quant.linear import QuantExperts
from kernels.cpu import available
from kernels.cpu.kquant import kq_available
from tests.quant_parity import (
    NEW_TOKENS,
    PROMPTS,
    assert_greedy_matches,
    float_checkpoint,
    transformers_greedy,
)
from tests.unit.test_compressed_tensors import SCHEMES, reference_weights

pytestmark = pytest.mark.skipif(
    not available() or not kq_available(),
    reason="the integer-code kernels need AVX2 or AVX-512 VNNI",
)


@pytest.mark.parametrize("name", SCHEMES)
def test_greedy_tokens_match_transformers_on_the_same_checkpoint(
    ct_checkpoints: Path, tmp_path: Path, name: str
) -> None:
    path = ct_checkpoints / name
    llm = LLM(EngineConfig(model=str(path), device="cpu", kv_cache_memory="64MiB"))
    identity = llm.engine.weight_identity
    assert identity is not None and identity.startswith("ct-w"), identity  # auto chose it
    formats = {getattr(m, "format", "") for m in llm.engine.runner.model.modules()}
    assert any(f.startswith(("w4g", "w8g", "fp8/", "q4/", "q8/")) for f in formats), formats
    if name.startswith("qwen3_moe"):  # every expert of both layers served from its codes
        experts = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantExperts)]
        assert len(experts) == 2 and all(e.num_experts == 4 for e in experts), experts
    reference = path
    if name.endswith("-asym"):
        reference = float_checkpoint(path, tmp_path / "float", reference_weights(path))
    assert_greedy_matches(llm, reference, name, any(s in name for s in ("w8a8", "fp8")))


def test_none_serves_the_dequantized_weights(ct_checkpoints: Path, tmp_path: Path) -> None:
    """``--quantization none`` on a compressed-tensors checkpoint: the float model of its
    decompressed weights (greedy equal to transformers on them)."""
    path = ct_checkpoints / "llama-w4a16-asym"
    llm = LLM(EngineConfig(model=str(path), device="cpu", quantization="none",
                           kv_cache_memory="64MiB"))  # fmt: skip
    assert llm.engine.weight_identity is None
    float_dir = float_checkpoint(path, tmp_path / "float", reference_weights(path))
    expected, _, _ = transformers_greedy(float_dir)
    completions = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [c.token_ids for c in completions] == expected
