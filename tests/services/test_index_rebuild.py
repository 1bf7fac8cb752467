"""Redis lost and back: workers and the block store put the prefix index back themselves.

A real redis-server is killed and restarted empty on the same port (or flushed): each
worker's next heartbeat finds its registry entry gone and republishes every block it holds;
the block store republishes its committed blocks at once instead of at its next refresh.
While Redis is down nothing fails. And a worker that stops heartbeating leaves the registry
within seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from common.contract.sampling import SamplingParams
from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.index import keys, redis_client
from common.index.prefix_index import PrefixIndex
from common.index.registry import WorkerRegistry
from common.kv.block_store_client import BlockStoreClient
from common.kv.layout import KvLayout
from services.blockstore import server as blockstore_server
from services.blockstore.config import BlockStoreConfig
from services.worker.config import WorkerConfig
from services.worker.runtime import WorkerRuntime
from tests.factories import make_tiny_checkpoint
from tests.polling import until_async
from tests.redis_server import RedisServer

pytestmark = pytest.mark.redis

PROMPT = list(range(3, 56))  # 3 full blocks


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", "llama")


async def locations(url: str, model: str, hashes: list[int]) -> list[dict[str, str]]:
    client = redis_client.connect(url)
    try:
        return await PrefixIndex(client, model).lookup(hashes)
    finally:
        await client.aclose()


def test_a_worker_republishes_its_blocks_when_redis_returns_empty(
    tiny_dir: Path, redis_server: RedisServer
) -> None:
    engine_config = EngineConfig(
        model=str(tiny_dir), num_kv_blocks=64, block_size=16, device="cpu", dtype="float32"
    )
    config = WorkerConfig(
        role="decode", engine=engine_config, redis_url=redis_server.url, heartbeat_s=0.1
    )

    async def body() -> None:
        runtime = WorkerRuntime(config, Engine(engine_config))
        await runtime.start(port=1)
        try:
            async for _ in runtime.loop.generate(
                "r1", PROMPT, SamplingParams(max_tokens=2, temperature=0.0)
            ):
                pass
            hashes = runtime.block_hashes(PROMPT, None)
            assert len(hashes) == 3

            async def indexed() -> bool:
                found = await locations(redis_server.url, runtime.model, hashes)
                return len(found) == 3 and all(runtime.worker_id in f for f in found)

            # Never published by a servicer: the blocks reach the index only by republishing.
            redis_server.kill()
            await asyncio.sleep(0.5)  # heartbeats fail meanwhile; nothing else does
            assert runtime.metrics.registry.get_sample_value("pdserve:redis_up") == 0
            redis_server.start()
            await until_async("indexed", indexed)
            assert runtime.metrics.registry.get_sample_value("pdserve:redis_up") == 1

            client = redis_client.connect(redis_server.url)
            try:
                await client.flushall()  # a restart without the downtime
                await until_async("indexed", indexed)
                workers = await WorkerRegistry(client).list()
                assert [w.worker_id for w in workers] == [runtime.worker_id]
            finally:
                await client.aclose()
        finally:
            await runtime.stop()

    asyncio.run(asyncio.wait_for(body(), timeout=60))


@dataclass
class RegisteredWorker:
    runtime: WorkerRuntime
    registry: WorkerRegistry

    async def listed(self) -> bool:
        """The registry lists this worker, alone."""
        return [w.worker_id for w in await self.registry.list()] == [self.runtime.worker_id]

    async def gone(self) -> bool:
        return await self.registry.list() == []


@contextlib.asynccontextmanager
async def registered_worker(
    checkpoint: Path, redis_url: str, role: str, port: int
) -> AsyncIterator[RegisteredWorker]:
    """A worker runtime heartbeating every 0.2 s (entry TTL 3 s), once it is listed."""
    engine_config = EngineConfig(
        model=str(checkpoint), num_kv_blocks=16, block_size=16, device="cpu", dtype="float32"
    )
    config = WorkerConfig(role=role, engine=engine_config, redis_url=redis_url, heartbeat_s=0.2)
    runtime = WorkerRuntime(config, Engine(engine_config))
    await runtime.start(port=port)
    client = redis_client.connect(redis_url)
    try:
        worker = RegisteredWorker(runtime, WorkerRegistry(client))
        await until_async("worker.listed", worker.listed)
        yield worker
    finally:
        await client.aclose()
        await runtime.stop()


def test_a_silent_worker_leaves_the_registry_within_seconds(
    tiny_dir: Path, redis_server: RedisServer
) -> None:
    async def body() -> None:
        async with registered_worker(tiny_dir, redis_server.url, "prefill", 2) as worker:
            heartbeat = worker.runtime._tasks[0]
            heartbeat.cancel()  # it hangs (SIGSTOP) or died without deregistering
            silent_at = time.monotonic()
            await until_async("worker.gone", worker.gone, timeout_s=10)
            assert time.monotonic() - silent_at <= 4.0  # the entry's TTL: 3 s here

    asyncio.run(asyncio.wait_for(body(), timeout=60))


def test_a_worker_mid_long_engine_step_keeps_heartbeating_a_stuck_one_stops(
    tiny_dir: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Heartbeats read the engine's figures between steps. A step longer than the registry
    TTL (a big prefill chunk on a busy CPU) must not drop the worker from routing: the beat
    goes on with the last figures. An engine silent past ENGINE_SILENCE_LIMIT_S is stuck,
    and then the entry expires."""
    from services.worker import index_sync

    async def body() -> None:
        async with registered_worker(tiny_dir, redis_server.url, "decode", 3) as worker:
            runtime, listed = worker.runtime, worker.listed
            # The engine thread busy for 5 s: longer than the entry's 3-s TTL.
            busy = asyncio.ensure_future(runtime.loop.call(lambda engine: time.sleep(5.0)))
            watched_until = time.monotonic() + 4.5
            while time.monotonic() < watched_until:
                assert await listed(), "the worker left the registry during a long step"
                await asyncio.sleep(0.25)
            await busy

            # Now a stuck engine: past the limit the beats stop and the entry expires.
            monkeypatch.setattr(index_sync, "ENGINE_SILENCE_LIMIT_S", 0.5)
            stuck = asyncio.ensure_future(runtime.loop.call(lambda engine: time.sleep(6.0)))
            stuck_at = time.monotonic()

            await until_async("worker.gone", worker.gone, timeout_s=6)
            assert time.monotonic() - stuck_at <= 5.0  # the limit, then the 3-s TTL
            await stuck
            await until_async("listed", listed)  # answering again: back in

    asyncio.run(asyncio.wait_for(body(), timeout=60))


