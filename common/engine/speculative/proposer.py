"""Proposers: what guesses the next tokens of a decoding request each step.

``NgramProposer`` (``method: ngram``) looks the request's context up in its own n-gram
index (ngram.py), kept on the request and fed verified tokens only, so it survives
preemption and is rebuilt from the tokens wherever the request continues (a migrated
request needs no proposer state on the wire).
"""

from __future__ import annotations

from common.engine.request import Request
from common.engine.speculative.config import SpeculativeConfig, SpeculativeConfigError
from common.engine.speculative.ngram import NgramIndex


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        assert config.method == "ngram", config.method
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, req: Request, num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` guesses for the tokens after ``req.token_ids``."""
        index = req.proposer_state
        if not isinstance(index, NgramIndex):
            index = req.proposer_state = NgramIndex(self.min_n, self.max_n)
        index.extend(req.token_ids[len(index) :])
        return index.propose(num_tokens)

    def forget(self, req: Request) -> None:
        req.proposer_state = None


def proposer_for(config: SpeculativeConfig) -> NgramProposer:
    if config.method == "ngram":
        return NgramProposer(config)
    raise SpeculativeConfigError(
        f"speculative method {config.method!r} is not served by this engine yet"
    )
