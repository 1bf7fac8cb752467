"""Expert load through a real redis-server: what a worker counted is what lands in Redis,
windows expire while totals stay, ``pdserve experts`` shows it, Prometheus gauges it."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from common.contract.sampling import SamplingParams
from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.experts.counts import DECODE, PREFILL, ExpertCounts
from common.experts.stats import coefficient_of_variation, imbalance
from common.index import keys
from common.index.expert_load import ExpertLoadStore, models, read_model
from common.telemetry.metrics import Samples
from pdserve.cli.main import main as cli_main
from services.worker.config import WorkerConfig
from services.worker.expert_load import ExpertLoadTracker
from services.worker.runtime import WorkerRuntime
from tests.factories import make_tiny_moe_checkpoint, random_prompts
from tests.polling import settle_async
from tests.redis_server import redis_server

pytestmark = pytest.mark.redis

MODEL = "tiny-moe"


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    with redis_server(tmp_path) as url:
        yield url


def counts(
    layers: tuple[int, ...], prefill: list[list[int]], decode: list[list[int]]
) -> ExpertCounts:
    num_experts = len(prefill[0])
    return ExpertCounts(
        layers,
        num_experts,
        (tuple(tuple(r) for r in prefill), tuple(tuple(r) for r in decode)),
    )


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout=120))


async def _client(url: str) -> Any:
    import redis.asyncio

    return redis.asyncio.from_url(url)


def test_what_lands_in_redis_is_what_was_counted(redis_url: str) -> None:
    a1 = counts((1, 3), [[5, 0, 2, 1], [0, 0, 9, 0]], [[1, 1, 0, 0], [0, 3, 0, 0]])
    a2 = counts((1, 3), [[1, 1, 1, 1], [0, 0, 0, 0]], [[0, 0, 0, 7], [2, 0, 0, 0]])
    b1 = counts((1, 3), [[0, 4, 0, 0], [1, 0, 0, 0]], [[0, 0, 0, 0], [0, 0, 0, 5]])

    async def body() -> None:
        client = await _client(redis_url)
        store = ExpertLoadStore(client, MODEL, window_s=3600, num_windows=4)
        now = time.time()
        assert await store.publish("w-a", a1, now) == 7  # non-zero counts
        await store.publish("w-a", a2, now)  # the same window: added to it
        await store.publish("w-b", b1, now)
        load = await read_model(client, MODEL, now)
        assert load.workers == ["w-a", "w-b"]
        assert sorted(load.layers) == [1, 3]
        for slot, layer in enumerate((1, 3)):
            entry = load.layers[layer]
            for phase in (PREFILL, DECODE):
                want = [sum(c.counts[phase][slot][e] for c in (a1, a2, b1)) for e in range(4)]
                assert entry.totals[phase] == want
                assert entry.windows[phase][-1] == want  # the current window
                assert all(not any(w) for w in entry.windows[phase][:-1])
        # Raw hash, as any other Redis client sees it.
        raw = await client.hgetall(keys.expert_total(MODEL, "w-a", 3))
        assert {k.decode(): int(v) for k, v in raw.items()} == {"p2": 9, "d1": 3, "d0": 2}
        assert await models(client, now) == [MODEL]
        await client.aclose()

    run(body())


def test_windows_expire_and_totals_stay(redis_url: str) -> None:
    """Windows of 0.3 s, 2 kept: a window's hash lives until 2 windows after its own ends,
    so at most 3 exist per worker and layer; the total outlives them."""
    one = counts((0,), [[1, 2]], [[0, 3]])

    async def body() -> None:
        client = await _client(redis_url)
        store = ExpertLoadStore(client, MODEL, window_s=0.3, num_windows=2)
        start = time.time()
        buckets = set()
        while time.time() < start + 1.5:  # 5 windows of publishing
            now = time.time()
            buckets.add(store.bucket(int(now * 1000)))
            await store.publish("wk", one, now)
            live = [k async for k in client.scan_iter(match="*:wk:0:w:*")]
            assert 1 <= len(live) <= 3
            await asyncio.sleep(0.05)
        assert len(buckets) >= 5
        first = min(buckets)
        assert not await client.exists(keys.expert_window(MODEL, "wk", 0, first))
        ttl_ms = await client.pttl(keys.expert_window(MODEL, "wk", 0, max(buckets)))
        assert 0 < ttl_ms <= 3 * 300
        # Stop publishing: every window is gone within 3 windows, the total remains.
        await asyncio.sleep(1.0)
        assert [k async for k in client.scan_iter(match="*:wk:0:w:*")] == []
        load = await read_model(client, MODEL)
        assert all(not any(w) for phase in load.layers[0].windows for w in phase)
        total = load.layers[0].totals
        publishes = total[PREFILL][0]
        assert publishes >= 5 and total == [[publishes, 2 * publishes], [0, 3 * publishes]]
        assert await client.pttl(keys.expert_total(MODEL, "wk", 0)) > 3600 * 1000
        await client.aclose()

    run(body())


def test_tracker_keeps_unpublished_counts_and_a_trailing_window() -> None:
    tracker = ExpertLoadTracker(window_s=10.0)
    c1 = counts((0,), [[4, 0]], [[0, 0]])
    c2 = counts((0,), [[4, 0]], [[2, 2]])
    c3 = counts((0,), [[4, 6]], [[2, 2]])
    tracker.observe(c1, now_s=0.0)
    assert tracker.pending() == c1
    tracker.mark_published(c1)
    tracker.observe(c2, now_s=5.0)
    assert tracker.window == c2  # younger than the window: everything since start
    tracker.observe(c3, now_s=12.0)  # a publish failed in between: nothing lost
    assert tracker.pending() == counts((0,), [[0, 6]], [[2, 2]])
    assert tracker.window == c3.minus(c1)  # c1 (t=0) is the newest snapshot >= 10 s old
    tracker.observe(c3, now_s=16.0)  # now c2 (t=5) is
    assert tracker.window == c3.minus(c2)
    assert tracker.layer_figures() == [(0, imbalance([0, 6]), coefficient_of_variation([0, 6]))]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_moe_checkpoint(tmp_path_factory.mktemp("moe") / MODEL, "qwen3_moe")


def test_worker_publishes_what_its_engine_counted(
    moe_dir: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    engine_config = EngineConfig(
        model=str(moe_dir), num_kv_blocks=64, block_size=16, device="cpu", dtype="float32"
    )
    config = WorkerConfig(
        role="decode", engine=engine_config, redis_url=redis_url, worker_id="decode-0",
        expert_load_interval_s=0.2, expert_load_window_s=60.0,
    )  # fmt: skip
    prompts = random_prompts(384, [21, 40], seed=5)

    async def body() -> tuple[ExpertCounts, bytes]:
        runtime = WorkerRuntime(config, Engine(engine_config))
        await runtime.start(port=0)
        try:
            sampling = SamplingParams(max_tokens=5, ignore_eos=True)
            for i, prompt in enumerate(prompts):
                async for _ in runtime.loop.generate(f"r{i}", prompt, sampling):
                    pass
            engine_counts = await runtime.loop.call(lambda e: e.expert_counts())
            assert engine_counts is not None
            client = await _client(redis_url)
            want = {
                layer: [list(engine_counts.counts[p][slot]) for p in (PREFILL, DECODE)]
                for slot, layer in enumerate(engine_counts.layers)
            }

            async def published() -> dict[int, list[list[int]]]:
                load = await read_model(client, MODEL)
                return {layer: entry.totals for layer, entry in load.layers.items()}

            # The publishing task catches up within an interval or two.
            got = await settle_async(published, lambda got: got == want, 30.0, every_s=0.1)
            assert got == want
            # Decode: 2 requests x 4 tokens fed back (the 5th is never) x top-2.
            assert sum(want[engine_counts.layers[0]][DECODE]) == 2 * 4 * 2
            await client.aclose()
            page = generate_latest(runtime.metrics.registry)
        finally:
            await runtime.stop()
        return engine_counts, page

    engine_counts, page = run(body())

    # Prometheus: one imbalance and one cv series per MoE layer, no per-expert series.
    samples = Samples.parse(page.decode())
    for slot, layer in enumerate(engine_counts.layers):
        row = engine_counts.layer_total(slot)
        value = samples.sum("pdserve:expert_load_imbalance", layer=str(layer), model_name=MODEL)
        assert value == pytest.approx(imbalance(row))
        assert value > 1.0
        cv = samples.sum("pdserve:expert_load_cv", layer=str(layer))
        assert cv == pytest.approx(coefficient_of_variation(row))
    series = [s for s in samples.samples if s[0].startswith("pdserve:expert")]
    assert len(series) == 2 * len(engine_counts.layers)

    # pdserve experts --json reads the same figures back.
    assert cli_main(["experts", "--json", "--redis-url", redis_url, "--top", "3"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [m["model"] for m in shown] == [MODEL]
    assert shown[0]["workers"] == ["decode-0"]
    for slot, layer in enumerate(engine_counts.layers):
        entry = shown[0]["layers"][slot]
        row = engine_counts.layer_total(slot)
        assert entry["layer"] == layer
        assert entry["tokens"] == entry["total_tokens"] == sum(row)
        assert entry["counts"] == row
        assert entry["imbalance"] == round(imbalance(row), 4)
        assert entry["hottest"][0]["tokens"] == max(row)
    assert cli_main(["experts", "--redis-url", redis_url]) == 0
    text = capsys.readouterr().out
    assert f"{MODEL}: 1 worker(s)" in text and "max/mean" in text

    # And a plan from it: 2 devices, 2 redundant slots, per MoE layer.
    argv = ["experts", "plan", "--devices", "2", "--redundant", "2", "--json",
            "--redis-url", redis_url]  # fmt: skip
    assert cli_main(argv) == 0
    planned = json.loads(capsys.readouterr().out)[0]
    assert [entry["layer"] for entry in planned["layers"]] == list(engine_counts.layers)
    for slot, entry in enumerate(planned["layers"]):
        assert entry["load"] == engine_counts.layer_total(slot)
        assert entry["num_replicas"] <= engine_counts.num_experts + 2
        assert entry["balance_after"] <= entry["balance_before"] + 1e-9
    assert cli_main(["experts", "plan", "--devices", "2", "--redis-url", redis_url]) == 0
    assert "max/mean before" in capsys.readouterr().out
