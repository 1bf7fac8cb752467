"""The open-loop arrival process: mean rate, rescaling, burstiness, seeds."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from loadtest.arrival import arrival_offsets, trace_offsets


def test_last_send_lands_at_n_over_r_so_the_mean_rate_is_exact() -> None:
    for seed in range(5):
        offsets = arrival_offsets(500, request_rate=4.0, burstiness=1.0, seed=seed)
        assert len(offsets) == 500
        assert offsets[-1] == pytest.approx(125.0, abs=1e-9)  # 500 / 4
        assert all(b >= a for a, b in itertools.pairwise(offsets))
        gaps = np.diff([0.0, *offsets])
        assert gaps.mean() == pytest.approx(0.25, abs=1e-12)


def test_rescaling_stretches_the_raw_gamma_draws_by_one_factor() -> None:
    rng = np.random.default_rng(7)
    raw = np.cumsum(rng.gamma(shape=2.0, scale=1.0 / (3.0 * 2.0), size=40))
    offsets = np.asarray(arrival_offsets(40, request_rate=3.0, burstiness=2.0, seed=7))
    factor = (40 / 3.0) / raw[-1]
    np.testing.assert_allclose(offsets, raw * factor, rtol=1e-12)


def test_same_seed_same_schedule_other_seed_other_schedule() -> None:
    a = arrival_offsets(100, 2.0, 1.0, seed=3)
    assert a == arrival_offsets(100, 2.0, 1.0, seed=3)
    assert a != arrival_offsets(100, 2.0, 1.0, seed=4)


def test_burstiness_sets_the_spread_of_gaps() -> None:
    # Gamma gaps with shape k have a coefficient of variation of 1 / sqrt(k).
    def cv(burstiness: float) -> float:
        gaps = np.diff([0.0, *arrival_offsets(20000, 10.0, burstiness, seed=1)])
        return float(gaps.std() / gaps.mean())

    assert cv(1.0) == pytest.approx(1.0, abs=0.03)  # Poisson
    assert cv(4.0) == pytest.approx(0.5, abs=0.02)
    assert cv(0.25) == pytest.approx(2.0, abs=0.1)


def test_infinite_rate_sends_everything_at_once_and_infinite_burstiness_evenly() -> None:
    assert arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    assert arrival_offsets(4, 2.0, math.inf) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    assert arrival_offsets(0, 1.0) == []


def test_bad_arguments_are_refused() -> None:
    for kwargs in (
        {"request_rate": 0.0},
        {"request_rate": -1.0},
        {"request_rate": 1.0, "burstiness": 0.0},
    ):
        with pytest.raises(ValueError):
            arrival_offsets(3, **kwargs)  # type: ignore[arg-type]


def test_trace_offsets_are_relative_to_the_first_and_sped_up() -> None:
    assert trace_offsets([1000.0, 1000.0, 4000.0, 7000.0]) == [0.0, 0.0, 3.0, 6.0]
    assert trace_offsets([1000.0, 4000.0], speedup_ratio=2.0) == [0.0, 1.5]
    assert trace_offsets([0.0, 1000.0], speedup_ratio=0.5) == [0.0, 2.0]
    with pytest.raises(ValueError):
        trace_offsets([0.0], speedup_ratio=0.0)
