"""A decode worker draining (SIGTERM), as a real gRPC server in-process on a tiny model: it
refuses new calls at once, lets streams in flight finish within the grace period, and
ends the rest with UNAVAILABLE (reason DRAINING) so that the gateway resumes them."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from common.engine.config import EngineConfig
from common.rpc.channels import create_channel
from common.rpc.errors import reason_of
from pdserve.common.v1 import common_pb2
from pdserve.decode.v1 import decode_pb2, decode_pb2_grpc
from services.worker.config import WorkerConfig
from services.worker.runtime import WorkerRuntime
from services.worker.serve import drain_worker, start_worker
from services.worker.server import add_servicers
from tests.factories import make_tiny_checkpoint

PROMPT = list(range(3, 40))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", "llama")


@contextlib.asynccontextmanager
async def decode_worker(
    model_dir: Path,
) -> AsyncIterator[tuple[WorkerRuntime, decode_pb2_grpc.DecodeServiceStub]]:
    engine = EngineConfig(
        model=str(model_dir), num_kv_blocks=64, block_size=16, device="cpu", dtype="float32"
    )
    server, runtime = await start_worker(WorkerConfig(role="decode", engine=engine), add_servicers)
    channel = create_channel(f"127.0.0.1:{server.port}")
    try:
        yield runtime, decode_pb2_grpc.DecodeServiceStub(channel)
    finally:
        await channel.close()
        await server.stop(0)
        await runtime.stop()


def decode_request(request_id: str, max_tokens: int) -> decode_pb2.DecodeRequest:
    return decode_pb2.DecodeRequest(
        request_id=request_id,
        prompt_token_ids=PROMPT,
        local_prefill=True,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


async def read_all(call: grpc.aio.UnaryStreamCall) -> list[decode_pb2.DecodeResponse]:
    messages = []
    while (message := await call.read()) is not grpc.aio.EOF:
        messages.append(message)
    return messages


async def wait_draining(runtime: WorkerRuntime) -> None:
    while not runtime.draining:
        await asyncio.sleep(0.01)


def run(body: object) -> None:
    asyncio.run(asyncio.wait_for(body, timeout=60))  # type: ignore[arg-type]


def test_streams_in_flight_finish_within_the_grace_period(tiny_dir: Path) -> None:
    async def body() -> None:
        async with decode_worker(tiny_dir) as (runtime, stub):
            call = stub.Decode(decode_request("short", 6))
            first = await call.read()
            assert len(first.token_ids) == 1
            start = time.monotonic()
            drain = asyncio.create_task(drain_worker(runtime, grace_s=30.0))
            await wait_draining(runtime)
            # No new work: refused at once, and said so everywhere.
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Decode(decode_request("late", 4)).read()
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
            assert reason_of(refused.value) == "DRAINING"
            status = (await stub.GetStatus(decode_pb2.GetStatusRequest())).status
            assert status.draining and status.pid == os.getpid()
            # The stream in flight finishes normally, and the drain ends right after it.
            messages = [first, *await read_all(call)]
            assert sum(len(m.token_ids) for m in messages) == 6
            assert messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert await call.code() is grpc.StatusCode.OK
            await drain
            assert time.monotonic() - start < 10.0
            stats = await runtime.stats()
            assert stats.num_kv_blocks_free == stats.num_kv_blocks_total

    run(body())


def test_streams_left_at_the_end_of_the_grace_period_end_unavailable(tiny_dir: Path) -> None:
    async def body() -> None:
        async with decode_worker(tiny_dir) as (runtime, stub):
            call = stub.Decode(decode_request("long", 500))
            first = await call.read()
            assert len(first.token_ids) == 1
            runtime.loop.submit(lambda engine: time.sleep(1.0))  # the stream cannot finish
            drain = asyncio.create_task(drain_worker(runtime, grace_s=0.3))
            await wait_draining(runtime)
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await read_all(call)
            assert ended.value.code() is grpc.StatusCode.UNAVAILABLE
            assert reason_of(ended.value) == "DRAINING"
            await drain
            stats = await runtime.stats()
            assert stats.num_kv_blocks_free == stats.num_kv_blocks_total
            assert stats.num_running == stats.num_waiting == 0

    run(body())
