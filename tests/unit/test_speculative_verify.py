"""Verification of proposals (common/engine/speculative/verify.py): greedy exactness and
rejection sampling's output distribution."""

from __future__ import annotations

import random

import pytest
import torch

from common.engine.speculative import verify
from common.engine.speculative.verify import accepted, accepted_sampled


def test_greedy_keeps_the_proposals_up_to_the_first_miss_then_the_targets_token() -> None:
    assert accepted([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all, and the bonus
    assert accepted([5, 6, 7, 8], [5, 9, 7]) == [5, 6]  # 9 missed: the target's 6
    assert accepted([5, 6, 7, 8], [1, 6, 7]) == [5]
    assert accepted([4], []) == [4]  # nothing proposed: one plain step


@pytest.mark.parametrize("seed", range(30))
def test_greedy_emits_what_plain_greedy_steps_would(seed: int) -> None:
    # A context-dependent target: its argmax is a fixed function of the last token.
    rng = random.Random(seed)
    table = [rng.randrange(6) for _ in range(6)]
    context = [rng.randrange(6)]
    plain = list(context)
    for _ in range(40):
        plain.append(table[plain[-1]])
    spec = list(context)
    while len(spec) < len(plain):
        proposed = [rng.randrange(6) if rng.random() < 0.4 else table[spec[-1]]]
        for _ in range(rng.randint(0, 4)):
            proposed.append(table[proposed[-1]] if rng.random() < 0.7 else rng.randrange(6))
        rows = [table[t] for t in [spec[-1], *proposed]]
        spec += accepted(rows, proposed)
    assert spec[: len(plain)] == plain


def test_sampled_with_certain_targets_accepts_exactly_what_they_allow() -> None:
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert accepted_sampled(p, [1, 2], seed=3, first_position=0) == [1, 2, 0]
    assert accepted_sampled(p, [1, 0], seed=3, first_position=0) == [1, 2]  # 0 impossible
    assert accepted_sampled(p, [0, 2], seed=3, first_position=0) == [1]


def test_sampled_rounds_are_reproducible_by_seed_and_position() -> None:
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(4, 50), dim=-1)
    runs = {tuple(accepted_sampled(p, [1, 2, 3], seed=11, first_position=7)) for _ in range(5)}
    assert len(runs) == 1
    others = {tuple(accepted_sampled(p, [1, 2, 3], seed=s, first_position=7)) for s in range(40)}
    assert len(others) > 1


# The statistical test. A target whose distribution depends on the output position only
# (p_table[j] for position j) and a draft with its own (q_table[j]): generation runs in
# rounds (propose up to K tokens by drawing from q, verify, append what was emitted) for
# N positions, TRIALS times. Rejection sampling is exact iff each position's token is
# distributed as p_table[j], so each position's counts are compared with p_table[j] by a
# chi-square statistic. With V - 1 = 5 degrees of freedom, P(chi2 > 25) = 1.4e-4 for an
# exact sampler, so 8 positions x 2 draft kinds fail by chance with probability ~2e-3;
# the fixed seeds make the run deterministic anyway. A sampler that skipped the residual
# (drawing from p at a rejection) moves the statistic far past the bound (checked below).
V, K, N, TRIALS, BOUND = 6, 3, 8, 6000, 25.0


def _tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(2.0 * torch.randn(N + K + 1, V, generator=g), dim=-1)
    q = torch.softmax(2.0 * torch.randn(N + K + 1, V, generator=g), dim=-1)
    return p.double(), q.double()


def _counts(p: torch.Tensor, q: torch.Tensor | None, rounds_seed: int) -> torch.Tensor:
    rng = torch.Generator().manual_seed(rounds_seed)
    counts = torch.zeros(N, V)
    for trial in range(TRIALS):
        out: list[int] = []
        while len(out) < N:
            j = len(out)
            k = min(K, N - j)
            if q is None:  # deterministic proposer: a fixed guess per position
                proposed = [(j + i) % V for i in range(k)]
                draft = None
            else:
                draft = q[j : j + k]
                proposed = [int(torch.multinomial(draft[i], 1, generator=rng)) for i in range(k)]
            out += accepted_sampled(
                p[j : j + k + 1], proposed, seed=trial, first_position=j, q=draft
            )
        for j, token in enumerate(out[:N]):
            counts[j, token] += 1
    return counts


def _chi2(counts: torch.Tensor, p: torch.Tensor) -> list[float]:
    expected = p[:N] * TRIALS
    return [float(((counts[j] - expected[j]) ** 2 / expected[j]).sum()) for j in range(N)]


@pytest.mark.parametrize("draft", ["model", "lookup"])
def test_rejection_sampling_emits_the_targets_distribution(draft: str) -> None:
    p, q = _tables(seed=1)
    counts = _counts(p, q if draft == "model" else None, rounds_seed=2)
    stats = _chi2(counts, p)
    assert max(stats) < BOUND, stats


@pytest.mark.parametrize("draft", ["model", "lookup"])
def test_the_chi_square_check_catches_a_sampler_without_the_residual(
    draft: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Drawing from p itself after a rejection (the rejected token may come out again)
    # biases the output away from the proposals: the same check must fail. (Verifying a
    # drawn proposal as if it were a point mass would not be such a bug: accepting x with
    # probability p(x), else drawing from p without x, emits p whatever proposed x.)
    monkeypatch.setattr(verify, "_residual", lambda p, q, token: p)
    p, q = _tables(seed=1)
    counts = _counts(p, q if draft == "model" else None, rounds_seed=2)
    assert max(_chi2(counts, p)) > 4 * BOUND
