"""Verification of proposed tokens against the target model's distributions.

Shapes: k = proposed tokens, V = vocab. The target computed k + 1 rows for a sequence:
row i is its distribution for the token after the context and the first i proposals, so
row k (all accepted) yields one more token, the "bonus".

- Greedy: the proposals are kept up to the first that is not the row's argmax; that row's
  argmax follows. The emitted tokens are exactly what k + 1 plain greedy steps would emit.
- Sampled (rejection sampling, Leviathan et al. 2023 / Chen et al. 2023): proposal x_i
  from a draft distribution q_i is accepted with probability min(1, p_i(x_i) / q_i(x_i));
  at the first rejection a token is drawn from norm(max(p_i - q_i, 0)) and the round ends.
  Every emitted token is then distributed as the target's p, whatever q is. Prompt lookup
  proposes deterministically: q_i is a point mass on x_i, so acceptance is p_i(x_i) and
  the residual is p_i without x_i.

``p`` rows must be the distributions the sampler would draw from (penalties, temperature,
top-k/top-p/min-p applied). Randomness is per output position (``draw_seed(seed,
position)``), so a seeded request's output is reproducible; it differs from the
non-speculative run's draws, as in every engine that speculates, but not in distribution.
"""

from __future__ import annotations

import torch

from common.engine.sampler import draw_seed


def accepted_greedy(target_argmax: list[int], proposed: list[int]) -> list[int]:
    """The tokens emitted: the accepted proposals, then the target's own token.
    ``target_argmax`` has one entry per verify row (len(proposed) + 1)."""
    assert len(target_argmax) == len(proposed) + 1, (len(target_argmax), len(proposed))
    for i, token in enumerate(proposed):
        if token != target_argmax[i]:
            return [*proposed[:i], target_argmax[i]]
    return [*proposed, target_argmax[-1]]


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
