"""What the next planning interval will bring, from the windows seen so far.

- Arrival rate: Holt's linear trend with a damped trend (Gardner and McKenzie). Load drifts
  (the Mooncake hour rises from about 2.7 to 3.9 requests/s, minute by minute) and steps
  (a campaign, a batch job); the last value alone carries each window's Poisson noise into
  the plan, a plain moving average lags every drift by half its span, and an undamped trend
  overshoots after a step. ``pdserve bench plan-sim --forecast-eval`` prints one-step-ahead
  errors of these on the traces (the figures are in loadtest/plan_sim/README.md).
- Prompt and output lengths: the windows' distributions blended (an exponential moving
  average of histograms), so the shape is kept, not only the mean; a window whose mean
  differs from the blend's by more than ``shift_ratio`` (with enough requests to tell) is
  a shift, not noise, and replaces the blend, so the plan follows it in one interval.
- Prefix hit rate: an exponential moving average, weighted by the prompt tokens seen.
- Backlog: requests queued now are work the next interval must do on top of its arrivals.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.planner.types import Distribution, LoadWindow

# A planner's windows keep at most this many points per length distribution: enough for
# the shape (tails included), few enough that the model prices each split fast.
MAX_DISTRIBUTION_POINTS = 24


@dataclass(frozen=True)
class LoadForecast:
    """The load a split is priced against."""

    arrival_rate: float  # requests/s
    prompt_tokens: Distribution
    output_tokens: Distribution
    prefix_hit_rate: float = 0.0
    backlog: int = 0  # requests already queued, to be served within the horizon

    @classmethod
    def of_window(cls, window: LoadWindow) -> LoadForecast:
        """The window's own load, unsmoothed: what the split in force was actually given."""
        return cls(
            window.arrival_rate,
            window.prompt_tokens.compact(MAX_DISTRIBUTION_POINTS),
            window.output_tokens.compact(MAX_DISTRIBUTION_POINTS),
            window.prefix_hit_rate,
            window.num_waiting,
        )

    @property
    def empty(self) -> bool:
        return self.arrival_rate <= 0 or self.prompt_tokens.empty or self.output_tokens.empty


@dataclass(frozen=True)
class ForecastConfig:
    level_smoothing: float = 0.4  # alpha: weight of the newest rate in the level
    trend_smoothing: float = 0.2  # beta: weight of the newest level change in the trend
    trend_damping: float = 0.8  # phi: how much of the trend carries into the next interval
    distribution_smoothing: float = 0.5  # weight of the newest window's lengths
    hit_rate_smoothing: float = 0.5
    shift_ratio: float = 2.0  # a window's mean length this far from the blend's is a shift
    shift_min_requests: int = 20

    def __post_init__(self) -> None:
        for name in (
            "level_smoothing", "trend_smoothing", "distribution_smoothing", "hit_rate_smoothing",
        ):  # fmt: skip
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        if not 0 <= self.trend_damping <= 1:
            raise ValueError(f"trend_damping must be in [0, 1], got {self.trend_damping}")
        if self.shift_ratio <= 1 or self.shift_min_requests < 1:
            raise ValueError("shift_ratio must be > 1 and shift_min_requests >= 1")


@dataclass
class Forecaster:
    config: ForecastConfig = field(default_factory=ForecastConfig)
    _level: float | None = None
    _trend: float = 0.0
    _prompt: Distribution = field(default_factory=Distribution)
    _output: Distribution = field(default_factory=Distribution)
    _hit_rate: float | None = None
    _backlog: int = 0

    def observe(self, window: LoadWindow) -> None:
        self._observe_rate(window.arrival_rate)
        c = self.config
        self._prompt = self._lengths(self._prompt, window.prompt_tokens)
        self._output = self._lengths(self._output, window.output_tokens)
        if window.num_arrivals > 0:
            if self._hit_rate is None:
                self._hit_rate = window.prefix_hit_rate
            else:
                a = c.hit_rate_smoothing
                self._hit_rate = a * window.prefix_hit_rate + (1 - a) * self._hit_rate
        self._backlog = window.num_waiting

    def _lengths(self, blended: Distribution, new: Distribution) -> Distribution:
        c = self.config
        if new.empty:  # a window without requests says nothing of lengths
            return blended
        shifted = (
            not blended.empty
            and new.total_weight >= c.shift_min_requests
            and max(new.mean(), 1e-9) / max(blended.mean(), 1e-9) not in _band(c.shift_ratio)
        )
        if shifted:
            return new.compact(MAX_DISTRIBUTION_POINTS)
        return blended.blend(new, c.distribution_smoothing).compact(MAX_DISTRIBUTION_POINTS)

    def _observe_rate(self, rate: float) -> None:
        c = self.config
        if self._level is None:
            self._level = rate
            return
        previous = self._level
        self._level = c.level_smoothing * rate + (1 - c.level_smoothing) * (
            previous + c.trend_damping * self._trend
        )
        self._trend = (
            c.trend_smoothing * (self._level - previous)
            + (1 - c.trend_smoothing) * c.trend_damping * self._trend
        )

    def rate(self) -> float:
        """The next interval's arrival rate (requests/s)."""
        if self._level is None:
            return 0.0
        return max(0.0, self._level + self.config.trend_damping * self._trend)

    def forecast(self) -> LoadForecast:
        return LoadForecast(
            self.rate(), self._prompt, self._output, self._hit_rate or 0.0, self._backlog
        )


class _band:
    """``x in _band(r)``: 1 / r <= x <= r."""

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio

    def __contains__(self, x: float) -> bool:
        return 1 / self.ratio <= x <= self.ratio
