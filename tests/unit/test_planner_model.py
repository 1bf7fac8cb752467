"""The planner's performance model: what a split would do under a load."""

from __future__ import annotations

import math

import numpy as np
import pytest

from common.planner.forecast import LoadForecast
from common.planner.hosting import Hosting
from common.planner.model import ModelConfig, PerformanceModel
from common.planner.pools import Correction
from common.planner.queueing import binomial_cdf_table, erlang_b, erlang_c, mgc_wait, table_at
from common.planner.types import Distribution, Split, Targets
from tests.unit.planner_loads import accelerator_profile, fitted_profile

TARGETS = Targets(ttft_ms=600, itl_ms=25)


def _load(rate: float, prompt: float, output: float, hit: float = 0.0) -> LoadForecast:
    return LoadForecast(rate, Distribution.of([prompt]), Distribution.of([output]), hit)


def _model(**config: object) -> PerformanceModel:
    return PerformanceModel(accelerator_profile(), ModelConfig(**config))  # type: ignore[arg-type]


def test_a_lone_request_takes_its_prefill_then_decode_steps() -> None:
    model = _model()
    profile = model.profile
    tiny = _load(0.001, 1500, 8)
    disagg = model.predict(Split(1, 1), tiny, TARGETS)
    assert disagg.ttft_ms == pytest.approx(profile.prefill_ms(1500), rel=0.01)
    # The second token waits for the KV transfer and half a step: over 7 gaps.
    transfer = 2.0 + 0.03 * 1500
    step = profile.decode_step_ms(1, 1500 + 4)
    assert disagg.itl_ms == pytest.approx(step + (transfer + step / 2) / 7, rel=0.03)
    colocated = model.predict(Split(0, 1), tiny, TARGETS)
    assert colocated.itl_ms == pytest.approx(step, rel=0.03)


@pytest.mark.parametrize("split", [Split(0, 4), Split(1, 3), Split(3, 1)])
@pytest.mark.parametrize("shape", [(1500, 8), (50, 256), (4000, 64)])
def test_latencies_do_not_fall_as_load_rises(split: Split, shape: tuple[int, int]) -> None:
    model = _model()
    previous = (0.0, 0.0)
    for rate in (0.5, 2, 5, 10, 20, 30, 45, 60):
        p = model.predict(split, _load(rate, *shape), TARGETS)
        assert p.ttft_ms >= previous[0] * 0.999, (rate, p)
        assert p.itl_ms >= previous[1] * 0.999, (rate, p)
        previous = (p.ttft_ms, p.itl_ms)


def test_colocated_prefill_chunks_show_in_the_decode_streams_time_per_token() -> None:
    model = _model()
    long_prompts = _load(30, 2000, 64)
    colocated = model.predict(Split(0, 8), long_prompts, TARGETS)
    disaggregated = model.predict(Split(4, 4), long_prompts, TARGETS)
    assert colocated.itl_ms > 1.5 * disaggregated.itl_ms
    assert colocated.mean_itl_ms > disaggregated.mean_itl_ms
    # Short prompts ride in the steps almost for free: no such gap.
    short = _load(30, 40, 64)
    assert model.predict(Split(0, 8), short, TARGETS).itl_ms < 1.3 * (
        model.predict(Split(4, 4), short, TARGETS).itl_ms
    )


def test_prompts_under_the_local_threshold_never_reach_a_prefill_worker() -> None:
    model = _model(local_prefill_tokens=512)
    short = model.pricer(_load(20, 300, 64), TARGETS).estimate(Split(2, 2))
    assert short.prefill_utilization == 0.0
    long = model.pricer(_load(20, 3000, 64), TARGETS).estimate(Split(2, 2))
    assert long.prefill_utilization > 0.1
    # A prefix hit counts: 3000 tokens of which 2800 are cached are prefilled locally.
    cached = model.pricer(_load(20, 3000, 64, hit=0.95), TARGETS).estimate(Split(2, 2))
    assert cached.prefill_utilization == 0.0


