"""Sampler: penalties, temperature, top-k/top-p/min-p, seeded draws, logprobs.

Shapes: n = sequences sampled this step, V = vocab.

Randomness: every draw uses a generator seeded from (request seed, output position), so a
seeded request's tokens do not depend on what else shares the batch, on preemption, or on
which engine continues it after a KV handoff. Unseeded requests get a random seed on arrival.
A draw is an exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks token i with
probability p_i.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from common.contract.sampling import SamplingParams
from common.engine.grammar import apply_masks
from common.engine.request import TokenLogprob
from kernels.cpu import loaded

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    # splitmix64 finaliser: decorrelates nearby (seed, position) pairs.
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_seed(seed: int, position: int) -> int:
    return _mix64(_mix64(seed) ^ position) & ((1 << 63) - 1)


class SamplingRow(Protocol):
    """What the sampler reads of a request: a Request, or one of its speculative verify
    rows (common/engine/speculative/verify.py's VerifyRow)."""

    @property
    def request_id(self) -> str: ...
    @property
    def sampling(self) -> SamplingParams: ...
    @property
    def seed(self) -> int: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def output_token_ids(self) -> list[int]: ...
    @property
    def num_output_tokens(self) -> int: ...
    @property
    def stop_ids(self) -> frozenset[int]: ...


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Sampler:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def __call__(
        self,
        logits: torch.Tensor,
        requests: Sequence[SamplingRow],
        masks: tuple[torch.Tensor, list[int]] | None = None,
    ) -> SampleResult:
        """logits: [n, V] float32 (may be wider than V: padded vocab columns are dropped).
        masks: structured output's token bitmasks [n, W] int32 and the rows they constrain
        (common/engine/grammar.py); a refused token is never drawn, and the logprobs of a
        constrained row are those of its masked distribution."""
        logits = logits[:, : self.vocab_size]
        logits = self._apply_penalties(logits, requests)
        if masks is not None:
            logits = apply_masks(logits, masks[0], masks[1])
        logits = self._mask_early_stops(logits, requests)
        raw_logprobs = None
        if any(r.sampling.logprobs or r.sampling.top_logprobs for r in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        token_ids = _argmax(logits)
        for i, req in enumerate(requests):
            if not req.sampling.greedy:
                token_ids[i] = self._draw(logits[i], req)
        logprobs: list[TokenLogprob | None] = [None] * len(requests)
        if raw_logprobs is not None:
            for i, req in enumerate(requests):
                if req.sampling.logprobs or req.sampling.top_logprobs:
                    logprobs[i] = _logprob_entry(
                        raw_logprobs[i], token_ids[i], req.sampling.top_logprobs
                    )
        return SampleResult(token_ids, logprobs)

    def _apply_penalties(
        self, logits: torch.Tensor, requests: Sequence[SamplingRow]
    ) -> torch.Tensor:
        rows = [i for i, r in enumerate(requests) if r.sampling.has_penalties]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            params = requests[i].sampling
            row = logits[i]
            if params.repetition_penalty != 1.0:
                # HF convention: over prompt and output tokens, shrink positive logits and
                # push negative ones further down.
                seen = torch.tensor(sorted(set(requests[i].token_ids)), dtype=torch.long)
                values = row[seen]
                row[seen] = torch.where(
                    values > 0,
                    values / params.repetition_penalty,
                    values * params.repetition_penalty,
                )
            if params.presence_penalty or params.frequency_penalty:
                output = requests[i].output_token_ids
                if output:
                    counts = torch.bincount(
                        torch.tensor(output, dtype=torch.long), minlength=self.vocab_size
                    ).to(row.dtype)
                    row -= params.frequency_penalty * counts
                    row -= params.presence_penalty * (counts > 0).to(row.dtype)
        return logits

    def _mask_early_stops(
        self, logits: torch.Tensor, requests: Sequence[SamplingRow]
    ) -> torch.Tensor:
        """min_tokens: a row with fewer output tokens than that cannot draw (or be greedy
        on) an end-of-sequence or stop token id; its logprobs see them masked too."""
        rows = [
            i
            for i, r in enumerate(requests)
            if r.num_output_tokens < r.sampling.min_tokens and r.stop_ids
        ]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            ids = [t for t in requests[i].stop_ids if t < self.vocab_size]
            logits[i, ids] = float("-inf")
        return logits

    def _draw(self, logits: torch.Tensor, req: SamplingRow) -> int:
        params = req.sampling
        scaled = logits / params.temperature  # [V]
        if params.top_k and params.top_k < scaled.shape[0]:
            kth = torch.topk(scaled, params.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if params.top_p < 1.0:
            sorted_logits, order = torch.sort(scaled, descending=True)
            cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
            # Drop a token when the mass before it already reaches top_p (the first stays).
            drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= params.top_p
            drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
            scaled = scaled.masked_fill(drop, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if params.min_p > 0.0:
            probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
        generator = torch.Generator(device=logits.device)
        generator.manual_seed(draw_seed(req.seed, req.num_output_tokens))
        noise = torch.empty_like(probs).exponential_(generator=generator)
        return int((probs / noise).argmax())


def _argmax(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (the first index of its maximum, as torch's): on a CPU where the
    engine loaded the C++ kernels, their two vectorized passes (9 verify rows of SmolLM2's
    49152 logits: 0.06 ms against torch's 0.64, the 2-core test machine)."""
    ops = loaded()
    cpu_float = logits.device.type == "cpu" and logits.dtype == torch.float32
    if ops is not None and cpu_float and logits.shape[1] > 0 and logits.stride(1) == 1:
        ids: list[int] = ops.argmax_rows(logits).tolist()
        return ids
    out: list[int] = logits.argmax(dim=-1).tolist()
    return out


def _logprob_entry(logprobs: torch.Tensor, token_id: int, num_top: int) -> TokenLogprob:
    top: list[tuple[int, float]] = []
    if num_top:
        values, ids = torch.topk(logprobs, num_top)
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token_id, float(logprobs[token_id]), top)


def prompt_logprob_entries(
    rows: torch.Tensor, token_ids: list[int], num_top: int
) -> list[TokenLogprob]:
    """rows: [m, V] float32 log-softmax at m prompt positions; token_ids: the m prompt tokens
    those positions score (each position's next token). One entry per row."""
    targets = torch.tensor(token_ids, dtype=torch.long, device=rows.device).unsqueeze(1)
    own = rows.gather(1, targets).squeeze(1).tolist()  # [m]
    if not num_top:
        return [TokenLogprob(t, lp) for t, lp in zip(token_ids, own, strict=True)]
    values, ids = torch.topk(rows, num_top, dim=-1)  # [m, k]
    return [
        TokenLogprob(t, lp, list(zip(top_ids, top_values, strict=True)))
        for t, lp, top_ids, top_values in zip(
            token_ids, own, ids.tolist(), values.tolist(), strict=True
        )
    ]
