"""How well rate forecasts predict the next interval, on the traces (``pdserve bench
plan-sim --forecast-eval``): one-step-ahead mean absolute error relative to the mean rate,
for the last value, a moving average, an exponential average, Holt's trend undamped and
the planner's damped Holt (common/planner/forecast.py).

Series: the Mooncake hour in 30 s and 60 s windows (Poisson noise on a slow rise), and a
synthetic one: Poisson counts at a rate that steps up 2.5x and back down, then ramps up.
For the step, also the windows until the forecast is within 10 % of the new rate.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from common.planner.forecast import ForecastConfig, Forecaster
from common.planner.types import LoadWindow
from loadtest.datasets.mooncake import DEFAULT_TRACE, read_trace

Method = Callable[[list[float]], float]  # the rates so far -> the next one


def _last(history: list[float]) -> float:
    return history[-1]


def _moving_average(history: list[float]) -> float:
    return float(np.mean(history[-4:]))


def _ewma(history: list[float]) -> float:
    level = history[0]
    for x in history[1:]:
        level = 0.5 * x + 0.5 * level
    return level


def _holt(damping: float) -> Method:
    def forecast(history: list[float]) -> float:
        f = Forecaster(ForecastConfig(trend_damping=damping))
        for i, rate in enumerate(history):
            f.observe(LoadWindow(i, i + 1, round(rate)))
        return f.rate()

    return forecast


METHODS: dict[str, Method] = {
    "last value": _last,
    "moving average (4)": _moving_average,
    "exponential (0.5)": _ewma,
    "Holt, no damping": _holt(1.0),
    "Holt, damped 0.8 (planner)": _holt(0.8),
}


def mooncake_series(window_s: float) -> list[float]:
    """Arrivals per window of the trace (one window's rate, in requests/window)."""
    stamps = np.array([row.timestamp_ms / 1000 for row in read_trace(DEFAULT_TRACE)])
    counts = np.bincount((stamps // window_s).astype(int))
    return [float(c) for c in counts[:-1]]  # the last window is partial


def step_series(seed: int = 0) -> tuple[list[float], int]:
    """40 windows at 100, 40 at 250, 40 at 100, then a ramp to 300 over 40; Poisson."""
    rng = np.random.default_rng(seed)
    rates = [100.0] * 40 + [250.0] * 40 + [100.0] * 40 + list(np.linspace(100, 300, 40))
    return [float(rng.poisson(r)) for r in rates], 40


def errors(series: list[float], method: Method, warmup: int = 4) -> float:
    """Mean |forecast - actual| over the mean, one step ahead."""
    misses = [abs(method(series[:i]) - series[i]) for i in range(warmup, len(series))]
    return float(np.mean(misses)) / float(np.mean(series[warmup:]))


def windows_to_follow(series: list[float], step_at: int, method: Method) -> int:
    target = float(np.mean(series[step_at : step_at + 40]))
    for k in range(step_at + 1, len(series)):
        if abs(method(series[:k]) - target) <= 0.1 * target:
            return k - step_at
    return len(series) - step_at


def print_forecast_eval() -> None:
    series = {
        "mooncake 30 s": mooncake_series(30.0),
        "mooncake 60 s": mooncake_series(60.0),
    }
    step, step_at = step_series()
    series["step + ramp"] = step
    names = list(series)
    print(f"{'method':<28}" + "".join(f"{n:>16}" for n in names) + f"{'step follow':>13}")
    for name, method in METHODS.items():
        row = "".join(f"{errors(series[n], method):>16.3f}" for n in names)
        print(f"{name:<28}{row}{windows_to_follow(step, step_at, method):>13}")
    print("mean |error| / mean rate, one interval ahead; step follow: intervals until within "
          "10 % after a 2.5x step")  # fmt: skip
