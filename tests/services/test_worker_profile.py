"""An engine worker's profile (issue 29, item 1), as real gRPC servers in-process on a tiny
model with a real redis-server: measured once per key at start and published, reused by
the next worker of the key (from Redis, then from the local cache) with its own capacity,
carried on GetStatus, and remeasured on demand only while idle."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from common.engine.config import EngineConfig
from common.index import redis_client
from common.index.profiles import ProfileStore
from common.planner.profile import WorkerProfile
from common.rpc.channels import create_channel
from pdserve.common.v1 import common_pb2
from pdserve.decode.v1 import decode_pb2, decode_pb2_grpc
from pdserve.worker.v1 import worker_pb2, worker_pb2_grpc
from services.worker.config import WorkerConfig
from services.worker.runtime import WorkerRuntime
from services.worker.serve import start_worker
from services.worker.server import add_servicers
from tests.factories import make_tiny_checkpoint
from tests.redis_server import redis_server

pytestmark = pytest.mark.redis


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", "llama")


@contextlib.asynccontextmanager
async def worker(
    model_dir: Path, redis_url: str | None, worker_id: str, num_kv_blocks: int = 64,
    profile: str = "auto",
) -> AsyncIterator[tuple[WorkerRuntime, grpc.aio.Channel]]:  # fmt: skip
    engine = EngineConfig(
        model=str(model_dir), num_kv_blocks=num_kv_blocks, block_size=16, device="cpu",
        dtype="float32", num_threads=1,
    )  # fmt: skip
    config = WorkerConfig(
        role="decode", engine=engine, worker_id=worker_id, redis_url=redis_url, profile=profile
    )
    server, runtime = await start_worker(config, add_servicers)
    channel = create_channel(f"127.0.0.1:{server.port}")
    try:
        yield runtime, channel
    finally:
        await channel.close()
        await server.stop(0)
        await runtime.stop()


def test_measured_once_per_key_published_and_reused_with_the_engines_capacity(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))

    async def body(url: str) -> None:
        async with worker(tiny_dir, url, "w0") as (first, channel):
            measured = first.held_profile
            assert measured is not None and measured.measure_ms > 0
            assert measured.num_kv_blocks == 64 and len(measured.decode_samples) >= 3
            status = (
                await decode_pb2_grpc.DecodeServiceStub(channel).GetStatus(
                    decode_pb2.GetStatusRequest()
                )
            ).status
            assert WorkerProfile.from_pb(status.profile) == measured
            redis = redis_client.connect(url)
            try:
                stored = await ProfileStore(redis).get(first.profile_key())
            finally:
                await redis.aclose()
            assert stored == measured
            # The next worker of the key reuses it (no new measurement) with its own pool.
            async with worker(tiny_dir, url, "w1", num_kv_blocks=96) as (second, _):
                assert second.held_profile is not None
                assert second.held_profile.measured_unix_ms == measured.measured_unix_ms
                assert second.held_profile.num_kv_blocks == 96
        # Without Redis, from the local cache.
        async with worker(tiny_dir, None, "w2") as (third, _):
            assert third.held_profile is not None
            assert third.held_profile.measured_unix_ms == measured.measured_unix_ms

    with redis_server(tmp_path) as url:
        asyncio.run(asyncio.wait_for(body(url), timeout=120))


def test_workers_starting_together_measure_once(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))

    async def body(url: str) -> None:
        async with contextlib.AsyncExitStack() as stack:
            (a, _), (b, _) = await asyncio.gather(
                stack.enter_async_context(worker(tiny_dir, url, "a")),
                stack.enter_async_context(worker(tiny_dir, url, "b")),
            )
            assert a.held_profile is not None and b.held_profile is not None
            assert a.held_profile.measured_unix_ms == b.held_profile.measured_unix_ms

    with redis_server(tmp_path) as url:
        asyncio.run(asyncio.wait_for(body(url), timeout=180))


def test_on_demand_remeasure_only_while_idle_and_not_found_without_one(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))

    async def body() -> None:
        async with worker(tiny_dir, None, "w0", profile="off") as (runtime, channel):
            control = worker_pb2_grpc.WorkerServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as none:
                await control.GetProfile(worker_pb2.GetProfileRequest())
            assert none.value.code() is grpc.StatusCode.NOT_FOUND
            busy = decode_pb2_grpc.DecodeServiceStub(channel).Decode(
                decode_pb2.DecodeRequest(
                    request_id="busy", prompt_token_ids=list(range(3, 40)), local_prefill=True,
                    sampling=common_pb2.SamplingParams(max_tokens=400, ignore_eos=True),
                )
            )  # fmt: skip
            await busy.read()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await control.GetProfile(worker_pb2.GetProfileRequest(remeasure=True))
            assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            busy.cancel()
            while (await runtime.stats()).num_running:
                await asyncio.sleep(0.05)
            reply = await control.GetProfile(worker_pb2.GetProfileRequest(remeasure=True))
            assert WorkerProfile.from_pb(reply.profile) == runtime.held_profile
            stats = await runtime.stats()
            assert stats.num_kv_blocks_free == stats.num_kv_blocks_total

    asyncio.run(asyncio.wait_for(body(), timeout=120))
