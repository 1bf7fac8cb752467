"""The planner's policy on synthetic loads: the split it wants, when it changes, and why.

Time is the windows' own clock (``now_s``): nothing sleeps.
"""

from __future__ import annotations

import numpy as np
import pytest

from common.planner.feedback import FeedbackConfig
from common.planner.model import ModelConfig
from common.planner.policy import Planner, PlannerConfig
from common.planner.types import Decision, Distribution, LoadWindow, Split, Targets
from tests.unit.planner_loads import INTERVAL_S, accelerator_profile, noisy_window, window

TARGETS = Targets(ttft_ms=600, itl_ms=25)
MODEL = ModelConfig(kv_transfer_ms_per_token=0.005)
LONG_PROMPTS = (1500, 8)  # tokens in, tokens out
LONG_OUTPUTS = (50, 256)


def _planner(**overrides: object) -> Planner:
    config = {"min_workers": 8, "max_workers": 8, "fixed_total": True, "model": MODEL}
    config.update(overrides)
    return Planner(accelerator_profile(), TARGETS, PlannerConfig(**config))  # type: ignore[arg-type]


class Drive:
    """Feeds a planner one window an interval and applies its decisions."""

    def __init__(self, planner: Planner, split: Split) -> None:
        self.planner = planner
        self.split = split
        self.now = 0.0
        self.decisions: list[Decision] = []

    def run(self, make: object, intervals: int) -> Split:
        for _ in range(intervals):
            w = make(self.now)  # type: ignore[operator]
            self.now += INTERVAL_S
            decision = self.planner.decide(w, self.split, self.now)
            self.decisions.append(decision)
            if decision.changed:
                self.split = decision.split
        return self.split

    def changes(self, since: int = 0) -> list[Decision]:
        return [d for d in self.decisions[since:] if d.changed]


def _steady(rate: float, shape: tuple[int, int]) -> object:
    return lambda t: window(t, rate, *shape)


def test_long_prompts_with_short_outputs_get_more_prefill_workers() -> None:
    prefill_heavy = Drive(_planner(), Split(4, 4)).run(_steady(45, LONG_PROMPTS), 10)
    decode_heavy = Drive(_planner(), Split(4, 4)).run(_steady(150, LONG_OUTPUTS), 10)
    assert prefill_heavy.prefill >= 6
    assert decode_heavy.decode >= 5
    assert prefill_heavy.prefill > decode_heavy.prefill


def test_low_load_gives_colocated() -> None:
    # The split in force meets the targets: colocated only wins the tie, so it takes
    # prefer_intervals to move, and then it stays.
    drive = Drive(_planner(), Split(4, 4))
    assert drive.run(_steady(1, LONG_PROMPTS), 12) == Split(0, 8)
    assert len(drive.changes()) == 1
    elastic = Drive(_planner(min_workers=1, fixed_total=False), Split(2, 2))
    assert elastic.run(_steady(1, LONG_OUTPUTS), 12) == Split(0, 1)


def test_a_step_change_is_followed_within_the_dwell() -> None:
    planner = _planner(dwell_s=120.0)
    drive = Drive(planner, Split(4, 4))
    before = drive.run(_steady(150, LONG_OUTPUTS), 12)
    assert before.decode >= 5
    step_at = len(drive.decisions)
    after = drive.run(_steady(45, LONG_PROMPTS), 8)
    assert after.prefill >= 6
    first = next(i for i, d in enumerate(drive.decisions[step_at:]) if d.changed)
    assert (first + 1) * INTERVAL_S <= planner.config.dwell_s


