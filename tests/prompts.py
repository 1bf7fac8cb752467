"""Natural-language prompts of chosen lengths for tests and benchmarks."""

from __future__ import annotations

_SENTENCES = [
    "The river bends twice before it reaches the old mill at the edge of town.",
    "Engineers measured the bridge every spring and wrote the numbers in a ledger.",
    "A cache only helps when the same question is asked more than once.",
    "She planted tomatoes along the fence because the afternoon sun lingered there.",
    "The committee postponed its decision until the budget figures were audited.",
    "Light from distant galaxies arrives stretched toward the red end of the spectrum.",
    "Every queue in a well-run kitchen has a limit, or the orders pile up unanswered.",
    "The library kept its rarest maps in a cool room with the curtains drawn.",
    "Students compared three sorting algorithms and timed each on the same list.",
    "Wind turbines on the ridge turned slowly in the still morning air.",
]

QUESTIONS = [
    "What is the capital of France?",
    "Summarize the text above in two sentences.",
    "Write a short poem about the ocean.",
    "List three uses of a paperclip.",
    "Explain why the sky is blue.",
    "What should I cook for dinner tonight?",
    "Describe the main idea of the passage.",
    "Give me a tip for learning a new language.",
]


def passage(num_sentences: int, offset: int = 0) -> str:
    return " ".join(_SENTENCES[(offset + i) % len(_SENTENCES)] for i in range(num_sentences))


def prompt_with_context(num_sentences: int, index: int) -> str:
    """A question after ``num_sentences`` of context (about 15 tokens per sentence)."""
    question = QUESTIONS[index % len(QUESTIONS)]
    if num_sentences == 0:
        return question
    return f"{passage(num_sentences, offset=index)}\n\n{question}"
