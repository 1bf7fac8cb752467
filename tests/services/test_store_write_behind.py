"""A worker's write-behind to the block store: the blocks of many requests and steps go
together in one put, at most one put every WRITE_BEHIND_INTERVAL_S, each block once and in
the store after; ``flush`` writes what waits at once; the queue is bounded. A real block
store, in process; the client's put is wrapped only to count the calls."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from common.engine.config import EngineConfig
from common.engine.request import FullBlocks
from common.kv.hashing import BlockHash
from common.kv.layout import KvLayout
from services.blockstore import server as blockstore_server
from services.blockstore.config import BlockStoreConfig
from services.worker import store_tier
from services.worker.config import WorkerConfig
from services.worker.metrics import WorkerMetrics
from services.worker.store_tier import WRITE_BEHIND_INTERVAL_S, StoreTier

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)


def blocks(hashes: list[int]) -> FullBlocks:
    data = torch.stack([torch.full(LAYOUT.block_shape, float(h)) for h in hashes])
    return FullBlocks([BlockHash(h) for h in hashes], data)


class Tier:
    def __init__(self, tier: StoreTier, puts: list[list[int]]) -> None:
        self.tier = tier
        self.puts = puts  # the hashes of each put made, in order

    async def stored(self, hashes: list[int]) -> torch.Tensor:
        assert self.tier.client is not None
        return await self.tier.client.get(hashes)


@contextlib.asynccontextmanager
async def open_tier() -> AsyncIterator[Tier]:
    store = await blockstore_server.start(BlockStoreConfig(capacity_bytes=16 << 20, port=0))
    tasks: set[asyncio.Task[Any]] = set()

    def in_background(coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    config = WorkerConfig(
        role="decode",
        engine=EngineConfig(model="unused", device="cpu"),
        blockstore=f"127.0.0.1:{store.port}",
    )
    metrics = WorkerMetrics(CollectorRegistry(), "tiny")
    tier = StoreTier(config, LAYOUT, metrics, in_background)
    tier.open()
    assert tier.client is not None
    puts: list[list[int]] = []
    real_put = tier.client.put

    async def counted_put(
        block_hashes: Sequence[int], data: torch.Tensor, timeout_s: float | None = None
    ) -> int:
        puts.append([int(h) for h in block_hashes])
        return await real_put(block_hashes, data, timeout_s)

    tier.client.put = counted_put  # type: ignore[method-assign,assignment]
    try:
        yield Tier(tier, puts)
    finally:
        await tier.flush()
        await tier.close()
        await store.stop()


def run(body: Callable[[Tier], Awaitable[None]]) -> None:
    async def main() -> None:
        async with open_tier() as tier:
            await body(tier)

    asyncio.run(asyncio.wait_for(main(), timeout=60))


def test_blocks_of_many_outputs_go_in_one_put_each_once() -> None:
    async def body(tier: Tier) -> None:
        tier.tier.write_behind(blocks([9]))  # nothing written lately: its put starts at once
        await asyncio.sleep(0)
        # Meanwhile two requests with the same prompt and another's output.
        for hashes in ([1, 2, 3], [4], [1, 2, 5]):
            tier.tier.write_behind(blocks(hashes))
        assert tier.tier.num_blocks_pending == 7
        await asyncio.sleep(WRITE_BEHIND_INTERVAL_S * 3)
        assert tier.puts == [[9], [1, 2, 3, 4, 5]]
        assert tier.tier.num_blocks_pending == 0
        stored = await tier.stored([9, 1, 2, 3, 4, 5])
        for i, h in enumerate([9, 1, 2, 3, 4, 5]):
            assert torch.equal(stored[i], torch.full(LAYOUT.block_shape, float(h)))

    run(body)


def test_puts_start_at_most_once_an_interval() -> None:
    async def body(tier: Tier) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        for h in range(1, 13):  # a block every quarter interval, as at 16 streams
            tier.tier.write_behind(blocks([h]))
            await asyncio.sleep(WRITE_BEHIND_INTERVAL_S / 4)
        await tier.tier.flush()
        elapsed = loop.time() - started
        assert [h for put in tier.puts for h in put] == list(range(1, 13))
        assert len(tier.puts) <= elapsed / WRITE_BEHIND_INTERVAL_S + 1
        assert len(tier.puts) < 12 // 2

    run(body)


def test_flush_writes_what_waits_without_the_interval() -> None:
    async def body(tier: Tier) -> None:
        tier.tier.write_behind(blocks([1]))
        await asyncio.sleep(0.01)  # its put is under way or done: the next one would wait
        tier.tier.write_behind(blocks([2, 3]))
        loop = asyncio.get_running_loop()
        started = loop.time()
        await tier.tier.flush()
        assert loop.time() - started < WRITE_BEHIND_INTERVAL_S * 0.8
        assert tier.puts == [[1], [2, 3]]
        assert tier.tier.num_blocks_pending == 0
        assert (await tier.stored([1, 2, 3])).shape[0] == 3

    run(body)


def test_the_queue_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_tier, "MAX_WRITE_BEHIND_BLOCKS", 4)

    async def body(tier: Tier) -> None:
        tier.tier.write_behind(blocks([1]))
        await asyncio.sleep(0)  # being written: no longer waiting
        tier.tier.write_behind(blocks([2, 3, 4]))
        tier.tier.write_behind(blocks([5, 6]))  # 3 + 2 > 4 waiting: not written
        tier.tier.write_behind(blocks([7]))
        await tier.tier.flush()
        assert [h for put in tier.puts for h in put] == [1, 2, 3, 4, 7]

    run(body)
