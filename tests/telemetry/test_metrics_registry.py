"""Metric names and values, read back the way Prometheus reads them."""

from __future__ import annotations

import asyncio
import gc
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from common.contract.sampling import SamplingParams
from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.heap import freeze_startup_heap
from common.telemetry import metrics as telemetry_metrics
from common.telemetry.metrics import RequestMetrics, Samples, scrape, start_metrics_server
from pdserve.cli.commands.status import summarize
from services.blockstore.metrics import BlockStoreMetrics
from services.blockstore.store import BlockStore
from services.worker import metrics as worker_metrics
from services.worker.config import WorkerConfig
from services.worker.runtime import WorkerRuntime
from tests.factories import make_tiny_checkpoint


def samples_of(registry: CollectorRegistry) -> Samples:
    return Samples.parse(generate_latest(registry).decode())


def test_request_families_use_vllm_names_under_our_prefix() -> None:
    registry = CollectorRegistry()
    metrics = RequestMetrics(registry, "m")
    metrics.time_to_first_token.observe(0.03)
    metrics.observe_tokens(0.05, 2)  # two tokens after 50 ms: 25 ms each
    metrics.prompt_tokens.inc(100)
    metrics.generation_tokens.inc(8)
    metrics.finished("stop")
    metrics.finished("length")
    metrics.finished("length")
    samples = samples_of(registry)
    assert samples.sum("pdserve:prompt_tokens_total", model_name="m") == 100
    assert samples.sum("pdserve:generation_tokens_total") == 8
    assert samples.sum("pdserve:request_success_total", finished_reason="length") == 2
    assert samples.sum("pdserve:request_success_total") == 3
    assert samples.sum("pdserve:time_to_first_token_seconds_count") == 1
    assert samples.sum("pdserve:time_to_first_token_seconds_bucket", le="0.04") == 1
    assert samples.sum("pdserve:time_to_first_token_seconds_bucket", le="0.02") == 0
    assert samples.sum("pdserve:inter_token_latency_seconds_count") == 2
    assert samples.sum("pdserve:inter_token_latency_seconds_sum") == pytest.approx(0.05)
    assert samples.sum("pdserve:inter_token_latency_seconds_bucket", le="0.025") == 2


@pytest.mark.parametrize(
    "buckets",
    [
        telemetry_metrics.TTFT_BUCKETS_S,
        telemetry_metrics.ITL_BUCKETS_S,
        telemetry_metrics.E2E_BUCKETS_S,
        telemetry_metrics.QUEUE_BUCKETS_S,
        telemetry_metrics.TRANSFER_BUCKETS_S,
        telemetry_metrics.RPC_BUCKETS_S,
    ],
)
def test_buckets_ascend_from_sub_10ms_to_tens_of_seconds(buckets: tuple[float, ...]) -> None:
    assert list(buckets) == sorted(set(buckets))
    assert buckets[0] <= 0.01 and buckets[-1] >= 10


def test_the_endpoint_serves_the_registry() -> None:
    registry = CollectorRegistry()
    RequestMetrics(registry, "m").finished("stop")
    server = start_metrics_server("127.0.0.1", 0, registry)
    try:
        samples = scrape(f"http://127.0.0.1:{server.port}/metrics")
    finally:
        server.stop()
    assert samples.sum("pdserve:request_success_total", finished_reason="stop") == 1
    assert summarize(samples) == {"requests": 1, "prompt_tokens": 0, "generation_tokens": 0}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", "llama")


