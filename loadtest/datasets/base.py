"""What a dataset yields: requests with exact prompt tokens and an expected output length."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Token ids below this are left out of synthetic prompts: tokenizers put their special and
# control tokens (bos, eos, chat markers) at the start of the vocabulary.
FIRST_PLAIN_TOKEN_ID = 1000


@dataclass(frozen=True)
class SampleRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    expected_output_len: int
    category: str = ""  # a dataset's label for a kind of request ("chat", "long", ...)
    arrival_s: float | None = None  # fixed send offset (trace replay); None = the arrival process
    session_id: str | None = None  # turns of one conversation: each is sent after the previous ends

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


class TokenSource:
    """Synthetic prompt text: seeded random token ids from the plain part of a vocabulary."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        if vocab_size <= FIRST_PLAIN_TOKEN_ID + 1:
            raise ValueError(f"vocab_size must be > {FIRST_PLAIN_TOKEN_ID + 1}, got {vocab_size}")
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(seed)

    def tokens(self, count: int) -> tuple[int, ...]:
        ids = self.rng.integers(FIRST_PLAIN_TOKEN_ID, self.vocab_size, size=count)
        return tuple(int(t) for t in ids)


def sample_lengths(
    rng: np.random.Generator, mean: int, range_ratio: float, count: int
) -> list[int]:
    """Integers uniform in [mean * (1 - r), mean * (1 + r)], at least 1 (vLLM's random
    dataset rule for ``--random-range-ratio``)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    if mean < 1:
        raise ValueError(f"length must be >= 1, got {mean}")
    low = max(1, int(np.floor(mean * (1 - range_ratio))))
    high = max(low, int(np.ceil(mean * (1 + range_ratio))))
    return [int(n) for n in rng.integers(low, high + 1, size=count)]
