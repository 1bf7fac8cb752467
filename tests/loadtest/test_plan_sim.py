"""The plan simulator on small deterministic cases: one request's latencies are the
profile's, a batch steps at the profile's step time, every request finishes once, role
changes lose nothing, shared cores slow both workers, the windows the planner reads."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from common.planner.hosting import Hosting
from common.planner.policy import Planner, PlannerConfig
from common.planner.types import Split, Targets
from loadtest.plan_sim.calibrate import load_run
from loadtest.plan_sim.cluster import Cluster, ClusterConfig
from loadtest.plan_sim.events import EventLoop
from loadtest.plan_sim.observe import WindowRecorder
from loadtest.plan_sim.report import fixed_split_search
from loadtest.plan_sim.run import RunResult, simulate
from loadtest.plan_sim.workload import SimRequest, Workload, load_shift, mooncake
from tests.unit.planner_loads import fitted_profile

# Prefill: 10 ms + 0.5 ms a token; a step: 4 ms + 0.25 ms a row + 0.001 ms a context token.
PROFILE = fitted_profile((10.0, 0.5, 0.0), (4.0, 0.25, 0.001), max_num_batched_tokens=1024)
NO_SLA = Targets(1e9, 1e9)
CONFIG = ClusterConfig(kv_transfer_base_ms=2.0, kv_transfer_ms_per_token=0.01)


def _run(requests: list[SimRequest], split: Split, **kwargs: object) -> RunResult:
    workload = Workload("test", tuple(requests), 60.0)
    config = kwargs.pop("config", CONFIG)
    return simulate(workload, PROFILE, config, NO_SLA, split, **kwargs)  # type: ignore[arg-type]


def test_one_request_alone_takes_the_profiles_prefill_and_step_times() -> None:
    r = _run([SimRequest(0, 1.0, 600, 11)], Split(1, 1))
    assert r.ttft_ms[0] == pytest.approx(PROFILE.prefill_ms(600))
    # The first gap: the KV transfer, then ten steps of one row whose context grows.
    transfer = 2.0 + 0.01 * 600
    steps = [PROFILE.decode_step_ms(1, 600 + k) for k in range(10)]
    assert r.itl_ms[0] == pytest.approx((transfer + sum(steps)) / 10)
    local = _run([SimRequest(0, 1.0, 600, 11)], Split(0, 1))
    assert local.ttft_ms[0] == pytest.approx(PROFILE.prefill_ms(600))
    assert local.itl_ms[0] == pytest.approx(sum(steps) / 10)


def test_a_long_prompt_is_chunked_and_still_takes_its_prefill_time() -> None:
    r = _run([SimRequest(0, 0.0, 3000, 1)], Split(1, 1))  # three chunks of <= 1024
    assert r.ttft_ms[0] == pytest.approx(PROFILE.prefill_ms(3000))


def test_a_batch_decodes_at_the_step_time_of_its_rows() -> None:
    # Eight 40-token prompts at once on an idle worker: the first starts a step alone
    # (30 ms); the other seven are prefilled in the next, beside its first decode row.
    r = _run([SimRequest(i, 0.0, 40, 21) for i in range(8)], Split(0, 1))
    second_step = (4.0 + 0.25 + 0.001 * 40) + 7 * 0.5 * 40 + (10.0 - 4.0)  # + bases' gap
    assert r.ttft_ms[0] == pytest.approx(30.0)
    assert r.ttft_ms[1:] == pytest.approx(np.full(7, 30.0 + second_step))
    # Then 8 rows step together (contexts: 41 + 7 x 40 = 321 tokens, growing 8 a step)
    # until the first ends after its 20th token; the seven take one more step alone.
    eight = [4.0 + 0.25 * 8 + 0.001 * (321 + 8 * k) for k in range(19)]
    seven = 4.0 + 0.25 * 7 + 0.001 * (321 + 8 * 19 - (40 + 20))
    assert r.itl_ms[1:] == pytest.approx(np.full(7, (sum(eight) + seven) / 20))


def test_kv_capacity_makes_a_request_wait_for_another_to_finish() -> None:
    small = fitted_profile((10.0, 0.5, 0.0), (4.0, 0.25, 0.001), num_kv_blocks=40)  # 640
    workload = Workload("kv", (SimRequest(0, 0.0, 300, 100), SimRequest(1, 0.0, 300, 100)), 5.0)
    r = simulate(workload, small, CONFIG, NO_SLA, Split(0, 1))
    # The second does not fit beside the first (2 x 400 > 640): it starts when it ends.
    first_done = r.ttft_ms[0] + 99 * r.itl_ms[0]
    assert r.ttft_ms[1] > first_done


def test_every_request_finishes_once_through_role_changes_and_scaling() -> None:
    rng = np.random.default_rng(5)
    requests = [
        SimRequest(i, float(t), int(rng.integers(20, 2000)), int(rng.integers(1, 200)))
        for i, t in enumerate(np.sort(rng.uniform(0, 40, size=300)))
    ]
    loop = EventLoop()
    cluster = Cluster(PROFILE, CONFIG, 16, loop)
    for role in ("prefill", "decode", "decode"):
        cluster.add_worker(role, 0.0)
    done: list[int] = []
    original = cluster._done

    def count(request: object) -> None:
        done.append(request.spec.request_id)  # type: ignore[attr-defined]
        original(request)  # type: ignore[arg-type]

    cluster._done = count  # type: ignore[method-assign]
    for spec in requests:
        loop.at(spec.arrival_s, cluster.arrive, spec)
    for at, split in ((10.0, Split(0, 3)), (20.0, Split(2, 1)), (25.0, Split(1, 4)),
                      (30.0, Split(0, 2))):  # fmt: skip
        loop.at(at, cluster.apply, split)
    loop.run_until(600.0)
    assert sorted(done) == list(range(300))
    assert cluster.num_role_changes > 0


def test_a_decode_worker_switched_to_prefill_hands_its_streams_on() -> None:
    requests = [SimRequest(i, 0.1 * i, 200, 400) for i in range(20)]
    r = _run(requests, Split(0, 2), changes=[(2.0, Split(1, 1))])
    assert not np.isnan(r.itl_ms).any()
    assert r.num_migrations > 0
    assert r.num_role_changes == 1


def test_workers_sharing_cores_run_at_the_hosts_speed() -> None:
    shared = ClusterConfig(hosting=Hosting(cores_per_host=2, threads_per_worker=2,
                                           workers_per_host=2))  # fmt: skip
    both = [SimRequest(0, 0.0, 1000, 1), SimRequest(1, 0.0, 1000, 1)]
    r = _run(both, Split(0, 2), config=shared)
    # Each on its own worker, both computing at once at half speed.
    assert r.ttft_ms == pytest.approx(np.full(2, 2 * PROFILE.prefill_ms(1000)))
    alone = _run(both[:1], Split(0, 2), config=shared)
    assert alone.ttft_ms[0] == pytest.approx(PROFILE.prefill_ms(1000))


def test_a_full_queue_refuses_the_request() -> None:
    tight = ClusterConfig(max_waiting=2)
    requests = [SimRequest(i, 0.0, 500, 2) for i in range(10)]
    small = fitted_profile((10.0, 0.5, 0.0), (4.0, 0.25, 0.001), max_num_seqs=2)
    r = simulate(Workload("q", tuple(requests), 5.0), small, tight, NO_SLA, Split(0, 1))
    assert r.num_rejected == 7  # 1 running at once, 2 waiting for the next step


def test_prefix_hits_shorten_the_prefill_on_the_worker_holding_them() -> None:
    blocks = tuple(range(8))
    requests = [SimRequest(0, 0.0, 128, 1, blocks), SimRequest(1, 5.0, 128, 1, blocks)]
    r = _run(requests, Split(1, 1))
    assert r.ttft_ms[1] == pytest.approx(PROFILE.prefill_ms(128, 127))


def test_the_window_is_what_prometheus_would_show() -> None:
    recorder = WindowRecorder(0.0)
    for prompt, cached in ((100, 0), (1000, 500), (1000, 500)):
        recorder.routed(prompt, cached)
    recorder.first_token(120.0)
    recorder.first_token(900.0)
    recorder.finished(11, 20.0)
    w = recorder.window(30.0, num_waiting=4)
    assert (w.num_arrivals, w.num_waiting, w.arrival_rate) == (3, 4, pytest.approx(0.1))
    assert w.prefix_hit_rate == pytest.approx(1000 / 2100)
    assert w.prompt_tokens.mean() == pytest.approx(700)  # the exact mean, from the sum
    assert w.prompt_tokens.total_weight == 3
    assert w.ttft_ms.mean() == pytest.approx(510)
    assert w.itl_ms.total_weight == 10  # one observation per token after the first
    assert recorder.window(60.0, 0).num_arrivals == 0  # the next window starts empty


def test_the_planner_in_the_loop_follows_a_shift() -> None:
    workload = load_shift(4.0, phase_s=300, cycles=1, a=(400, 4), b=(20, 200))
    targets = Targets(1000, 30)
    planner = Planner(PROFILE, targets, PlannerConfig(
        min_workers=4, max_workers=4, fixed_total=True,
    ))  # fmt: skip
    r = simulate(workload, PROFILE, CONFIG, targets, Split(2, 2), planner=planner)
    assert r.decisions and len(r.decisions) == 19
    assert r.attainment > 0.9
    assert r.worker_seconds == pytest.approx(4 * 600)


def test_fixed_split_search_finds_the_peak_of_a_unimodal_goodput() -> None:
    visited: list[int] = []

    def run(split: Split) -> RunResult:
        visited.append(split.prefill)
        result = RunResult("x", NO_SLA, 1.0, 1.0, np.zeros(1), np.zeros(1), np.zeros(1), [""])
        result.worker_seconds = 1.0 + abs(split.prefill - 77)  # goodput peaks at 77
        return result

    results = fixed_split_search(128, run)
    assert max(results, key=lambda p: results[p].goodput_per_worker_hour) == 77
    assert len(visited) == len(set(visited)) < 30


def test_mooncake_overlays_copies_sharing_only_the_system_prompt() -> None:
    one = mooncake(rate_scale=1.0, block_tokens=16)
    two = mooncake(rate_scale=2.0, block_tokens=16)
    assert len(one.requests) == 12031
    assert len(two.requests) == 2 * 12031
    firsts = {r.blocks[0] for r in two.requests}
    assert firsts == {0}
    copies = {b // 10_000_000 for r in two.requests for b in r.blocks[1:]}
    assert copies == {0, 1}
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(two.requests))


def test_a_recorded_run_loads_with_its_phases_and_changes(tmp_path: Path) -> None:
    run = {
        "cores": 2, "threads_per_worker": 2, "workers_per_host": 2, "profile": "cpu",
        "phases": [
            {"name": "A", "start_s": 0, "end_s": 10, "split": {"prefill": 1, "decode": 1}},
            {"name": "B", "start_s": 10, "end_s": 20, "split": {"prefill": 0, "decode": 2}},
        ],
        "requests": [
            {"arrival_s": 12.0, "prompt_tokens": 50, "cached_tokens": 16, "output_tokens": 9,
             "ttft_ms": 60.0, "itl_ms": 7.0},
            {"arrival_s": 1.0, "prompt_tokens": 1500, "cached_tokens": 0, "output_tokens": 8,
             "ttft_ms": 1900.0, "itl_ms": 15.0},
        ],
    }  # fmt: skip
    path = tmp_path / "RUN.json"
    path.write_text(json.dumps(run))
    _, workload, changes, initial = load_run(path)
    assert initial == Split(1, 1)
    assert changes == [(10.0, Split(0, 2))]
    assert [(r.arrival_s, r.phase, r.cached_tokens) for r in workload.requests] == [
        (1.0, "A", 0), (12.0, "B", 16),
    ]  # fmt: skip


def test_what_the_live_bench_records_is_what_calibration_reads(tmp_path: Path) -> None:
    """loadtest/bench_planner.py's RUN.json (the planner's changes as seen live) loads."""
    import argparse

    from loadtest.bench_planner import Result, record

    args = argparse.Namespace(
        threads=1, workers=2, profile="profile-t1.json", local_prefill_tokens=16,
        ttft_ms=10000.0, itl_ms=30.0, phase_s=120.0,
    )  # fmt: skip
    result = Result("planner", splits=[(0.6, Split(1, 1)), (16.8, Split(0, 2))])
    result.requests = [
        {"phase": "A", "arrival_s": 3.2, "prompt_tokens": 1500, "cached_tokens": 0,
         "output_tokens": 8, "ttft_ms": 3154.0, "itl_ms": 67.4, "ok": 1, "error": ""},
        {"phase": "B", "arrival_s": 121.0, "prompt_tokens": 50, "cached_tokens": 0,
         "output_tokens": 256, "ttft_ms": 118.0, "itl_ms": 15.3, "ok": 1, "error": ""},
    ]  # fmt: skip
    record(result, args, tmp_path, Split(1, 1))
    raw, workload, changes, initial = load_run(tmp_path / "run-planner.json")
    assert initial == Split(1, 1) and changes == [(16.8, Split(0, 2))]
    assert raw["profile"] == "profile-t1.json"
    assert [(r.phase, r.prompt_tokens) for r in workload.requests] == [("A", 1500), ("B", 50)]
