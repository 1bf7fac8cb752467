"""Greedy parity of a quantized checkpoint served by the engine against transformers
(tests/integration/test_ct_parity.py, test_gptq_awq_parity.py).

The engine's products differ from transformers' float32 ones by rounding (int16 activation
codes, or integer sums of the same int8 codes), so a prompt's tokens may part from
transformers' only at a near-tie of transformers' own logits; every prompt must agree up to
there and most prompts entirely. A scheme that quantizes activations (W8A8, FP8) rounds each
layer's input to a coarse grid, so a float32-rounding-sized change of its input moves some
codes a whole step: measured here, transformers' own logits of a W8A8 model moved by 0.15
when its input embeddings were perturbed by one part in 10^7 (a W4A16 model's by 2e-5),
and the engine's differed from them by 0.05-0.10 (its layers alone agree to 2e-6). For those
schemes the near-tie is transformers' own movement under such a perturbation (PERTURBATION),
measured on the same sequences.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from common.contract.sampling import SamplingParams
from common.engine.llm import LLM
from loadtest.baselines.greedy_reference import NEW_TOKENS, PROMPTS, greedy_reference

__all__ = ["NEW_TOKENS", "PROMPTS"]  # the tests import them from here
# The quantization tool's own greedy record of a checkpoint transformers cannot load
# (loadtest/baselines/make_ct_checkpoints.py writes it).
TOOL_REFERENCE = "tool_reference.pt"

NEAR_TIE = 0.02  # of logits spanning several units (a random model)


def float_checkpoint(path: Path, out: Path, weights: dict[str, torch.Tensor]) -> Path:
    """``path`` as a float checkpoint: its quantized layers' ``weights`` (by module) and its
    other tensors, config without quantization_config."""
    shutil.copytree(path, out, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    tensors = {f"{m}.weight": w.float().contiguous() for m, w in weights.items()}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                module, _, suffix = name.rpartition(".")
                if f"{module}.weight" not in tensors or suffix == "bias":
                    tensors.setdefault(name, f.get_tensor(name).float())
    save_file(tensors, str(out / "model.safetensors"))
    return out


def transformers_greedy(path: Path) -> tuple[list[list[int]], list[torch.Tensor], float]:
    """transformers' greedy tokens and logits per prompt, and how far its logits of those
    sequences move when the input embeddings are perturbed by ``PERTURBATION``. A checkpoint
    transformers cannot load carries the tool's own record (``TOOL_REFERENCE``) instead."""
    if (path / TOOL_REFERENCE).exists():
        record = torch.load(path / TOOL_REFERENCE)
        return record["tokens"], record["logits"], record["moved"]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return greedy_reference(model)


def assert_greedy_matches(llm: LLM, reference: Path, name: str, quantized_inputs: bool) -> None:
    expected, logits, moved = transformers_greedy(reference)
    near_tie = max(NEAR_TIE, moved) if quantized_inputs else NEAR_TIE
    print(f"{name}: transformers' logits move {moved:.5f} under the perturbation")
    if not quantized_inputs:
        assert moved < NEAR_TIE / 4, moved  # float activations: a smooth model
    completions = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert_parts_only_at_near_ties(
        name, [c.token_ids for c in completions], expected, logits, near_tie
    )
    assert len({tuple(t) for t in expected}) > 1, "the model's outputs should differ by prompt"


def assert_parts_only_at_near_ties(
    name: str,
    outputs: list[list[int]],
    expected: list[list[int]],
    logits: list[torch.Tensor],
    near_tie: float,
) -> None:
    """Each output equals transformers' up to where transformers' own logits there lie
    within ``near_tie`` of each other (its margin printed), and at least half entirely."""
    identical = 0
    for got, want, ref in zip(outputs, expected, logits, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        if first is None:
            identical += 1
            continue
        margin = (ref[first, want[first]] - ref[first, got[first]]).item()
        print(f"{name}: parts at token {first}, transformers' margin {margin:.5f}")
        assert 0 <= margin < near_tie, (name, first, margin, near_tie)
    assert identical >= len(outputs) // 2, (name, identical)
