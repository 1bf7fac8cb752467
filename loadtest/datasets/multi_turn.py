"""``multi-turn``: conversations whose every turn resends the whole history.

Turn k's prompt is the system prompt, then for each earlier turn its user message and a
synthetic assistant reply of the expected output length, then the new user message; so
each turn's prompt begins with the previous turn's prompt. Replies are synthetic (fixed
ahead of the run) so the workload does not depend on what the server generates, and
prompt lengths are exact. Turns of one conversation are sent one after the other: a turn
goes out at its arrival time or when the previous turn has finished, whichever is later.
"""

from __future__ import annotations

from loadtest.datasets.base import SampleRequest, TokenSource


def multi_turn_requests(
    num_prompts: int,
    num_turns: int,
    system_len: int,
    user_len: int,
    output_len: int,
    vocab_size: int,
    *,
    seed: int = 0,
) -> list[SampleRequest]:
    """``num_prompts`` requests in all: ``ceil(num_prompts / num_turns)`` conversations,
    interleaved so that conversation c's turn t is request ``t * C + c`` (the turns of many
    conversations overlap in time, as with real users)."""
    if num_turns < 1 or user_len < 1 or output_len < 1:
        raise ValueError("num_turns, user_len and output_len must be >= 1")
    num_conversations = -(-num_prompts // num_turns)
    source = TokenSource(vocab_size, seed)
    turns: list[list[SampleRequest]] = []
    for c in range(num_conversations):
        history = source.tokens(system_len)
        conversation = []
        for t in range(num_turns):
            prompt = history + source.tokens(user_len)
            conversation.append(
                SampleRequest(
                    f"conv-{c}-turn-{t}",
                    prompt,
                    output_len,
                    category=f"turn-{t}",
                    session_id=f"conv-{c}",
                )
            )
            history = prompt + source.tokens(output_len)  # the reply the next turn repeats
        turns.append(conversation)
    ordered = [turns[c][t] for t in range(num_turns) for c in range(num_conversations)]
    return ordered[:num_prompts]
