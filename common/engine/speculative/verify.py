"""Verification of proposed tokens against the target model's distributions.

Shapes: k = proposed tokens, V = vocab. The target computed k + 1 rows for a sequence:
row i is its distribution for the token after the context and the first i proposals, so
row k (all accepted) yields one more token, the "bonus".

- Point-mass proposals (prompt lookup, a draft model's greedy guesses): ``accepted``.
  The sampler picks a token at every verify row exactly as a plain step at that output
  position would (the argmax when greedy; the seeded draw ``draw_seed(seed, position)``
  when sampling); proposals are kept while they equal those picks, and the first pick
  that differs ends the round. For greedy this is what k + 1 plain steps emit. For
  sampling it is rejection sampling with q a point mass on x: x is kept with probability
  p(x), and a rejected round emits the draw, which given that it is not x is distributed
  as norm(p without x), the residual. Each emitted token is distributed as the target's
  p, and a seeded request emits the same tokens with and without speculation (the same
  draws at the same positions), whatever k is in each round.
- Proposals drawn from a distribution q: ``accepted_sampled`` (Leviathan et al. 2023 /
  Chen et al. 2023): x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the
  first rejection a token is drawn from norm(max(p_i - q_i, 0)) and the round ends.

``p`` rows must be the distributions the sampler would draw from (penalties, temperature,
top-k/top-p/min-p applied), each row under its own context (row i: the context and the
first i proposals; ``VerifyRow``). Randomness is per output position.
"""

from __future__ import annotations

import torch

from common.contract.sampling import SamplingParams
from common.engine.request import Request
from common.engine.sampler import draw_seed


def accepted(target_tokens: list[int], proposed: list[int]) -> list[int]:
    """The tokens emitted: the accepted proposals, then the target's own token.
    ``target_tokens`` has the sampler's pick at each verify row (len(proposed) + 1)."""
    assert len(target_tokens) == len(proposed) + 1, (len(target_tokens), len(proposed))
    for i, token in enumerate(proposed):
        if token != target_tokens[i]:
            return [*proposed[:i], target_tokens[i]]
    return [*proposed, target_tokens[-1]]


class VerifyRow:
    """What the sampler reads of a request at verify row ``len(extra)``: the request with
    the proposals before that row appended (penalties, and the output position that seeds
    the draw, follow them)."""

    __slots__ = ("extra", "request")

    def __init__(self, request: Request, extra: list[int]) -> None:
        self.request = request
        self.extra = extra

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    @property
    def seed(self) -> int:
        return self.request.seed

    @property
    def token_ids(self) -> list[int]:
        return self.request.token_ids + self.extra

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + self.extra

    @property
    def stop_ids(self) -> frozenset[int]:
        return self.request.stop_ids

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + len(self.extra)


def _generator(seed: int, position: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(draw_seed(seed, position))
    return generator


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token with probability probs[i] / sum(probs) (an exponential race)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def _residual(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """What to draw from after rejecting ``token``: max(p - q, 0), unnormalised (q None:
    a point mass on the token)."""
    if q is None:
        residual = p.clone()
        residual[token] = 0.0
    else:
        residual = (p - q).clamp_min(0.0)
    if float(residual.sum()) <= 0.0:  # p == q up to rounding: p itself is the residual
        return p
    return residual


def accepted_sampled(
    p: torch.Tensor,
    proposed: list[int],
    seed: int,
    first_position: int,
    q: torch.Tensor | None = None,
) -> list[int]:
    """The tokens emitted by rejection sampling. p: [k + 1, V] target probabilities;
    q: [k, V] the draft's, or None for a deterministic proposer (point masses);
    ``first_position`` is the output position of the first proposal (its draws' seed)."""
    k = len(proposed)
    assert p.shape[0] == k + 1, (p.shape, k)
    assert q is None or q.shape[0] == k, (None if q is None else q.shape, k)
    for i, token in enumerate(proposed):
        generator = _generator(seed, first_position + i)
        p_x = float(p[i, token])
        q_x = 1.0 if q is None else float(q[i, token])
        u = float(torch.rand((), generator=generator))
        if q_x > 0 and u * q_x < p_x:  # u < p_x / q_x, without dividing by a tiny q_x
            continue
        return [
            *proposed[:i],
            _draw(_residual(p[i], None if q is None else q[i], token), generator),
        ]
    return [*proposed, _draw(p[k], _generator(seed, first_position + k))]