def test_a_step_back_right_after_a_change_waits_for_the_dwell_and_no_longer() -> None:
    planner = _planner(dwell_s=120.0)
    drive = Drive(planner, Split(1, 7))
    drive.run(_steady(45, LONG_PROMPTS), 1)  # the split in force misses: prefill grows
    assert drive.split.prefill >= 6
    changed_at = drive.now
    moved = drive.split.prefill - 1  # workers that just entered prefill
    back = Drive(planner, drive.split)
    back.now = drive.now
    for _ in range(10):
        back.run(_steady(150, LONG_OUTPUTS), 1)
        if back.now - changed_at < planner.config.dwell_s:
            # None of the workers that entered prefill leaves it within the dwell.
            assert back.split.prefill >= moved
    assert back.split.decode >= 5
    first = next(d for d in back.decisions if d.changed)
    assert first is not None
    when = INTERVAL_S * (back.decisions.index(first) + 1)
    assert when <= planner.config.dwell_s + INTERVAL_S


# Loads near a boundary between two splits.
@pytest.mark.parametrize("shape, rate", [(LONG_PROMPTS, 46), (LONG_OUTPUTS, 180)])
def test_noise_does_not_flap(shape: tuple[int, int], rate: float) -> None:
    rng = np.random.default_rng(11)

    def noisy(t: float) -> LoadWindow:
        return noisy_window(rng, t, rate, *shape)

    drive = Drive(_planner(), Split(4, 4))
    drive.run(noisy, 10)  # settles
    settled = drive.split
    drive.run(noisy, 200)
    later = drive.changes(10)
    # At most one late move (to colocated, once it won the tie long enough), never back.
    assert len(later) <= 1
    assert all(d.split != settled for d in later)


def test_without_hysteresis_the_same_noise_flaps() -> None:
    """The planner of test_noise_does_not_flap with its bands and confirmations off: the
    noise alone moves it back and forth (so that test can fail)."""
    rng = np.random.default_rng(11)
    eager = _planner(
        keep_tolerance=0.0, min_improvement=0.0, confirm_intervals=1, prefer_intervals=1,
        max_utilization=1.0, dwell_s=0.0, down_margin=0.0,
    )  # fmt: skip
    drive = Drive(eager, Split(4, 4))
    drive.run(lambda t: noisy_window(rng, t, 180, *LONG_OUTPUTS), 210)
    assert len(drive.changes()) > 5


def test_scale_down_waits_for_several_intervals_and_up_does_not() -> None:
    planner = _planner(min_workers=1, max_workers=16, fixed_total=False)
    drive = Drive(planner, Split(2, 2))
    up = drive.run(_steady(60, LONG_PROMPTS), 1)
    assert up.total > 4  # at once
    high = drive.run(_steady(60, LONG_PROMPTS), 6)
    start = len(drive.decisions)
    drive.run(_steady(5, LONG_PROMPTS), 12)
    downs = [i for i, d in enumerate(drive.decisions[start:]) if d.changed]
    assert downs and downs[0] + 1 >= planner.config.scale_down_intervals
    assert drive.split.total < high.total


def test_targets_no_split_meets_are_reported_and_the_best_plan_is_kept() -> None:
    planner = Planner(
        accelerator_profile(), Targets(ttft_ms=5, itl_ms=1),
        PlannerConfig(min_workers=8, max_workers=8, fixed_total=True, model=MODEL),
    )  # fmt: skip
    drive = Drive(planner, Split(4, 4))
    drive.run(_steady(20, LONG_PROMPTS), 6)
    last = drive.decisions[-1]
    assert not last.targets_met
    assert "ttft p90" in last.reason and "misses by" in last.reason
    assert "itl p90" in last.reason
    assert len(drive.changes()) <= 1  # moves to the best it has, then keeps it
    best = max(
        (planner.model.pricer(planner.last_forecast, planner.targets).estimate(Split(p, 8 - p))  # type: ignore[arg-type]
         for p in range(8)),
        key=lambda e: e.attainment,
    )  # fmt: skip
    assert (
        drive.split == best.split
        or best.attainment
        - (
            planner.model.pricer(planner.last_forecast, planner.targets).estimate(drive.split)  # type: ignore[arg-type]
        ).attainment
        < planner.config.min_improvement
    )


