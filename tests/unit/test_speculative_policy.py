"""The adaptive speculative policy (common/engine/speculative/policy.py): the step-cost fit,
a request's kept rate, and how many guesses each is worth."""

from __future__ import annotations

import math

import pytest

from common.engine.speculative.policy import (
    PRIOR_ROW_FRACTION,
    Acceptance,
    StepCost,
    worth_verifying,
)


def test_the_step_cost_fit_recovers_a_line_and_follows_drift() -> None:
    cost = StepCost()
    for i in range(200):
        rows = 1 + i % 5
        cost.add(rows, 6.0 + 2.5 * rows)
    base, row = cost.line()
    assert base == pytest.approx(6.0) and row == pytest.approx(2.5)
    for i in range(200):  # the machine slows down: the fit follows
        rows = 1 + i % 5
        cost.add(rows, 9.0 + 4.0 * rows)
    base, row = cost.line()
    assert base == pytest.approx(9.0, rel=1e-3) and row == pytest.approx(4.0, rel=1e-3)


def test_one_row_count_alone_takes_the_prior_slope() -> None:
    cost = StepCost()
    for _ in range(10):
        cost.add(1, 10.0)
    base, row = cost.line()
    assert base + row == pytest.approx(10.0)
    assert row == pytest.approx(PRIOR_ROW_FRACTION * 10.0)
    assert not StepCost().known and StepCost().line() == (0.0, 0.0)


def test_the_kept_rate_follows_a_requests_rounds_and_drifts_back_when_idle() -> None:
    acc = Acceptance()
    prior = acc.rate
    assert 0.5 < prior < 1.0
    for _ in range(40):
        acc.add(4, 0)  # every first guess rejected
    assert acc.rate < 0.05
    for _ in range(200):
        acc.idle()
    assert acc.rate == pytest.approx(prior, abs=0.01)
    for _ in range(40):
        acc.add(4, 4)
    assert acc.rate > 0.97


def _cost(base: float, row: float) -> StepCost:
    cost = StepCost()
    for rows in (1, 2, 3, 4, 5) * 20:
        cost.add(rows, base + row * rows)
    return cost


@pytest.mark.parametrize(
    ("alpha", "batch", "base", "row", "want"),
    [
        (1.0, 1, 6.0, 2.0, 8),  # every guess kept: all
        (0.9, 1, 6.0, 2.0, 8),  # bound 2 / 8 = 0.25: 0.9^13 = 0.25, capped at 8
        (0.6, 1, 6.0, 2.0, 2),  # 0.6^2 = 0.36 >= 0.25 > 0.6^3
        (0.2, 1, 6.0, 2.0, 0),  # not even the first
        (0.9, 16, 6.0, 2.0, 1),  # 16 sequences: bound 32 / 38 = 0.84, 0.9 >= 0.84 > 0.81
        (0.99, 16, 0.0, 1.0, 0),  # rows are all the step costs: nothing pays
        (0.5, 16, 38.0, 0.0, 8),  # rows cost nothing (a GPU's small batch): all
    ],
)
def test_guesses_are_verified_while_they_beat_the_steps_own_rate(
    alpha: float, batch: int, base: float, row: float, want: int
) -> None:
    cost = _cost(base, row)
    assert worth_verifying(alpha, batch, cost, 8) == want
    if 0 < want < 8:  # the rule itself: alpha^j >= row * batch / step(batch)
        bound = row * batch / (base + row * batch)
        assert alpha**want >= bound > alpha ** (want + 1)
        assert want == math.floor(math.log(bound) / math.log(alpha))


def test_limits_and_unknown_costs() -> None:
    assert worth_verifying(0.9, 1, StepCost(), 5) == 5  # nothing measured yet: try them
    assert worth_verifying(0.9, 1, _cost(6.0, 2.0), 0) == 0
    assert worth_verifying(0.0, 1, _cost(6.0, 2.0), 4) == 0


def test_measured_row_counts_beat_the_line() -> None:
    """A cost that is no line (the second row dear, the fifth nearly free, as 4-row tiles
    make it): the k that saves most time, from each count's own mean."""
    cost = StepCost()
    table = {1: 10.0, 2: 14.7, 3: 16.0, 4: 18.0, 5: 18.5}
    for _ in range(5):
        for rows, ms in table.items():
            cost.add(rows, ms)
    assert [cost.ms(r) for r in table] == pytest.approx(list(table.values()))
    # alpha 0.5, 10 ms a token: k = 1 saves 5 - 4.7, k = 2 saves 7.5 - 6, k = 3 8.75 - 8,
    # k = 4 9.375 - 8.5: two guesses.
    assert worth_verifying(0.5, 1, cost, 4) == 2
    assert worth_verifying(0.3, 1, cost, 4) == 0  # none pays for its rows
    assert worth_verifying(0.95, 1, cost, 4) == 4


def test_a_batch_grants_its_best_guesses_first_while_rows_pay() -> None:
    """16 sequences at 6 + 2.2 ms a row (41.2 ms: 2.575 ms a token): a guess must be worth
    more than 2.2 / 2.575 = 0.854 of a token. Only the near-sure requests guess, and then
    only while alpha^j stays above that."""
    from common.engine.speculative.policy import allocate

    cost = _cost(6.0, 2.2)
    rates = [(0.99, 4), (0.5, 4), (0.95, 4)] + [(0.3, 4)] * 13
    granted = allocate(rates, 16, cost)
    assert granted[1] == 0 and all(g == 0 for g in granted[3:])
    assert granted[0] == 4 and granted[2] == 3  # 0.99^4 = 0.96; 0.95^3 = 0.857, ^4 0.815
    # One sequence (8.2 ms a token): 2.2 / 8.2 = 0.27, so 0.5 gets 1 (0.5^2 = 0.25).
    assert allocate(rates, 1, cost)[:3] == [4, 1, 4]


def test_a_large_batch_prices_its_rows_by_the_line_not_by_noisy_neighbours() -> None:
    """At 16 sequences the means of 16, 17 and 18 rows are a few noisy steps each (here one
    row looks free, the next dear); the rows are priced by the fitted line instead, so the
    grants follow alpha^j >= row * batch / step(batch) as on a clean line."""
    from common.engine.speculative.policy import LINE_BATCH, allocate

    cost = _cost(6.0, 2.2)
    for _ in range(StepCost.MIN_SEEN):
        cost.add(16, 6.0 + 2.2 * 16 + 1.0)
        cost.add(17, 6.0 + 2.2 * 16 - 0.8)  # "a free row"
        cost.add(18, 6.0 + 2.2 * 18 + 3.0)  # "a dear one"
    base, row = cost.line()
    bound = row * 16 / (base + row * 16)
    for alpha in (0.8, 0.9, 0.95, 0.99):
        want = min(4, math.floor(math.log(bound) / math.log(alpha)))
        assert allocate([(alpha, 4)] + [(0.0, 4)] * 15, 16, cost)[0] == want, alpha
    assert LINE_BATCH <= 16  # the batch above is one the line prices
