"""Prompt lookup: proposals from the request's own context, no draft model, no draft KV.

The context (prompt and generated tokens) ends in some n-gram; if that n-gram occurred
earlier, the tokens that followed it then are the guess for what follows now. Longer
n-grams are tried first (``prompt_lookup_max`` down to ``prompt_lookup_min``); among the
earlier occurrences of one n-gram the latest wins (in a chat or an edit the nearest copy
is the likeliest to continue the same way).

``NgramIndex`` keeps, per n, the end of each n-gram's latest occurrence, updated as tokens
are appended: O(max - min + 1) dictionary updates per token, and a proposal is at most that
many lookups, whatever the context's length. An occurrence enters the index only once a
token follows it, so the context's own suffix never matches itself.

Only verified tokens are appended (a rejected proposal never reaches the index), so there
is nothing to roll back.
"""

from __future__ import annotations

from collections.abc import Iterable


class NgramIndex:
    """One sequence's context and its n-gram index. Not thread-safe: the engine thread's."""

    def __init__(self, min_n: int, max_n: int, token_ids: Iterable[int] = ()) -> None:
        assert 1 <= min_n <= max_n, (min_n, max_n)
        self.min_n = min_n
        self.max_n = max_n
        self.token_ids: list[int] = []
        # _ends[n - min_n][gram] = e: the latest occurrence of gram is token_ids[e - n : e],
        # and e < len(token_ids) (token_ids[e] followed it).
        self._ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_n, max_n + 1)]
        self.extend(token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    def extend(self, token_ids: Iterable[int]) -> None:
        tokens = self.token_ids
        for token in token_ids:
            # The new token follows the n-grams that end where it starts.
            e = len(tokens)
            for n in range(self.min_n, min(self.max_n, e) + 1):
                self._ends[n - self.min_n][tuple(tokens[e - n : e])] = e
            tokens.append(token)

    def propose(self, num_tokens: int) -> list[int]:
        """``num_tokens`` guesses for the tokens after the context; [] when its suffix
        occurred nowhere before (for every n). A continuation that runs into the end of
        the context goes on with the guesses themselves: the text since the occurrence
        repeats (a loop of P tokens is guessed P at a time otherwise)."""
        return self.lookup(num_tokens)[0]

    def lookup(self, num_tokens: int) -> tuple[list[int], int]:
        """``propose``'s guesses and the length of the n-gram they follow (0: none)."""
        tokens = self.token_ids
        size = len(tokens)
        for n in range(min(self.max_n, size), self.min_n - 1, -1):
            e = self._ends[n - self.min_n].get(tuple(tokens[size - n :]))
            if e is not None:
                return _continue(tokens, e, num_tokens), n
        return [], 0


def _continue(tokens: list[int], start: int, num_tokens: int) -> list[int]:
    """tokens[start:] extended with itself: ``num_tokens`` of the sequence whose token i
    is tokens[start + i], and tokens[start + i - period] past the end."""
    period = len(tokens) - start
    guesses = tokens[start : start + num_tokens]
    while len(guesses) < num_tokens:
        guesses.append(guesses[len(guesses) - period])
    return guesses


def propose_reference(token_ids: list[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """The same proposal by a plain backward scan (the index's test reference)."""
    size = len(token_ids)
    for n in range(min(max_n, size), min_n - 1, -1):
        suffix = token_ids[size - n :]
        for e in range(size - 1, n - 1, -1):  # latest occurrence first; e < size
            if token_ids[e - n : e] == suffix:
                extended = list(token_ids)
                while len(extended) < e + num_tokens:  # what followed, followed by itself
                    extended.append(extended[len(extended) - (size - e)])
                return extended[e : e + num_tokens]
    return []
