"""The planner's policy: from each interval's observed load to the split wanted next.

``Planner.decide`` runs four phases:

1. learn: the split in force is priced under the window's own load and compared with what
   it did (``feedback.py``); the correction applies to every split priced afterwards;
2. forecast: the next interval's load (``forecast.py``), the queue left waiting included;
3. search: the cheapest split (fewest workers) predicted to meet both targets at the
   model's percentile with no pool busier than ``max_utilization``; at equal cost the
   highest predicted attainment, near ties to the fewest prefill workers. When no split
   meets them: the highest attainment among the most workers, near ties to the least
   overloaded. Only splits that move no worker that entered its role within ``dwell_s``
   are searched (such workers may be stopped, not moved);
4. hysteresis:
   - the split in force holds while predicted within the targets widened by
     ``keep_tolerance`` for the arriving load (a queue left by a step drains by itself);
   - one that misses them is replaced at once by a better split, never by fewer workers
     (the window that shows a shift mixes both loads): a step change is followed in the
     interval after it shows;
   - fewer workers only when predicted within the targets less ``down_margin`` (the band
     between down and up is wider than a window's noise), after ``scale_down_intervals``
     intervals in a row (the largest of those splits);
   - a different split of the same total only when it gains ``min_improvement`` of
     attainment ``confirm_intervals`` intervals in a row, or is colocated at low load
     ``prefer_intervals`` intervals in a row.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from common.planner.feedback import Feedback, FeedbackConfig
from common.planner.forecast import ForecastConfig, Forecaster, LoadForecast
from common.planner.model import Estimate, ModelConfig, PerformanceModel, Prediction, Pricer
from common.planner.profile import WorkerProfile
from common.planner.types import DECODE, PREFILL, Decision, LoadWindow, Split, Targets

# Attainments this close are a tie (then fewer prefill workers win).
TIE_ATTAINMENT = 0.01


@dataclass(frozen=True)
class PlannerConfig:
    min_workers: int = 1
    max_workers: int = 8
    # Only roles change; the total stays at the split in force's (one machine's workers).
    fixed_total: bool = False
    dwell_s: float = 120.0  # a worker that entered a role keeps it at least this long
    scale_down_intervals: int = 3
    confirm_intervals: int = 2
    # Colocated winning a tie (no clear gain) against a disaggregated split of the same
    # total is taken once it was the answer this many intervals in a row.
    prefer_intervals: int = 6
    low_load: float = 0.5  # ... when colocated would be at most this busy
    min_improvement: float = 0.05  # attainment a same-cost change must gain
    keep_tolerance: float = 0.1  # the split in force holds within targets x (1 + this)
    down_margin: float = 0.2  # fewer workers only if predicted within targets x (1 - this)
    # A split meets the targets only with no pool busier than this.
    max_utilization: float = 0.85
    # A window starting this soon after a change shows the change, not the split: the
    # feedback skips it (role switches and worker starts take this long to settle).
    settle_s: float = 60.0
    model: ModelConfig = field(default_factory=ModelConfig)
    forecast: ForecastConfig = field(default_factory=ForecastConfig)
    feedback: FeedbackConfig = field(default_factory=FeedbackConfig)

    def __post_init__(self) -> None:
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError(
                f"need 1 <= min_workers <= max_workers, got {self.min_workers}, {self.max_workers}"
            )
        if self.dwell_s < 0:
            raise ValueError(f"dwell_s must be >= 0, got {self.dwell_s}")
        if min(self.scale_down_intervals, self.confirm_intervals, self.prefer_intervals) < 1:
            raise ValueError(
                "scale_down_intervals, confirm_intervals and prefer_intervals must be >= 1"
            )
        if not 0 <= self.min_improvement < 1:
            raise ValueError(f"min_improvement must be in [0, 1), got {self.min_improvement}")
        if self.keep_tolerance < 0 or not 0 <= self.down_margin < 1:
            raise ValueError(
                f"keep_tolerance must be >= 0 and down_margin in [0, 1), got "
                f"{self.keep_tolerance}, {self.down_margin}"
            )
        if not 0 < self.max_utilization <= 1:
            raise ValueError(f"max_utilization must be in (0, 1], got {self.max_utilization}")
        if self.settle_s < 0:
            raise ValueError(f"settle_s must be >= 0, got {self.settle_s}")


class Planner:
    def __init__(
        self, profile: WorkerProfile, targets: Targets, config: PlannerConfig | None = None
    ) -> None:
        self.targets = targets
        self.config = config or PlannerConfig()
        self.model = PerformanceModel(profile, self.config.model)
        self.forecaster = Forecaster(self.config.forecast)
        self.feedback = Feedback(self.config.feedback)
        self._entered: list[tuple[float, str, int]] = []  # (when, role, workers)
        self._wanted: deque[Split] = deque()  # the searches' answers since the last change
        self._last_change_s = -math.inf
        self.last_forecast: LoadForecast | None = None

    def decide(self, window: LoadWindow, current: Split, now_s: float) -> Decision:
        self._learn(window, current)
        self.forecaster.observe(window)
        load = self.forecaster.forecast()
        self.last_forecast = load
        if load.prompt_tokens.empty or load.output_tokens.empty:
            return Decision(current, 0.0, 0.0, True, "no request seen yet: nothing to plan")
        pricer = self.model.pricer(load, self.targets, self.feedback.correction)
        best, best_of = self._search(pricer, current, now_s)
        in_force = pricer.predict(current)
        misses = not self._within(in_force, self.config.keep_tolerance)
        if misses and load.backlog:
            # A queue left by a step or a change drains on its own when the split suits
            # the arriving load: changing roles for it would only move the queue about.
            steady = self.model.pricer(
                replace(load, backlog=0), self.targets, self.feedback.correction
            ).predict(current)
            misses = not self._within(steady, self.config.keep_tolerance)
        chosen, why = self._hysteresis(pricer, in_force, misses, best, best_of)
        if chosen != current:
            self._record_change(current, chosen, now_s)
            prediction = pricer.predict(chosen)
        else:
            prediction = in_force
        met = self._within(prediction, 0.0)
        return Decision(
            split=chosen,
            predicted_ttft_ms=prediction.ttft_ms,
            predicted_itl_ms=prediction.itl_ms,
            targets_met=met,
            reason=f"{why}; {self._describe(prediction, load)}",
            changed=chosen != current,
        )

    # -- 1. learn ---------------------------------------------------------------------------

    def _learn(self, window: LoadWindow, current: Split) -> None:
        steady = self.feedback.steady(window)
        # A window that saw a change of split mixes two splits' latencies.
        settled = window.start_s >= self._last_change_s + self.config.settle_s
        if not steady or not settled or window.num_arrivals == 0:
            return
        observed = LoadForecast.of_window(window)
        if observed.empty:
            return
        self.feedback.update(
            window,
            self.targets,
            lambda c: self.model.pricer(observed, self.targets, c).predict(current),
        )

    # -- 3. search --------------------------------------------------------------------------

    def _locked(self, now_s: float) -> dict[str, int]:
        """Workers per role that entered it within the dwell and must stay."""
        self._entered = [e for e in self._entered if now_s - e[0] < self.config.dwell_s]
        locked = {PREFILL: 0, DECODE: 0}
        for _, role, count in self._entered:
            locked[role] += count
        return locked

    def _search(
        self, pricer: Pricer, current: Split, now_s: float
    ) -> tuple[Estimate, Callable[[int], Estimate | None]]:
        """The best split, and the best of a given total (None: the dwell admits none)."""
        c = self.config
        locked = self._locked(now_s)
        # Workers move between roles before any starts or stops (the cheaper way to a
        # split): those that entered a role within the dwell may be stopped, not moved.
        movable_prefill = current.prefill - min(locked[PREFILL], current.prefill)
        movable_decode = current.decode - min(locked[DECODE], current.decode)

        def allowed(p: int, d: int) -> bool:
            to_decode = min(max(current.prefill - p, 0), max(d - current.decode, 0))
            to_prefill = min(max(current.decode - d, 0), max(p - current.prefill, 0))
            return to_decode <= movable_prefill and to_prefill <= movable_decode

        def best_of(total: int) -> Estimate | None:
            splits = [Split(p, total - p) for p in range(total) if allowed(p, total - p)]
            if not splits:
                return None
            return _best(
                [pricer.estimate(s) for s in splits], pricer.model.config.percentile,
                c.max_utilization,
            )  # fmt: skip

        if c.fixed_total:
            found = best_of(current.total)
            assert found is not None, f"{current} admits itself"
            return found, best_of
        q, u = pricer.model.config.percentile, c.max_utilization
        lo, hi = c.min_workers, c.max_workers
        largest = best_of(hi)
        assert largest is not None, "the largest total admits a split"
        if not largest.meets(q, u):
            return largest, best_of
        # More workers never price worse: the least total that meets is found by bisection.
        found = largest
        while lo < hi:
            mid = (lo + hi) // 2
            candidate = best_of(mid)
            if candidate is not None and candidate.meets(q, u):
                found, hi = candidate, mid
            else:
                lo = mid + 1
        return found, best_of

    # -- 4. hysteresis ----------------------------------------------------------------------

    def _within(self, prediction: Prediction, tolerance: float) -> bool:
        t = self.targets
        return prediction.ttft_ms <= t.ttft_ms * (
            1 + tolerance
        ) and prediction.itl_ms <= t.itl_ms * (1 + tolerance)

    def _hysteresis(
        self,
        pricer: Pricer,
        in_force: Prediction,
        misses: bool,
        best: Estimate,
        best_of: Callable[[int], Estimate | None],
    ) -> tuple[Split, str]:
        c = self.config
        current = in_force.split
        if best.split == current:
            self._wanted.clear()
            return current, f"hold {current}: the best split"
        # A split in force that misses is replaced at once, but never by fewer workers: the
        # window that shows a shift mixes both loads, and shrinking on it would leave the
        # new load short (fewer workers wait for confirmed intervals).
        if misses and best.split.total < current.total:
            best = best_of(current.total) or best
            if best.split == current:
                return current, f"hold {current}: it misses the targets, no split does better"
        wanted = best.split
        gain = best.attainment - in_force.estimate.attainment
        if misses:
            relieves = best.overload < in_force.estimate.overload / (1 + c.min_improvement)
            meets = best.meets(pricer.model.config.percentile, c.max_utilization)
            if meets or gain >= c.min_improvement or relieves:
                return wanted, f"change {current} -> {wanted}: {current} misses the targets"
            return current, f"hold {current}: it misses the targets, no split does better"
        if not self._within(in_force, c.keep_tolerance):
            self._wanted.clear()
            return current, f"hold {current}: it suits the arriving load; its queue drains"
        if wanted.total < current.total:
            # Fewer workers only with a margin below the targets, so that the next noisy
            # window does not call them back (the band between down and up).
            roomy = self._roomy(pricer, best_of, wanted.total, current.total)
            if roomy is None:
                self._wanted.clear()
                return current, f"hold {current}: fewer workers would leave no margin"
            wanted = roomy.split
        self._wanted.append(wanted)
        while len(self._wanted) > max(
            c.scale_down_intervals, c.confirm_intervals, c.prefer_intervals
        ):
            self._wanted.popleft()
        recent = list(self._wanted)
        if wanted.total < current.total:
            window = recent[-c.scale_down_intervals :]
            if len(window) == c.scale_down_intervals and all(
                s.total < current.total for s in window
            ):
                largest = max(window, key=lambda s: (s.total, s == wanted))
                return largest, (
                    f"scale down {current} -> {largest}: fewer workers suffice "
                    f"{c.scale_down_intervals} intervals in a row"
                )
            return current, f"hold {current}: {wanted} would do with fewer workers (not yet sure)"
        # Without a clear gain only colocated at low load is worth a move (it moves no KV
        # and takes any mix); otherwise the split in force stays: a move costs switches.
        prefers = wanted.colocated and not current.colocated and best.overload <= c.low_load
        if wanted.total == current.total and (gain >= c.min_improvement or prefers):
            confirm = c.confirm_intervals if gain >= c.min_improvement else c.prefer_intervals
            window = recent[-confirm:]
            if len(window) == confirm and all(s == wanted for s in window):
                return wanted, (
                    f"change {current} -> {wanted}: {gain:+.2f} attainment, preferred "
                    f"{confirm} intervals in a row"
                )
            return current, f"hold {current}: {wanted} looks better (not yet sure)"
        return current, f"hold {current}: within the targets"

    def _roomy(
        self,
        pricer: Pricer,
        best_of: Callable[[int], Estimate | None],
        lo: int,
        hi: int,
    ) -> Estimate | None:
        """The best split of the least total in [lo, hi) predicted within the targets less
        ``down_margin`` (None: none is)."""
        found = None
        while lo < hi:  # more workers never price worse: bisection
            mid = (lo + hi) // 2
            candidate = best_of(mid)
            if candidate is not None and self._within(
                pricer.predict(candidate.split), -self.config.down_margin
            ):
                found, hi = candidate, mid
            else:
                lo = mid + 1
        return found

    def _record_change(self, current: Split, chosen: Split, now_s: float) -> None:
        self._wanted.clear()
        self._last_change_s = now_s
        for role, before, after in (
            (PREFILL, current.prefill, chosen.prefill),
            (DECODE, current.decode, chosen.decode),
        ):
            if after > before:
                self._entered.append((now_s, role, after - before))

    # -- the decision's words ---------------------------------------------------------------

    def _describe(self, prediction: Prediction, load: LoadForecast) -> str:
        t, e = self.targets, prediction.estimate
        q = round(self.config.model.percentile * 100)
        parts = [
            _versus(f"ttft p{q}", prediction.ttft_ms, t.ttft_ms),
            _versus(f"itl p{q}", prediction.itl_ms, t.itl_ms),
            f"attainment {e.attainment:.2f}",
            f"load {load.arrival_rate:.2f} req/s, prompt mean {load.prompt_tokens.mean():.0f}, "
            f"output mean {load.output_tokens.mean():.0f}, hit {load.prefix_hit_rate:.2f}",
        ]
        if e.saturated:
            parts.append(f"saturated: {e.saturated}")
        correction = self.feedback.correction
        if (correction.prefill, correction.decode) != (1.0, 1.0):
            parts.append(
                f"correction prefill x{correction.prefill:.2f} decode x{correction.decode:.2f}"
            )
        return ", ".join(parts)


def _versus(name: str, predicted: float, target: float) -> str:
    if predicted <= target:
        return f"{name} {predicted:.0f} ms <= {target:.0f}"
    over = "inf" if math.isinf(predicted) else f"{(predicted / target - 1) * 100:.0f} %"
    return f"{name} {predicted:.0f} ms > {target:.0f} (misses by {over})"


def _best(estimates: list[Estimate], percentile: float, max_utilization: float) -> Estimate:
    """Among those meeting the targets: the highest attainment, near ties to the fewest
    prefill workers. When none meets them: the highest attainment, near ties to the least
    overloaded (a queue that drains sooner), then the fewest prefill workers."""
    meeting = [e for e in estimates if e.meets(percentile, max_utilization)]
    pool = meeting or estimates
    top = max(e.attainment for e in pool)
    near = [e for e in pool if e.attainment >= top - TIE_ATTAINMENT]
    if meeting:
        return min(near, key=lambda e: (e.split.prefill, -e.attainment))
    return min(near, key=lambda e: (round(e.overload, 2), e.split.prefill, -e.attainment))
