"""LLM: the in-process front end (tokenize, run the engine to completion, detokenize).

This is what ``pdserve generate --local`` and the tests drive; the gateway does the same
work across processes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.request import FinishReason, TokenLogprob
from common.engine.sampling_params import SamplingParams
from common.text.detokenizer import IncrementalDetokenizer
from common.text.tokenizer import Tokenizer


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_cached_tokens: int = 0


class LLM:
    def __init__(self, config: EngineConfig) -> None:
        self.engine = Engine(config)
        self.tokenizer = Tokenizer(config.model)
        self._ids = itertools.count()

    def encode(self, prompt: str, raw: bool = False) -> list[int]:
        return self.tokenizer.encode_prompt(prompt, raw)

    def generate(
        self,
        prompts: Sequence[str | list[int]],
        sampling: SamplingParams | Sequence[SamplingParams],
        raw: bool = False,
    ) -> list[Completion]:
        """Runs every prompt as one concurrent batch; returns completions in input order."""
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else sampling
        if len(params) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or one for all")
        completions: dict[str, Completion] = {}
        detoks: dict[str, IncrementalDetokenizer] = {}
        order = []
        for prompt, p in zip(prompts, params, strict=True):
            ids = prompt if isinstance(prompt, list) else self.encode(prompt, raw)
            request_id = f"llm-{next(self._ids)}"
            self.engine.add_request(request_id, ids, p)
            completions[request_id] = Completion(request_id, ids)
            detoks[request_id] = IncrementalDetokenizer(self.tokenizer, ids, p.stop)
            order.append(request_id)
        pending = set(order)
        while pending:
            for out in self.engine.step():
                done = completions[out.request_id]
                done.token_ids += out.new_token_ids
                done.logprobs += [lp for lp in out.new_logprobs if lp is not None]
                done.num_cached_tokens = out.num_cached_tokens
                detok = detoks[out.request_id]
                done.text += detok.add(out.new_token_ids)
                if detok.stop_string is not None and not out.finished:
                    self.engine.abort(out.request_id)
                    out.finish_reason = FinishReason.STOP
                if out.finish_reason is not None:
                    done.text += detok.flush()
                    done.finish_reason = out.finish_reason.value
                    pending.discard(out.request_id)
        return [completions[r] for r in order]
