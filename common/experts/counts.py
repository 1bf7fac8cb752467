"""ExpertCounts: tokens routed per MoE layer, expert and phase, as the host sees them.

Written by the model's recorder (common/models/moe.py), published to Redis by workers
(common/index/expert_load.py), summarised by common/experts/stats.py. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFILL, DECODE = 0, 1
PHASES = ("prefill", "decode")


@dataclass(frozen=True)
class ExpertCounts:
    """Host copy of cumulative tokens routed: ``counts[phase][i][e]`` for MoE layer
    ``layers[i]`` (a decoder layer index) and expert ``e``; phase 0 prefill, 1 decode."""

    layers: tuple[int, ...]
    num_experts: int
    counts: tuple[tuple[tuple[int, ...], ...], ...]  # [2][len(layers)][E]

    def phase(self, name: str) -> tuple[tuple[int, ...], ...]:
        return self.counts[PHASES.index(name)]

    def minus(self, earlier: ExpertCounts | None) -> ExpertCounts:
        """What was routed since ``earlier`` (the same recorder's older snapshot)."""
        if earlier is None:
            return self
        if earlier.layers != self.layers or earlier.num_experts != self.num_experts:
            raise ValueError("expert counts of different models cannot be subtracted")
        return ExpertCounts(
            self.layers,
            self.num_experts,
            tuple(
                tuple(
                    tuple(a - b for a, b in zip(now, then, strict=True))
                    for now, then in zip(phase_now, phase_then, strict=True)
                )
                for phase_now, phase_then in zip(self.counts, earlier.counts, strict=True)
            ),
        )

    def total(self) -> int:
        return sum(sum(row) for phase in self.counts for row in phase)

    def layer_total(self, slot: int) -> list[int]:
        """Both phases of MoE layer ``layers[slot]``, per expert."""
        return [
            a + b
            for a, b in zip(self.counts[PREFILL][slot], self.counts[DECODE][slot], strict=True)
        ]

    @classmethod
    def zeros(cls, layers: tuple[int, ...], num_experts: int) -> ExpertCounts:
        row = (0,) * num_experts
        return cls(layers, num_experts, tuple(tuple(row for _ in layers) for _ in PHASES))
