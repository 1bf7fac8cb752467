"""``long-prefill-interference``: a stream of short chats while long prompts arrive.

The question it answers: how much does a long prefill stall the decode of requests that
are already streaming? Colocated serving runs the long prefill in the same steps as
everyone's decode; disaggregated serving runs it elsewhere. Read the ``chat`` category's
ITL and TPOT; ``long`` requests are the interference.
"""

from __future__ import annotations

from loadtest.datasets.base import SampleRequest, TokenSource


def interference_requests(
    num_prompts: int,
    chat_input_len: int,
    chat_output_len: int,
    long_input_len: int,
    long_output_len: int,
    long_every: int,
    vocab_size: int,
    *,
    seed: int = 0,
) -> list[SampleRequest]:
    """Every ``long_every``-th request (1-based: ``long_every - 1``, ``2 * long_every - 1``,
    ...) is a long prompt; the rest are chats. Lengths are exact."""
    if long_every < 2:
        raise ValueError(f"long_every must be >= 2, got {long_every}")
    source = TokenSource(vocab_size, seed)
    requests = []
    for i in range(num_prompts):
        if (i + 1) % long_every == 0:
            requests.append(SampleRequest(f"long-{i}", source.tokens(long_input_len),
                                          long_output_len, category="long"))  # fmt: skip
        else:
            requests.append(SampleRequest(f"chat-{i}", source.tokens(chat_input_len),
                                          chat_output_len, category="chat"))  # fmt: skip
    return requests
