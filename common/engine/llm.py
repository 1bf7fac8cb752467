"""LLM: the in-process front end (tokenize, run the engine to completion, detokenize).

This is what ``pdserve generate --local`` and the tests drive; the gateway does the same
work across processes.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from common.contract.sampling import SamplingParams
from common.engine.config import EngineConfig
from common.engine.engine import Engine, RequestOutput
from common.engine.eviction import KvEviction
from common.engine.request import FinishReason, TokenLogprob
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
    # With sampling.prompt_logprobs: entry i scores prompt token i (entry 0 is None).
    prompt_logprobs: list[TokenLogprob | None] | None = None


class LLM:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None = None) -> None:
        """``tokenizer``: one already loaded for this model (several engines of one model
        share it), else the checkpoint's is loaded."""
        self.engine = Engine(config)
        self.tokenizer = tokenizer or Tokenizer(config.model)
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
            detoks[request_id] = IncrementalDetokenizer(
                self.tokenizer, ids, p.stop, min_tokens=p.min_tokens
            )
            order.append(request_id)
        pending = set(order)
        while pending:
            for out in self.engine.step():
                done = completions[out.request_id]
                detok = detoks[out.request_id]
                done.text += detok.add(out.new_token_ids)
                taken = detok.num_taken  # a burst may run past a stop string
                done.token_ids += out.new_token_ids[:taken]
                done.logprobs += [lp for lp in out.new_logprobs[:taken] if lp is not None]
                done.num_cached_tokens = out.num_cached_tokens
                if out.prompt_logprobs is not None:
                    done.prompt_logprobs = out.prompt_logprobs
                if detok.stop_string is not None and not out.finished:
                    self.engine.abort(out.request_id)
                    out.finish_reason = FinishReason.STOP
                if out.finish_reason is not None:
                    done.text += detok.flush()
                    done.finish_reason = out.finish_reason.value
                    pending.discard(out.request_id)
        return [completions[r] for r in order]

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Next-token distributions over a window: [T-1, V] float32 log-softmax, row i that
        of token i + 1 given tokens 0..i. Runs the engine's own prefill (chunked as any
        prompt, every position computed) as a request with prompt logprobs."""
        if len(token_ids) < 2:
            raise ValueError(f"a window to score needs at least 2 tokens, got {len(token_ids)}")
        request_id = f"score-{next(self._ids)}"
        sampling = SamplingParams(max_tokens=1, prompt_logprobs=0, ignore_eos=True)
        self.engine.add_request(request_id, token_ids, sampling, keep_prompt_rows=True)
        rows: torch.Tensor | None = None
        for out in self._outputs_of(request_id):
            if out.prompt_logprob_rows is not None:
                rows = out.prompt_logprob_rows
        if rows is None:  # finished before its first token: the KV pool cannot hold it
            raise ValueError(
                f"a window of {len(token_ids)} tokens does not fit this engine's KV pool"
            )
        return rows

    def score_stream(self, token_ids: list[int], eviction: KvEviction) -> list[float]:
        """Log-probabilities of tokens 1.. of ``token_ids`` read as one stream under
        StreamingLLM eviction (any length: the KV kept is the sinks and the window), from
        the engine's own chunked prefill with prompt logprobs; [T-1] floats."""
        if len(token_ids) < 2:
            raise ValueError(f"a stream to score needs at least 2 tokens, got {len(token_ids)}")
        request_id = f"stream-{next(self._ids)}"
        sampling = SamplingParams(max_tokens=1, prompt_logprobs=0, ignore_eos=True)
        self.engine.add_request(request_id, token_ids, sampling, eviction=eviction)
        entries: list[TokenLogprob | None] | None = None
        for out in self._outputs_of(request_id):
            if out.prompt_logprobs is not None:
                entries = out.prompt_logprobs
        if entries is None or len(entries) != len(token_ids):
            raise ValueError(f"the stream of {len(token_ids)} tokens was not scored whole")
        return [entry.logprob for entry in entries[1:] if entry is not None]

    def _outputs_of(self, request_id: str) -> Iterator[RequestOutput]:
        """Steps the engine until ``request_id`` finishes; yields that request's outputs."""
        finished = False
        while not finished:
            for out in self.engine.step():
                if out.request_id == request_id:
                    finished = out.finished
                    yield out
