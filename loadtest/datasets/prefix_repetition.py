"""``prefix-repetition``: K shared prefixes x M distinct suffixes, shuffled (vLLM's
``--prefix-repetition-*`` flags). With K = 1 it is the RadixAttention example: one long
system prompt, many short questions."""

from __future__ import annotations

import numpy as np

from loadtest.datasets.base import SampleRequest, TokenSource


def prefix_repetition_requests(
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    vocab_size: int,
    *,
    seed: int = 0,
) -> list[SampleRequest]:
    """``num_prompts`` requests spread evenly over ``num_prefixes`` prefixes (the first
    ``num_prompts % num_prefixes`` prefixes get one more), each prompt exactly
    ``prefix_len + suffix_len`` tokens, in a seeded random order. ``category`` names the
    prefix (``prefix-3``)."""
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes must be >= 1, got {num_prefixes}")
    if suffix_len < 1 or output_len < 1:
        raise ValueError("suffix_len and output_len must be >= 1")
    source = TokenSource(vocab_size, seed)
    prefixes = [source.tokens(prefix_len) for _ in range(num_prefixes)]
    requests = [
        SampleRequest(
            f"prefix-{i % num_prefixes}-{i // num_prefixes}",
            prefixes[i % num_prefixes] + source.tokens(suffix_len),
            output_len,
            category=f"prefix-{i % num_prefixes}",
        )
        for i in range(num_prompts)
    ]
    order = np.random.default_rng(seed + 1).permutation(num_prompts)
    return [requests[int(i)] for i in order]
