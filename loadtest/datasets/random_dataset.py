"""``random``: independent prompts of random tokens with exact, seeded lengths (vLLM's
``--random-input-len``, ``--random-output-len``, ``--random-range-ratio``,
``--random-prefix-len``)."""

from __future__ import annotations

import numpy as np

from loadtest.datasets.base import SampleRequest, TokenSource, sample_lengths


def random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    *,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
) -> list[SampleRequest]:
    """Each prompt: one shared ``prefix_len``-token prefix, then its own random tokens, for
    ``prefix_len + input`` tokens in all."""
    rng = np.random.default_rng(seed)
    inputs = sample_lengths(rng, input_len, range_ratio, num_prompts)
    outputs = sample_lengths(rng, output_len, range_ratio, num_prompts)
    source = TokenSource(vocab_size, seed + 1)
    prefix = source.tokens(prefix_len)
    return [
        SampleRequest(f"random-{i}", prefix + source.tokens(n_in), n_out)
        for i, (n_in, n_out) in enumerate(zip(inputs, outputs, strict=True))
    ]
