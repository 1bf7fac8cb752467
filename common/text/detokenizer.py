"""Incremental detokenization with stop strings honoured across token boundaries.

Text is emitted only once it is stable: a token that ends inside a multi-byte character
(decoded as U+FFFD) waits for the next one, and while stop strings are set the last
``len(longest stop) - 1`` characters are held back, so a client never sees the start of a
stop string that the next token completes. The stop string itself is never emitted.
With ``min_tokens`` (vLLM's), stop strings count only from the ``min_tokens``-th output
token on: one that ends earlier is output text like any other.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.text.tokenizer import Tokenizer

# Prompt tokens decoded ahead of the output so that the first output token keeps the
# spacing it has in context (SentencePiece drops a leading space when decoded alone).
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.stop = tuple(stop)
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # output text so far (stop string excluded once found)
        self._emitted = 0
        self.stop_string: str | None = None
        self.num_taken = 0  # tokens of the last add() that belong to the output
        self.min_tokens = min_tokens
        self._num_output = 0  # output tokens fed so far

    def add(self, token_ids: Sequence[int]) -> str:
        """Feeds new tokens; returns the text that became safe to emit. ``num_taken`` then
        says how many of them belong to the output: all, unless a stop string was found,
        then those up to and including the token that completed it (a burst of several
        tokens, as a speculating decode worker sends, may run past a stop string)."""
        self.num_taken = 0
        if self.stop_string is not None:
            return ""
        for token_id in token_ids:
            self._ids.append(token_id)
            self._num_output += 1
            self.num_taken += 1
            self._decode_step()
            if self.stop_string is not None:
                break
        return self._take(final=self.stop_string is not None)

    def flush(self) -> str:
        """At the end of the stream: everything not yet emitted."""
        return self._take(final=True)

    def _decode_step(self) -> None:
        decode = self.tokenizer.decode
        prefix = decode(
            self._ids[self._prefix_offset : self._read_offset], self.skip_special_tokens
        )
        full = decode(self._ids[self._prefix_offset :], self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return
        delta = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        search_from = max(0, len(self.text) - self._holdback)
        self.text += delta
        if self.stop and self._num_output >= self.min_tokens:
            self._find_stop(search_from)

    def _find_stop(self, search_from: int) -> None:
        best: tuple[int, str] | None = None
        for stop in self.stop:
            at = self.text.find(stop, search_from)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is not None:
            self.text = self.text[: best[0]]
            self.stop_string = best[1]

    def _take(self, final: bool) -> str:
        limit = len(self.text) if final else max(self._emitted, len(self.text) - self._holdback)
        out = self.text[self._emitted : limit]
        self._emitted = limit
        return out
