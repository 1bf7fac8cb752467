"""Where two runs of the default (quantized) format may part: at a near-tie.

The packed kernels compute each row alone, but a migrated request recomputes its last
tokens in a prefill chunk (prefill attention, and a float GEMM whose rounding depends on
its row count for the prompt's tail), not as the decode steps that first computed them.
Those roundings move logits by about 1e-4; where a step's two likeliest tokens lie closer
than that, the runs may pick differently, and from there on they are different texts.
Seen: job 11 of test_decode_migration at token 62, margin 0.0004. A test comparing such
runs asserts equality up to the first difference and that the difference is a near-tie,
and prints it; it never lets a real divergence through.
"""

from __future__ import annotations

from pathlib import Path

from common.engine.config import EngineConfig
from common.engine.llm import LLM
from tests.factories import next_logits

# The engine's own logit gap (same weight format, in this process) between the two runs'
# tokens at a part must be under this (logits span about 30).
NEAR_TIE = 0.01


class NearTies:
    """Judges where two greedy outputs of one prompt part, with the model in this process
    (the stack's weight format)."""

    def __init__(self, model_dir: Path) -> None:
        self.llm = LLM(EngineConfig(model=str(model_dir), num_kv_blocks=128))

    def margin(self, prompt_ids: list[int], prefix: list[int], a: int, b: int) -> float:
        """|logit(a) - logit(b)| for the token after ``prompt_ids + prefix``."""
        logits = next_logits(self.llm.engine, prompt_ids, prefix)
        return abs(float(logits[a] - logits[b]))

    def check(self, prompt: str, got: list[int], want: list[int], what: object) -> bool:
        """True if the outputs are equal; False if they part at a near-tie (printed);
        an AssertionError if they part anywhere else or differ in length."""
        assert len(got) == len(want), (what, len(got), len(want))
        first = next((i for i, (x, y) in enumerate(zip(got, want, strict=True)) if x != y), None)
        if first is None:
            return True
        margin = self.margin(self.llm.encode(prompt), want[:first], want[first], got[first])
        print(f"{what}: parts at token {first} ({want[first]} -> {got[first]}), "
              f"logit margin {margin:.5f}")  # fmt: skip
        assert margin < NEAR_TIE, (what, first, margin)
        return False
