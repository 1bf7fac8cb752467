"""Where two runs of the default (quantized) format may part: at a near-tie, or nowhere.

Where the weights take the x16 kernels (an AVX-512 CPU) and attention the C++ backend, every
row of a step is computed alone and every prompt token's attention is a decode query at its
position, so a sequence's logits are the same bits however its steps were built
(tests/unit/test_batch_invariance.py): a migrated request, whose last tokens are recomputed
in a prefill chunk, continues exactly, and two runs must not part at all.

Elsewhere (the rows layout on an AVX2 CPU) a long prompt's tokens take a float GEMM whose
rounding depends on its row count, and a recomputed tail rounds differently from the decode
steps that first computed it. Those roundings move logits by about 1e-4; where a step's two
likeliest tokens lie closer than that, the runs may pick differently, and from there on they
are different texts. Seen: job 11 of test_decode_migration at token 62, margin 0.0004 (before
prefill attention became per-row). A test comparing such runs asserts equality up to the
first difference and that the difference is a near-tie, and prints it; it never lets a real
divergence through.
"""

from __future__ import annotations

from pathlib import Path

from common.engine.config import EngineConfig
from common.engine.llm import LLM
from common.models.quant.load import matmul_layouts
from tests.factories import next_logits

# The engine's own logit gap (same weight format, in this process) between the two runs'
# tokens at a part must be under this (logits span about 30).
NEAR_TIE = 0.01


class NearTies:
    """Judges where two greedy outputs of one prompt part, with the model in this process
    (the stack's weight format)."""

    def __init__(self, model_dir: Path) -> None:
        self.llm = LLM(EngineConfig(model=str(model_dir), num_kv_blocks=128))
        runner = self.llm.engine.runner
        # Batch-invariant here: two runs may not part even at a near-tie.
        layouts = set(matmul_layouts(runner.model))
        self.exact = runner.backend.name == "cpp" and layouts == {"x16"}

    def margin(self, prompt_ids: list[int], prefix: list[int], a: int, b: int) -> float:
        """|logit(a) - logit(b)| for the token after ``prompt_ids + prefix``."""
        logits = next_logits(self.llm.engine, prompt_ids, prefix)
        return abs(float(logits[a] - logits[b]))

    def check(self, prompt: str, got: list[int], want: list[int], what: object) -> bool:
        """True if the outputs are equal; False if they part at a near-tie (printed) where
        the path is not batch-invariant; an AssertionError if they part anywhere else, at
        all on a batch-invariant path, or differ in length."""
        assert len(got) == len(want), (what, len(got), len(want))
        first = next((i for i, (x, y) in enumerate(zip(got, want, strict=True)) if x != y), None)
        if first is None:
            return True
        margin = self.margin(self.llm.encode(prompt), want[:first], want[first], got[first])
        print(f"{what}: parts at token {first} ({want[first]} -> {got[first]}), "
              f"logit margin {margin:.5f}")  # fmt: skip
        assert not self.exact, f"{what}: parted on a batch-invariant path (margin {margin})"
        assert margin < NEAR_TIE, (what, first, margin)
        return False
