"""The EPLB-style placement planner: load vectors whose best plan is known, and properties
that hold for every load (hypothesis)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.experts.planner import Plan, contiguous_placement, plan_placement
from common.experts.stats import coefficient_of_variation, hottest, imbalance, trend


def check_plan(plan: Plan, load: list[float]) -> None:
    """What every plan must satisfy, whatever the load."""
    num_experts, num_devices = len(load), plan.num_devices
    assert len(plan.placement) == num_devices
    assert all(len(slots) <= plan.slots_per_device for slots in plan.placement)
    assert plan.num_replicas <= num_experts + plan.num_redundant  # never more than the slots
    assert plan.num_devices * plan.slots_per_device >= num_experts + plan.num_redundant
    placed = Counter(e for slots in plan.placement for e in slots)
    assert set(placed) == set(range(num_experts))  # every expert somewhere
    assert [placed[e] for e in range(num_experts)] == plan.replicas
    assert all(c <= num_devices for c in plan.replicas)
    # Device load = its replicas' even share of their expert's load; nothing lost or made up.
    for d, slots in enumerate(plan.placement):
        expected = sum(load[e] / plan.replicas[e] for e in slots)
        assert plan.load_after[d] == pytest.approx(expected, rel=1e-9, abs=1e-9)
    assert sum(plan.load_after) == pytest.approx(sum(load), rel=1e-9, abs=1e-9)
    assert sum(plan.load_before) == pytest.approx(sum(load), rel=1e-9, abs=1e-9)
    # Never worse balanced than the unreplicated contiguous placement.
    assert max(plan.load_after) <= max(plan.load_before) * (1 + 1e-9) + 1e-9
    assert plan.balance_after <= plan.balance_before + 1e-9
    if plan.distinct_devices:
        assert all(len(set(slots)) == len(slots) for slots in plan.placement)


def test_contiguous_placement_spreads_experts_evenly() -> None:
    assert contiguous_placement(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert contiguous_placement(5, 2) == [[0, 1], [2, 3, 4]]
    assert contiguous_placement(2, 3) == [[], [0], [1]]


def test_even_load_needs_nothing() -> None:
    plan = plan_placement([10] * 8, num_devices=4, num_redundant=0)
    check_plan(plan, [10] * 8)
    assert plan.balance_before == plan.balance_after == 1.0
    assert plan.replicated() == {}


def test_one_hot_expert_is_split_over_every_device() -> None:
    """Expert 0 carries half the load: 4 replicas of it (a quarter each per device) and one
    more for an expert of 4, spread so every device carries exactly the mean, 6."""
    load = [12, 4, 4, 4]
    plan = plan_placement(load, num_devices=4, num_redundant=4)
    check_plan(plan, load)
    assert plan.balance_before == 2.0  # one expert per device: 12 against a mean of 6
    assert plan.balance_after == pytest.approx(1.0)
    assert plan.load_after == pytest.approx([6.0] * 4)
    assert plan.replicas[0] >= 3


def test_local_search_beats_plain_largest_first() -> None:
    """[2,2,2,3,3] on 2 devices of 3 slots: largest-first gives {3,2,2} / {3,2} = 7 / 5;
    the best is {2,2,2} / {3,3} = 6 / 6."""
    load = [2, 2, 2, 3, 3]
    plan = plan_placement(load, num_devices=2, num_redundant=0)
    check_plan(plan, load)
    assert sorted(plan.load_after) == [6.0, 6.0]
    assert sorted(map(sorted, plan.placement)) == [[0, 1, 2], [3, 4]]


def test_two_heavy_experts_go_to_different_devices() -> None:
    """Without redundancy, the two experts of 8 must be apart: the best maximum is 8 + 1."""
    load = [8, 8, 1, 1, 1, 1, 1, 1]
    plan = plan_placement(load, num_devices=4, num_redundant=0)
    check_plan(plan, load)
    assert plan.load_before[0] == 16  # contiguous: both on device 0
    assert max(plan.load_after) == 9
    assert plan.devices_of(0) != plan.devices_of(1)


def test_replicas_follow_the_load() -> None:
    """One slot per device spare, two hot experts: each hot one gets the extra replicas,
    the cold ones none."""
    load = [40, 40, 5, 5, 5, 5, 5, 5]
    plan = plan_placement(load, num_devices=4, num_redundant=4)
    check_plan(plan, load)
    assert set(plan.replicated()) == {0, 1}
    assert plan.balance_after < plan.balance_before
    assert plan.balance_after == pytest.approx(max(plan.load_after) / (sum(load) / 4))


def test_distinct_devices_split_a_hot_expert_without_duplicates() -> None:
    """Expert 0 is half the load: one replica on each device, the rest packed around it so
    both devices carry the mean, 6; no device holds an expert twice."""
    load = [6, 2, 2, 2]
    plan = plan_placement(load, num_devices=2, num_redundant=2, distinct_devices=True)
    check_plan(plan, load)
    assert plan.devices_of(0) == [0, 1]
    assert plan.load_after == pytest.approx([6.0, 6.0])


def test_without_distinct_devices_a_device_may_take_two_replicas() -> None:
    """[12, 4, 4, 4] on 4 devices of 2 slots: 4 replicas of expert 0 (3 each) and 2 of
    expert 1 (2 each) balance exactly only with two replicas of expert 0 sharing a device;
    with distinct devices the same greedy replication cannot, and says so in its figures."""
    load = [12, 4, 4, 4]
    shared = plan_placement(load, num_devices=4, num_redundant=4)
    distinct = plan_placement(load, num_devices=4, num_redundant=4, distinct_devices=True)
    check_plan(shared, load)
    check_plan(distinct, load)
    assert shared.balance_after == pytest.approx(1.0)
    assert 1.0 <= distinct.balance_after < distinct.balance_before


def test_no_load_at_all_is_a_valid_plan() -> None:
    plan = plan_placement([0, 0, 0], num_devices=2, num_redundant=1)
    check_plan(plan, [0, 0, 0])
    assert plan.balance_before == plan.balance_after == 1.0


@pytest.mark.parametrize(
    ("load", "devices", "redundant"), [([], 1, 0), ([1, 2], 0, 0), ([1, 2], 2, -1), ([-1], 1, 0)]
)
def test_bad_input_is_refused(load: list[int], devices: int, redundant: int) -> None:
    with pytest.raises(ValueError):
        plan_placement(load, devices, redundant)


@settings(max_examples=150, deadline=None)
@given(
    load=st.lists(st.integers(min_value=0, max_value=10_000), min_size=1, max_size=24),
    devices=st.integers(min_value=1, max_value=8),
    redundant=st.integers(min_value=0, max_value=12),
    distinct=st.booleans(),
)
def test_plans_respect_slots_and_never_lose_balance(
    load: list[int], devices: int, redundant: int, distinct: bool
) -> None:
    plan = plan_placement(load, devices, redundant, distinct_devices=distinct)
    check_plan(plan, [float(w) for w in load])


@settings(max_examples=60, deadline=None)
@given(
    load=st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), min_size=2, max_size=64),
    devices=st.sampled_from([2, 4, 8]),
    redundant=st.integers(min_value=0, max_value=16),
    distinct=st.booleans(),
)
def test_plans_hold_for_skewed_float_loads(
    load: list[float], devices: int, redundant: int, distinct: bool
) -> None:
    plan = plan_placement(load, devices, redundant, distinct_devices=distinct)
    check_plan(plan, load)


def test_imbalance_figures() -> None:
    assert imbalance([5, 5, 5, 5]) == 1.0
    assert imbalance([20, 0, 0, 0]) == 4.0
    assert imbalance([0, 0]) == 0.0
    assert coefficient_of_variation([5, 5]) == 0.0
    assert coefficient_of_variation([3, 1]) == pytest.approx(0.5)
    assert hottest([1, 9, 0, 5], top=2) == [
        {"expert": 1, "tokens": 9, "share": 0.6},
        {"expert": 3, "tokens": 5, "share": 0.3333},
    ]


def test_trend_compares_recent_windows_with_older_ones() -> None:
    windows = [[5, 5], [5, 5], [0, 0], [9, 1], [8, 2]]  # oldest first; the middle is skipped
    result = trend(windows, top=1)
    assert result["comparable"]
    assert result["imbalance_older"] == 1.0
    assert result["imbalance_recent"] == pytest.approx(1.7)
    assert result["experts"] == [
        {"expert": 0, "share_older": 0.5, "share_recent": 0.85, "change": 0.35}
    ]
    assert not trend([[1, 2]], top=1)["comparable"]
    # Windows before any traffic do not count as the older half.
    assert trend([[0, 0]] * 6 + [[5, 5], [9, 1]], top=1)["imbalance_older"] == 1.0