def test_the_block_store_republishes_at_once_when_redis_returns_empty(
    redis_server: RedisServer,
) -> None:
    layout = KvLayout(2, 2, 8, 16, torch.float32)
    hashes = [11, 22, 33]

    async def body() -> None:
        store = await blockstore_server.start(
            BlockStoreConfig(
                capacity_bytes=16 << 20, port=0, redis_url=redis_server.url, heartbeat_s=0.1
            )
        )
        client = BlockStoreClient(f"127.0.0.1:{store.port}", "m", layout)
        try:
            blocks = torch.randn(len(hashes), *layout.block_shape)
            assert await client.put(hashes, blocks, timeout_s=10) == 3

            async def indexed() -> bool:
                found = await locations(redis_server.url, "m", hashes)
                return len(found) == 3 and all(keys.STORE_LOCATION in f for f in found)

            await until_async("indexed", indexed)
            redis_server.kill()
            await asyncio.sleep(0.5)
            assert await client.contains(hashes, timeout_s=5) == 3  # the store serves on
            redis_server.start()
            # Within 5 s: not the refresh every ttl / 2 (300 s).
            await until_async("indexed", indexed, timeout_s=5)
        finally:
            await client.close()
            await store.stop()

    asyncio.run(asyncio.wait_for(body(), timeout=60))
