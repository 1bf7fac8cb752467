"""Proposers: what guesses the next tokens of decoding requests each step.

A proposer has ``propose_batch([(request, at_most), ...]) -> {request_id: guesses}``, called
once per step for every decoding request the policy lets guess, ``forget(request_id)``
when a request ends here, and ``cold`` (see ``Proposer``).

``NgramProposer`` (``method: ngram``) looks the request's context up in its own n-gram
index (ngram.py), kept on the request and fed verified tokens only, so it survives
preemption and is rebuilt from the tokens wherever the request continues (a migrated
request needs no proposer state on the wire). ``DraftModelProposer`` (draft.py) runs a
draft model. ``SuffixProposer`` (``method: suffix``, suffix.py) looks the context up in the
request's suffix tree and in its tenant's tree of earlier responses.
"""

from __future__ import annotations

from typing import Protocol

from common.engine.config import EngineConfig
from common.engine.request import Request
from common.engine.speculative.config import SpeculativeConfig, SpeculativeConfigError
from common.engine.speculative.ngram import NgramIndex


class NgramProposer:
    cold = False  # a lookup costs the same every round

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

    def propose_batch(self, asks: list[tuple[Request, int]]) -> dict[str, list[int]]:
        return {req.request_id: self.propose(req, limit) for req, limit in asks}

    def forget(self, request_id: str) -> None:
        pass  # the index lives on the request


class Proposer(Protocol):
    # True after a round whose time is no guide to what guesses cost (a draft that built
    # a sequence's KV from its prompt): the engine leaves that step out of its step costs.
    cold: bool

    def propose_batch(self, asks: list[tuple[Request, int]]) -> dict[str, list[int]]: ...
    def forget(self, request_id: str) -> None: ...


def proposer_for(config: SpeculativeConfig, target: EngineConfig, vocab_size: int) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config)
    if config.method == "suffix":
        from common.engine.speculative.suffix import SuffixProposer

        return SuffixProposer(config)
    if config.method == "draft_model":
        from common.engine.speculative.draft import DraftModelProposer

        return DraftModelProposer(config, target, vocab_size)
    raise SpeculativeConfigError(f"speculative method {config.method!r} is not served here")