def _observed_slower(planner: Planner, split: Split, factor: float, intervals: int) -> None:
    """Windows whose latencies are ``factor`` x what the uncorrected model predicts."""
    load = window(0, 30, *LONG_PROMPTS)
    predicted = planner.model.predict(split, _as_load(load), TARGETS)
    for i in range(intervals):
        observed = window(
            i * INTERVAL_S, 30, *LONG_PROMPTS,
            ttft_ms=Distribution.of([predicted.mean_ttft_ms * factor], [900]),
            itl_ms=Distribution.of([predicted.mean_itl_ms * factor], [6300]),
        )  # fmt: skip
        planner.decide(observed, split, (i + 1) * INTERVAL_S)


def test_feedback_learns_a_slower_machine() -> None:
    planner = _planner(fixed_total=True)
    split = Split(6, 2)
    _observed_slower(planner, split, 1.8, 30)
    correction = planner.feedback.correction
    assert correction.prefill > 1.1 and correction.decode > 1.5
    # Corrected, the model now prices the split as it was observed.
    corrected = planner.model.predict(
        split, _as_load(window(0, 30, *LONG_PROMPTS)), TARGETS, correction
    )
    uncorrected = planner.model.predict(split, _as_load(window(0, 30, *LONG_PROMPTS)), TARGETS)
    # To within the feedback's deadband: 10 % of the target, or 10 %.
    ttft_band = max(0.1 * TARGETS.ttft_ms, 0.1 * 1.8 * uncorrected.mean_ttft_ms) * 1.05
    itl_band = max(0.1 * TARGETS.itl_ms, 0.1 * 1.8 * uncorrected.mean_itl_ms) * 1.05
    assert abs(corrected.mean_ttft_ms - 1.8 * uncorrected.mean_ttft_ms) <= ttft_band
    assert abs(corrected.mean_itl_ms - 1.8 * uncorrected.mean_itl_ms) <= itl_band


def test_feedback_stays_within_its_bounds() -> None:
    planner = _planner(feedback=FeedbackConfig(lower=0.8, upper=1.3))
    _observed_slower(planner, Split(6, 2), 5.0, 30)
    assert planner.feedback.correction.prefill == pytest.approx(1.3)
    assert planner.feedback.correction.decode == pytest.approx(1.3)
    fast = _planner(feedback=FeedbackConfig(lower=0.8, upper=1.3))
    _observed_slower(fast, Split(6, 2), 0.2, 30)
    assert fast.feedback.correction.prefill == pytest.approx(0.8)


def test_feedback_leaves_a_right_model_alone() -> None:
    planner = _planner()
    split = Split(6, 2)
    for i in range(20):
        load = window(i * INTERVAL_S, 30, *LONG_PROMPTS)
        p = planner.model.predict(split, _as_load(load), TARGETS, planner.feedback.correction)
        observed = window(
            i * INTERVAL_S, 30, *LONG_PROMPTS,
            ttft_ms=Distribution.of([p.mean_ttft_ms], [900]),
            itl_ms=Distribution.of([p.mean_itl_ms], [6300]),
        )  # fmt: skip
        planner.decide(observed, split, (i + 1) * INTERVAL_S)
    assert planner.feedback.correction.prefill == pytest.approx(1.0)
    assert planner.feedback.correction.decode == pytest.approx(1.0)


def test_no_request_seen_holds_the_split() -> None:
    decision = _planner().decide(LoadWindow(0, 30, 0), Split(3, 5), 30.0)
    assert decision.split == Split(3, 5) and not decision.changed


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_workers": 0},
        {"min_workers": 5, "max_workers": 4},
        {"dwell_s": -1},
        {"scale_down_intervals": 0},
        {"min_improvement": 1.0},
        {"max_utilization": 0.0},
        {"keep_tolerance": -0.1},
    ],
)
def test_config_is_validated(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        PlannerConfig(**kwargs)  # type: ignore[arg-type]


def _as_load(w: LoadWindow) -> object:
    from common.planner.forecast import LoadForecast

    return LoadForecast.of_window(w)
