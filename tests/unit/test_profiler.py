"""measure_profile (common/engine/profiler.py) on a tiny random llama: the points it measures
are exactly those the engine can hold, the cached-prefix samples really hit the cache, the
decode samples run the batch asked for, and the engine is left as it was found."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from common.contract.sampling import SamplingParams
from common.engine.engine import Engine
from common.engine.profiler import QUICK, ProfileGrid, measure_profile, profile_key
from common.errors import FailedPreconditionError
from common.planner.profile import ProfileKey
from tests.factories import make_tiny_checkpoint, random_prompts, run_to_completion, tiny_engine

pytestmark = pytest.mark.usefixtures("one_thread")

KEY = ProfileKey("tiny", "", 1, "cpu")
# Engine of tests.factories.tiny_engine: 256 blocks of 16 tokens, max_model_len 1024 (the
# model's positions), max_num_seqs 32. QUICK capped to it: the longest prompt is 1023
# tokens; a cached prefix of 1024 + 128 new becomes 880 + 128; a decode sequence of 512
# tokens of context needs 33 blocks (with 1 + 2 + 5 tokens more), so at most 7 fit.
QUICK_PREFILL = [(64, 0), (576, 512), (1008, 880), (256, 0), (1023, 0)]  # (prompt, cached)
QUICK_DECODE = [(1, 64), (1, 512), (8, 64), (32, 64), (7, 512)]  # (batch, context at import)
SMALL = ProfileGrid(
    cold_prompt_tokens=(32, 64, 128),
    cached_prompts=((64, 16),),
    decode_contexts=(32, 64),
    decode_batches=(1, 2),
    warmup_steps=1,
    timed_steps=2,
    budget_s=60.0,
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", "llama")


class TickingClock:
    """Every reading is ``tick`` seconds after the previous one, and the tick grows by
    ``slowing`` each time (a machine that slows down)."""

    def __init__(self, slowing: float = 0.0) -> None:
        self.now = 0.0
        self.tick = 1.0
        self.slowing = slowing

    def __call__(self) -> float:
        self.now += self.tick
        self.tick += self.slowing
        return self.now


def greedy(engine: Engine, prompts: list[list[int]]) -> dict[str, list[int]]:
    sampling = SamplingParams(max_tokens=6, ignore_eos=True)
    return run_to_completion(engine, {f"p{i}": p for i, p in enumerate(prompts)}, sampling)


def assert_idle_and_free(engine: Engine) -> None:
    assert not engine.has_unfinished()
    assert engine.requests == {} and engine.held == {}
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_quick_profile_measures_what_the_engine_holds(ckpt: Path) -> None:
    engine = tiny_engine(ckpt)
    profile = measure_profile(engine, KEY)
    assert profile.key == KEY
    assert (profile.block_size, profile.num_kv_blocks, profile.max_model_len) == (16, 256, 1024)
    assert (profile.max_num_seqs, profile.max_num_batched_tokens) == (32, 1024)
    # cached_tokens is what the engine reported: the seeded prefixes were hits.
    assert [(s.prompt_tokens, s.cached_tokens) for s in profile.prefill_samples] == QUICK_PREFILL
    # The middle timed step attends to the import, its token, 2 warm-up steps and 2 more.
    assert [(d.batch_size, d.context_tokens) for d in profile.decode_samples] == [
        (b, c + 6) for b, c in QUICK_DECODE
    ]
    assert all(s.ms > 0 for s in profile.prefill_samples)
    assert all(d.step_ms > 0 for d in profile.decode_samples)
    fits = (profile.prefill_fit, profile.decode_fit)
    assert all(c >= 0 for fit in fits for c in vars(fit).values())
    assert profile.prefill_ms(1000) > profile.prefill_ms(10) > 0
    assert 0 < profile.measure_ms < QUICK.budget_s * 1000 * 3
    assert_idle_and_free(engine)
    assert engine.kv.pool.num_cached == 0  # its prompts' blocks are no prefix hits
    assert (engine.kv.prefix_query_tokens, engine.num_preemptions) == (0, 0)


def test_the_engine_serves_as_before_and_reports_the_prefixes_it_lost(ckpt: Path) -> None:
    engine = tiny_engine(ckpt)
    pool = engine.kv.pool
    pool.track_evictions()  # as a worker that mirrors its cache in the prefix index
    prompts = random_prompts(384, [40, 70, 33])
    before = greedy(engine, prompts)
    cached_before = set(pool.cached_hashes())
    counters = (engine.kv.prefix_query_tokens, engine.kv.prefix_hit_tokens)
    assert len(cached_before) == 2 + 4 + 2 and pool.drain_evicted() == []

    measure_profile(engine, KEY, grid=SMALL)

    assert_idle_and_free(engine)
    # 32 sequences of 5 blocks took the least recently freed blocks first: the older
    # prefixes, evicted as by any traffic and reported (and only they: the profile's own
    # blocks were never published); none of the profile's own stays a prefix hit.
    assert pool.cached_hashes() == []
    evicted = pool.drain_evicted()
    assert sorted(evicted) == sorted(cached_before)
    assert (engine.kv.prefix_query_tokens, engine.kv.prefix_hit_tokens) == counters
    assert greedy(engine, prompts) == before


def test_quantized_kv_caches_are_profiled_from_their_own_wire_layout(ckpt: Path) -> None:
    for kv_dtype in ("int8", "fp8"):
        engine = tiny_engine(ckpt, kv_dtype=kv_dtype, attention_backend="torch")
        profile = measure_profile(engine, KEY, grid=SMALL)
        assert [(s.prompt_tokens, s.cached_tokens) for s in profile.prefill_samples] == [
            (80, 64), (32, 0), (64, 0), (128, 0)
        ]  # fmt: skip
        assert [(d.batch_size, d.context_tokens) for d in profile.decode_samples] == [
            (1, 36), (1, 68), (2, 36), (2, 68), (32, 36), (32, 68)
        ]  # fmt: skip
        assert_idle_and_free(engine)


def test_a_busy_engine_is_refused_and_left_alone(ckpt: Path) -> None:
    engine = tiny_engine(ckpt)
    engine.add_request("busy", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(FailedPreconditionError, match="1 requests in flight"):
        measure_profile(engine, KEY, grid=SMALL)
    assert list(engine.requests) == ["busy"]


def test_a_step_that_raises_leaves_no_request_behind(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = tiny_engine(ckpt)
    step = engine.step
    calls = 0

    def failing_step() -> list:
        nonlocal calls
        calls += 1
        if calls == 12:  # among the decode samples' steps
            raise RuntimeError("device lost")
        return step()

    monkeypatch.setattr(engine, "step", failing_step)
    with pytest.raises(RuntimeError, match="device lost"):
        measure_profile(engine, KEY, grid=SMALL)
    assert_idle_and_free(engine)
    assert engine.kv.pool.num_cached == 0


def test_the_budget_keeps_three_points_a_phase_cheapest_first(
    ckpt: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = tiny_engine(ckpt)
    clock = TickingClock()  # every point looks as if it took seconds: the budget is spent
    grid = dataclasses.replace(SMALL, budget_s=10.0)
    profile = measure_profile(engine, KEY, grid=grid, clock=clock)
    assert [(s.prompt_tokens, s.cached_tokens, s.ms) for s in profile.prefill_samples] == [
        (80, 64, 1000.0), (32, 0, 1000.0), (64, 0, 1000.0)
    ]  # fmt: skip
    assert [(d.batch_size, d.context_tokens, d.step_ms) for d in profile.decode_samples] == [
        (1, 36, 1000.0), (1, 68, 1000.0), (2, 36, 1000.0)
    ]  # fmt: skip
    assert profile.measure_ms == (clock.now - 1.0) * 1000
    assert profile.prefill_fit.base_ms == pytest.approx(1000.0)
    assert_idle_and_free(engine)
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == []


def test_a_machine_that_changes_speed_is_reported(
    ckpt: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = tiny_engine(ckpt)
    measure_profile(engine, KEY, grid=SMALL, clock=TickingClock(slowing=0.1))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "the machine's speed changed while measuring" in warnings[0]
    assert_idle_and_free(engine)


def test_a_small_engine_still_gets_three_points_a_phase(ckpt: Path) -> None:
    engine = tiny_engine(ckpt, max_model_len=64, max_num_seqs=1)
    profile = measure_profile(engine, KEY)
    # Every cold prompt of the grid is cut to 63 tokens: a quarter and a half of it join.
    assert [(s.prompt_tokens, s.cached_tokens) for s in profile.prefill_samples] == [
        (15, 0), (31, 0), (63, 16), (63, 0)
    ]  # fmt: skip
    # One sequence of at most 48 tokens of context (64 - 1 - 8, whole blocks): three of them.
    assert [(d.batch_size, d.context_tokens) for d in profile.decode_samples] == [
        (1, 16 + 6), (1, 32 + 6), (1, 48 + 6)
    ]  # fmt: skip
    assert_idle_and_free(engine)


def test_profile_key_names_the_engine(ckpt: Path) -> None:
    engine = tiny_engine(ckpt)
    assert profile_key(engine, "tiny") == ProfileKey("tiny", "", 1, "cpu")
