"""The planner's forecast: the rate (damped Holt), the length distributions and hit rate."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from common.planner.forecast import ForecastConfig, Forecaster, LoadForecast
from common.planner.types import Distribution, LoadWindow
from tests.unit.planner_loads import window


def _rates(forecaster: Forecaster, rates: list[float]) -> list[float]:
    """The forecast after each observed rate."""
    out = []
    for i, rate in enumerate(rates):
        forecaster.observe(window(i * 30.0, rate, 100, 10))
        out.append(forecaster.rate())
    return out


def test_a_constant_rate_is_forecast_as_itself() -> None:
    assert _rates(Forecaster(), [4.0] * 10)[-1] == pytest.approx(4.0, abs=1e-9)


def test_a_noisy_ramp_is_followed_closer_than_by_the_last_value() -> None:
    rng = np.random.default_rng(3)
    means = np.linspace(100, 300, 60)
    observed = [float(rng.poisson(m)) / 30 for m in means]  # Poisson counts in 30 s
    forecasts = _rates(Forecaster(), observed)
    # One step ahead: the forecast after window i against window i + 1.
    holt = np.mean([abs(f - r) for f, r in zip(forecasts[5:-1], observed[6:], strict=True)])
    last = np.mean([abs(a - b) for a, b in itertools.pairwise(observed[5:])])
    assert holt < 0.95 * last
    f = Forecaster()
    _rates(f, observed)
    assert f._trend > 0  # the rise is seen as a trend


def test_a_step_is_followed_within_four_intervals_and_the_damped_trend_dies_out() -> None:
    rates = [10.0] * 10 + [25.0] * 30
    forecasts = _rates(Forecaster(), rates)
    within = [i for i in range(10, 40) if abs(forecasts[i] - 25.0) <= 2.5]
    assert within and within[0] - 10 <= 3
    assert forecasts[-1] == pytest.approx(25.0, rel=0.01)


def test_lengths_blend_small_changes_and_take_a_shift_at_once() -> None:
    f = Forecaster(ForecastConfig(distribution_smoothing=0.5, shift_ratio=1.5))
    f.observe(window(0, 2.0, 1000, 10))
    f.observe(window(30, 2.0, 1200, 10))  # within 1.5x: blended
    assert f.forecast().prompt_tokens.mean() == pytest.approx(1100)
    f.observe(window(60, 2.0, 50, 10))  # 22x shorter, 60 requests: a shift
    assert f.forecast().prompt_tokens.mean() == pytest.approx(50)


def test_a_shift_needs_enough_requests_to_be_told_from_noise() -> None:
    f = Forecaster(ForecastConfig(shift_min_requests=20))
    f.observe(window(0, 2.0, 1000, 10))
    f.observe(window(30, 0.2, 50, 10))  # 6 requests: blended, not taken
    assert f.forecast().prompt_tokens.mean() == pytest.approx(525)


def test_a_window_without_requests_keeps_the_lengths_and_hit_rate() -> None:
    f = Forecaster()
    f.observe(window(0, 2.0, 800, 40, hit_rate=0.5))
    f.observe(LoadWindow(30, 60, 0))
    load = f.forecast()
    assert load.prompt_tokens.mean() == pytest.approx(800)
    assert load.output_tokens.mean() == pytest.approx(40)
    assert load.prefix_hit_rate == pytest.approx(0.5)
    assert load.arrival_rate < 2.0


def test_hit_rate_is_smoothed_and_the_backlog_is_the_last_windows() -> None:
    f = Forecaster(ForecastConfig(hit_rate_smoothing=0.5))
    f.observe(window(0, 2.0, 800, 40, hit_rate=0.2, waiting=7))
    f.observe(window(30, 2.0, 800, 40, hit_rate=0.6, waiting=3))
    load = f.forecast()
    assert load.prefix_hit_rate == pytest.approx(0.4)
    assert load.backlog == 3


def test_of_window_is_the_window_itself_with_compacted_lengths() -> None:
    w = LoadWindow(
        0, 10, 40, Distribution.of(range(1, 101)), Distribution.of([5, 5, 7]), 0.3, num_waiting=2
    )
    load = LoadForecast.of_window(w)
    assert load.arrival_rate == pytest.approx(4.0)
    assert len(load.prompt_tokens.values) <= 24
    assert load.prompt_tokens.mean() == pytest.approx(50.5)
    assert load.output_tokens.values == (5, 7)
    assert (load.prefix_hit_rate, load.backlog) == (0.3, 2)


def test_compact_keeps_the_mean_and_with_mean_rescales() -> None:
    d = Distribution.of([1, 2, 2, 3, 10, 20], [1, 1, 1, 1, 1, 5])
    merged = d.compact()
    assert merged.values == (1, 2, 3, 10, 20) and merged.weights == (1, 2, 1, 1, 5)
    small = d.compact(3)
    assert len(small.values) <= 3
    assert small.mean() == pytest.approx(d.mean())
    assert d.with_mean(2 * d.mean()).mean() == pytest.approx(2 * d.mean())


@pytest.mark.parametrize(
    "kwargs",
    [
        {"level_smoothing": 0.0},
        {"trend_smoothing": 1.5},
        {"trend_damping": -0.1},
        {"shift_ratio": 1.0},
        {"shift_min_requests": 0},
    ],
)
def test_config_is_validated(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ForecastConfig(**kwargs)  # type: ignore[arg-type]