def test_engine_figures_are_read_on_the_engine_thread_at_scrape_time(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine_config = EngineConfig(
        model=str(tiny_dir), num_kv_blocks=64, block_size=16, device="cpu", dtype="float32"
    )
    registry = CollectorRegistry()
    runtime = WorkerRuntime(
        WorkerConfig(role="decode", engine=engine_config), Engine(engine_config), registry
    )
    prompt = list(range(3, 40))  # 37 tokens: the second run finds 2 full blocks cached
    sampling = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def run() -> None:
        for request_id in ("a", "b"):
            async for _ in runtime.loop.generate(request_id, prompt, sampling):
                pass

    runtime.loop.start()
    try:
        asyncio.run(run())
        samples = samples_of(registry)
        assert samples.sum("pdserve:prefix_cache_queries_total", model_name="llama") == 2 * 37
        assert samples.sum("pdserve:prefix_cache_hits_total") == 32
        assert samples.sum("pdserve:num_requests_running") == 0
        assert samples.sum("pdserve:num_requests_waiting") == 0
        assert samples.sum("pdserve:kv_cache_usage_perc") == 0.0  # cached blocks are free
        assert samples.sum("pdserve:kv_leases_active") == 0
        # A busy engine thread: the scrape answers with the last snapshot, in bounded time.
        monkeypatch.setattr(worker_metrics, "SNAPSHOT_TIMEOUT_S", 0.1)
        runtime.loop.submit(lambda engine: time.sleep(0.5))
        start = time.monotonic()
        assert samples_of(registry).sum("pdserve:prefix_cache_hits_total") == 32
        assert time.monotonic() - start < 0.4
    finally:
        runtime.loop.stop()


def test_block_store_figures() -> None:
    registry = CollectorRegistry()

    async def run() -> Samples:
        BlockStoreMetrics(registry).watch_store(
            BlockStore(1 << 20, 30.0), asyncio.get_running_loop()
        )
        # A scrape comes from another thread while the loop runs.
        return await asyncio.to_thread(samples_of, registry)

    samples = asyncio.run(run())
    assert samples.sum("pdserve:blockstore_capacity_bytes") == 1 << 20
    assert samples.sum("pdserve:blockstore_blocks") == 0
    assert samples.sum("pdserve:blockstore_used_bytes", state="committed") == 0


def test_gc_pauses_are_timed_by_generation() -> None:
    registry = CollectorRegistry()
    telemetry_metrics.gc_pause_histogram(registry)
    before = samples_of(registry).sum("pdserve:gc_pause_seconds_count", generation="2")
    garbage = [[] for _ in range(50_000)]
    for item in garbage:
        item.append(item)  # cycles: only the collector frees them
    del garbage
    gc.collect()
    samples = samples_of(registry)
    assert samples.sum("pdserve:gc_pause_seconds_count", generation="2") >= before + 1
    assert samples.sum("pdserve:gc_pause_seconds_sum", generation="2") > 0
    gc.collect(0)
    assert samples_of(registry).sum("pdserve:gc_pause_seconds_count", generation="0") >= 1


def test_frozen_start_up_heap_is_out_of_the_collectors_sight() -> None:
    kept = [[i] for i in range(100_000)]  # long-lived objects, as after start-up
    try:
        assert freeze_startup_heap() >= len(kept)
        assert gc.get_freeze_count() >= len(kept)
        # A full collection no longer walks them: it sees only what came after the freeze.
        tracked = len(gc.get_objects(generation=2))
        assert tracked < len(kept)
    finally:
        gc.unfreeze()  # the rest of this test process collects as before


def test_suffix_decodings_trees_are_reported_by_an_engine_that_runs_it(tiny_dir: Path) -> None:
    pytest.importorskip("arctic_inference.suffix_decoding", reason="scripts/setup.sh builds it")
    engine_config = EngineConfig(
        model=str(tiny_dir), num_kv_blocks=64, block_size=16, device="cpu", dtype="float32",
        speculative_config='{"method": "suffix", "num_speculative_tokens": 4, "adaptive": false}',
    )  # fmt: skip
    registry = CollectorRegistry()
    runtime = WorkerRuntime(
        WorkerConfig(role="decode", engine=engine_config), Engine(engine_config), registry
    )
    sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def run() -> None:
        for request_id in ("a", "b"):
            async for _ in runtime.loop.generate(request_id, list(range(3, 30)), sampling):
                pass

    runtime.loop.start()
    try:
        asyncio.run(run())
        samples = samples_of(registry)
        assert samples.sum("pdserve:suffix_decoding_cached_responses") == 2
        assert samples.sum("pdserve:suffix_decoding_tenants") == 1
        assert 0 < samples.sum("pdserve:suffix_decoding_cached_tokens") <= 2 * 6
        figures = summarize(samples)  # what pdserve status shows of it
        assert figures["suffix_cached_responses"] == 2 and figures["suffix_tenants"] == 1
    finally:
        runtime.loop.stop()