def test_too_many_rows_for_max_num_seqs_saturate_the_decode_workers() -> None:
    model = PerformanceModel(
        fitted_profile((5, 0.05, 0), (10, 0.5, 0), max_num_seqs=8, num_kv_blocks=100_000)
    )
    light = model.pricer(_load(0.5, 100, 200), TARGETS).estimate(Split(1, 1))
    assert light.saturated == ""
    heavy = model.pricer(_load(20, 100, 200), TARGETS).estimate(Split(1, 1))
    assert "max_num_seqs" in heavy.saturated or "decode steps" in heavy.saturated
    assert heavy.decode_load > 1
    assert heavy.attainment < light.attainment


def test_the_kv_pool_caps_the_rows_a_decode_worker_holds() -> None:
    # 64 blocks of 16 tokens: 1024 tokens hold 2 rows of 300 + 200 at 90 %.
    model = PerformanceModel(fitted_profile((5, 0.05, 0), (10, 0.5, 0), num_kv_blocks=64))
    estimate = model.pricer(_load(5, 300, 200), TARGETS).estimate(Split(1, 1))
    assert estimate.decode_max_batch == pytest.approx(0.9 * 1024 / 500, rel=0.01)
    assert "KV" in estimate.saturated


def test_prefill_overload_is_priced_by_how_far_over_it_is() -> None:
    model = _model()
    over = [model.predict(Split(1, 1), _load(r, 1500, 8), TARGETS) for r in (10, 15, 20)]
    assert all("prefill" in p.estimate.saturated for p in over)
    assert all(math.isfinite(p.ttft_ms) for p in over)
    assert over[0].ttft_ms < over[1].ttft_ms < over[2].ttft_ms
    assert over[0].estimate.overload < over[2].estimate.overload


def test_workers_sharing_cores_slow_each_other_down() -> None:
    load = _load(1.5, 1000, 64)
    dedicated = _model().predict(Split(1, 1), load, TARGETS)
    shared = _model(hosting=Hosting(cores_per_host=2, threads_per_worker=2, workers_per_host=2))
    assert shared.predict(Split(1, 1), load, TARGETS).ttft_ms > dedicated.ttft_ms * 1.05


def test_a_correction_scales_the_profile_times() -> None:
    model = _model()
    load = _load(2, 1500, 64)
    base = model.predict(Split(1, 1), load, TARGETS)
    slow = model.predict(Split(1, 1), load, TARGETS, Correction(prefill=2.0, decode=2.0))
    assert slow.ttft_ms > 1.8 * base.ttft_ms
    assert slow.itl_ms > 1.8 * base.itl_ms


def test_attainment_is_the_share_within_both_targets() -> None:
    model = _model()
    p = model.predict(Split(2, 2), _load(10, 1500, 64), TARGETS)
    e = p.estimate
    assert e.attainment <= min(e.ttft_share, e.itl_share) + 1e-9
    assert e.meets(0.9) == (p.ttft_ms <= TARGETS.ttft_ms and p.itl_ms <= TARGETS.itl_ms)


def test_queueing_formulas() -> None:
    assert erlang_c(1, 0.5) == pytest.approx(0.5)
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert erlang_b(1, 1.0) == pytest.approx(0.5)
    assert erlang_b(0, 3.0) == 1.0
    # M/M/1 at rho 0.5, 100 ms service: waits w.p. 0.5, for 200 ms on average if so.
    wait, rho = mgc_wait(5.0, 100.0, 1.0, 1, 30.0)
    assert rho == pytest.approx(0.5)
    assert (wait.p_wait, wait.mean_if_waiting_ms) == pytest.approx((0.5, 200.0))
    # Deterministic service halves the wait (Pollaczek-Khinchine).
    assert mgc_wait(5.0, 100.0, 0.0, 1, 30.0)[0].mean_ms == pytest.approx(50.0)
    table = binomial_cdf_table(10, 0.3)
    assert table[-1] == pytest.approx(1.0)
    assert table[0] == pytest.approx(0.7**10)
    assert list(table_at(table, np.array([-1.0, 2.5, 99.0]))) == pytest.approx([0.0, table[2], 1.0])
