"""Feedback: what the split in force did, against what the model predicts it would do under
the load it was actually given, corrects the model so that an error on a given machine
(a profile measured idle, a neighbour sharing the cores, a model simplification) does not
persist.

The correction is two multipliers on the profile's times (``Correction``): prefill times
learn from the mean time to first token, decode step times from the mean time per output
token. Means, not percentiles, because a Prometheus histogram gives the exact mean
(``_sum / _count``) but a percentile only to its bucket's width.

Each update is a damped Newton step in log space: the error ``log(observed / predicted)``
over the latency's sensitivity to its multiplier (``d log latency / d log multiplier``,
priced by moving the multiplier 10 %), times ``gain``. The sensitivity is what keeps a
multiplier from learning what it cannot explain: short prompts' time to first token is
mostly waiting for a decode step, so prefill times barely move it, and an error there is
left alone instead of being blamed on prefill (which would mislead the plan for long
prompts); near saturation a small change of speed moves latency a lot, and the step is
small. Differences within ``deadband`` (relative) or within ``deadband`` of the target
(absolute: 6 ms of error on a 30 ms TTFT under a 600 ms target changes no decision, and
learning it would skew long prompts' prices) are ignored, and the multipliers stay within
``[lower, upper]``: a wrong observation cannot drive the plan far.
Only steady windows teach: one whose load differs from the window before it by more than
``steady_change`` (a shift under way: latencies of one load, lengths of another) or one the
model prices as struggling (its overload and backlog prices are coarse) is skipped.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from common.planner.model import Prediction
from common.planner.pools import Correction
from common.planner.types import LoadWindow, Targets


@dataclass(frozen=True)
class FeedbackConfig:
    enabled: bool = True
    lower: float = 0.5
    upper: float = 2.0
    gain: float = 0.3
    deadband: float = 0.1
    min_samples: int = 20  # requests with a first token in the window
    min_sensitivity: float = 0.3  # a multiplier explaining less of its latency is left alone
    max_step: float = 1.25  # a multiplier moves at most this factor a window
    steady_change: float = 0.25  # rate and mean lengths within this of the last window's

    def __post_init__(self) -> None:
        if not 0 < self.lower <= 1 <= self.upper:
            raise ValueError(f"correction bounds must bracket 1, got {self.lower}, {self.upper}")
        if not 0 < self.gain <= 1:
            raise ValueError(f"feedback gain must be in (0, 1], got {self.gain}")
        if self.deadband < 0 or self.min_samples < 1 or self.max_step <= 1:
            raise ValueError("feedback deadband must be >= 0, min_samples >= 1 and max_step > 1")


class Feedback:
    def __init__(self, config: FeedbackConfig | None = None) -> None:
        self.config = config or FeedbackConfig()
        self.correction = Correction()
        self.last_ratios: tuple[float, float] = (1.0, 1.0)  # observed / predicted means
        self._last_load: tuple[float, float, float] | None = None
        self._queued_before = False  # the last window held a queue its split cannot explain

    def steady(self, window: LoadWindow) -> bool:
        """True when ``window``'s load is close to the one before it (remembered)."""
        load = (window.arrival_rate, window.prompt_tokens.mean(), window.output_tokens.mean())
        last, self._last_load = self._last_load, load
        if last is None:
            return False
        limit = self.config.steady_change
        return all(
            abs(now - before) <= limit * max(now, before)
            for now, before in zip(load, last, strict=True)
        )

    def update(
        self,
        window: LoadWindow,
        targets: Targets,
        predict: Callable[[Correction], Prediction],
    ) -> None:
        """``predict(correction)``: the split in force under ``window``'s own load. Call
        ``steady`` first for each window."""
        c = self.config
        if not c.enabled or window.ttft_ms.total_weight < c.min_samples:
            return
        predicted = predict(self.correction)
        observed_ttft, observed_itl = window.ttft_ms.mean(), window.itl_ms.mean()
        ttft_ratio = _ratio(observed_ttft, predicted.mean_ttft_ms)
        itl_ratio = _ratio(observed_itl, predicted.mean_itl_ms)
        if abs(observed_ttft - predicted.mean_ttft_ms) <= c.deadband * targets.ttft_ms:
            ttft_ratio = 1.0
        if abs(observed_itl - predicted.mean_itl_ms) <= c.deadband * targets.itl_ms:
            itl_ratio = 1.0
        if predicted.estimate.saturated or predicted.estimate.attainment < 0.5:
            # Overload is priced coarsely: only a split doing better than priced teaches
            # (else a wrong correction that prices everything as overloaded would stick).
            ttft_ratio, itl_ratio = min(ttft_ratio, 1.0), min(itl_ratio, 1.0)
        # A queue the split cannot explain comes from before (a step, a change); its
        # requests' first tokens land in this window and the next: neither teaches.
        queued = window.num_waiting > 2 * window.arrival_rate * predicted.mean_ttft_ms / 1000 + 10
        queued_before, self._queued_before = self._queued_before, queued
        if queued or queued_before:
            return
        self.last_ratios = (ttft_ratio, itl_ratio)
        current = self.correction
        if not _within(ttft_ratio, c.deadband):
            nudged = predict(replace(current, prefill=current.prefill * _NUDGE))
            sensitivity = _sensitivity(predicted.mean_ttft_ms, nudged.mean_ttft_ms)
            prefill = self._moved(current.prefill, ttft_ratio, sensitivity)
        else:
            prefill = current.prefill
        if not _within(itl_ratio, c.deadband):
            nudged = predict(replace(current, decode=current.decode * _NUDGE))
            sensitivity = _sensitivity(predicted.mean_itl_ms, nudged.mean_itl_ms)
            decode = self._moved(current.decode, itl_ratio, sensitivity)
        else:
            decode = current.decode
        self.correction = Correction(prefill, decode)

    def _moved(self, factor: float, ratio: float, sensitivity: float) -> float:
        c = self.config
        if sensitivity < c.min_sensitivity:
            return factor
        step = c.gain * math.log(ratio) / sensitivity
        limit = math.log(c.max_step)
        return min(max(factor * math.exp(min(max(step, -limit), limit)), c.lower), c.upper)


_NUDGE = 1.1


def _within(ratio: float, deadband: float) -> bool:
    return abs(math.log(ratio)) <= math.log1p(deadband)


def _sensitivity(base: float, nudged: float) -> float:
    """d log latency / d log multiplier, from a 10 % nudge."""
    if base <= 0 or nudged <= 0 or not (math.isfinite(base) and math.isfinite(nudged)):
        return 0.0
    return math.log(nudged / base) / math.log(_NUDGE)


def _ratio(observed: float, predicted: float) -> float:
    if observed <= 0 or predicted <= 0 or not math.isfinite(predicted):
        return 1.0
    return observed / predicted
