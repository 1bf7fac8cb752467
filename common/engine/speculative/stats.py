"""Counters of speculative decoding, cumulative over an engine's life (the ``pdserve:
spec_decode_*`` metrics and ``pdserve status`` read them; vLLM's names, same meaning)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verify rounds: a request with at least one proposal, one step
    num_draft_tokens: int = 0  # proposals verified
    num_accepted_tokens: int = 0  # proposals kept
    # accepted_per_position[i]: rounds whose proposal i was kept (i from 0)
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        assert 0 <= num_accepted <= num_proposed, (num_proposed, num_accepted)
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_proposed:
            self.accepted_per_position += [0] * (num_proposed - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Kept proposals over verified ones (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.accepted_per_position))  # fmt: skip
