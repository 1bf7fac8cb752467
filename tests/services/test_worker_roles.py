"""An engine worker changing its role in place, as a real gRPC server in-process on a tiny
model: which face takes calls in each role, decode streams ended with ROLE_CHANGED when the
worker leaves the decode role (its KV freed, its prefix cache kept), one change at a time,
and bad requests refused with a status that says why."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from common.engine.config import EngineConfig
from common.rpc.channels import create_channel
from common.rpc.errors import reason_of
from pdserve.common.v1 import common_pb2
from pdserve.decode.v1 import decode_pb2, decode_pb2_grpc
from pdserve.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from pdserve.worker.v1 import worker_pb2, worker_pb2_grpc
from services.worker.config import WorkerConfig
from services.worker.runtime import WorkerRuntime
from services.worker.serve import start_worker
from services.worker.server import add_servicers
from tests.factories import make_tiny_checkpoint

PROMPT = list(range(3, 40))
PREFILL, DECODE, BOTH = (
    common_pb2.WORKER_ROLE_PREFILL,
    common_pb2.WORKER_ROLE_DECODE,
    common_pb2.WORKER_ROLE_BOTH,
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", "llama")


@dataclass
class Worker:
    runtime: WorkerRuntime
    control: worker_pb2_grpc.WorkerServiceStub
    decode: decode_pb2_grpc.DecodeServiceStub
    prefill: prefill_pb2_grpc.PrefillServiceStub


@contextlib.asynccontextmanager
async def engine_worker(model_dir: Path, role: str) -> AsyncIterator[Worker]:
    engine = EngineConfig(
        model=str(model_dir), num_kv_blocks=64, block_size=16, device="cpu", dtype="float32"
    )
    config = WorkerConfig(role=role, engine=engine, worker_id="w0")
    server, runtime = await start_worker(config, add_servicers)
    channel = create_channel(f"127.0.0.1:{server.port}")
    try:
        yield Worker(
            runtime,
            worker_pb2_grpc.WorkerServiceStub(channel),
            decode_pb2_grpc.DecodeServiceStub(channel),
            prefill_pb2_grpc.PrefillServiceStub(channel),
        )
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


def prefill_request(request_id: str) -> prefill_pb2.PrefillRequest:
    return prefill_pb2.PrefillRequest(
        request_id=request_id,
        prompt_token_ids=PROMPT,
        sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0),
    )


async def read_all(call: grpc.aio.UnaryStreamCall) -> list[decode_pb2.DecodeResponse]:
    messages = []
    while (message := await call.read()) is not grpc.aio.EOF:
        messages.append(message)
    return messages


async def all_free(runtime: WorkerRuntime) -> bool:
    stats = await runtime.stats()
    return stats.num_kv_blocks_free == stats.num_kv_blocks_total and stats.num_running == 0


def run(body: object) -> None:
    asyncio.run(asyncio.wait_for(body, timeout=60))  # type: ignore[arg-type]


def test_each_role_admits_its_faces_and_refuses_the_other(tiny_dir: Path) -> None:
    async def body() -> None:
        async with engine_worker(tiny_dir, "prefill") as w:
            reply = await w.prefill.Prefill(prefill_request("p1"))
            assert reply.kv_handle.num_tokens == len(PROMPT)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await read_all(w.decode.Decode(decode_request("d1", 3)))
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
            assert reason_of(refused.value) == "ROLE_CHANGED"
            assert "prefill role" in (refused.value.details() or "")

            changed = await w.control.SetRole(worker_pb2.SetRoleRequest(role=BOTH))
            assert (changed.previous_role, changed.role) == (PREFILL, BOTH)
            messages = await read_all(w.decode.Decode(decode_request("d2", 3)))
            assert sum(len(m.token_ids) for m in messages) == 3
            assert (await w.prefill.Prefill(prefill_request("p2"))).kv_handle.num_tokens

            await w.control.SetRole(worker_pb2.SetRoleRequest(role=DECODE))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await w.prefill.Prefill(prefill_request("p3"))
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
            assert reason_of(refused.value) == "ROLE_CHANGED"
            status = (await w.decode.GetStatus(decode_pb2.GetStatusRequest())).status
            assert status.role == DECODE and status.num_role_changes == 2
            assert status.role_since_unix_ms > 0

    run(body())


def test_leaving_decode_ends_the_streams_with_role_changed_and_keeps_the_cache(
    tiny_dir: Path,
) -> None:
    async def body() -> None:
        async with engine_worker(tiny_dir, "decode") as w:
            # A finished request leaves its prompt in the prefix cache.
            await read_all(w.decode.Decode(decode_request("warm", 2)))
            calls = [w.decode.Decode(decode_request(f"s{i}", 400)) for i in range(3)]
            for call in calls:
                assert len((await call.read()).token_ids) >= 1
            changed = await w.control.SetRole(worker_pb2.SetRoleRequest(role=PREFILL))
            assert (changed.previous_role, changed.role) == (DECODE, PREFILL)
            assert changed.num_streams_moved == 3
            for call in calls:
                with pytest.raises(grpc.aio.AioRpcError) as ended:
                    await read_all(call)
                assert ended.value.code() is grpc.StatusCode.UNAVAILABLE
                assert reason_of(ended.value) == "ROLE_CHANGED"
            assert await all_free(w.runtime)
            assert w.runtime.decode_calls == set()
            # The prefix cache stayed: the same prompt prefilled now hits it.
            reply = await w.prefill.Prefill(prefill_request("after"))
            assert reply.cached_tokens == (len(PROMPT) - 1) // 16 * 16

    run(body())


def test_a_second_change_while_one_is_in_progress_is_refused_and_changes_nothing(
    tiny_dir: Path,
) -> None:
    async def body() -> None:
        async with engine_worker(tiny_dir, "decode") as w:
            release = asyncio.Event()
            registered = w.runtime._register_now

            async def slow_register() -> None:  # holds the first change in progress
                await release.wait()
                await registered()

            w.runtime._register_now = slow_register  # type: ignore[method-assign]
            first = asyncio.ensure_future(
                w.control.SetRole(worker_pb2.SetRoleRequest(role=PREFILL))
            )
            while w.runtime.roles.changing_to is None:
                await asyncio.sleep(0.01)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await w.control.SetRole(worker_pb2.SetRoleRequest(role=BOTH))
            assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert "already changing its role to prefill" in (refused.value.details() or "")
            release.set()
            assert (await first).role == PREFILL
            assert w.runtime.role == "prefill" and w.runtime.roles.num_changes == 1
            # Once done, the next change goes through.
            assert (await w.control.SetRole(worker_pb2.SetRoleRequest(role=BOTH))).role == BOTH

    run(body())


def test_an_unknown_role_is_invalid_argument_and_changes_nothing(tiny_dir: Path) -> None:
    async def body() -> None:
        async with engine_worker(tiny_dir, "decode") as w:
            for value in (common_pb2.WORKER_ROLE_UNSPECIFIED, common_pb2.WORKER_ROLE_GATEWAY, 42):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await w.control.SetRole(worker_pb2.SetRoleRequest(role=value))
                assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                assert "WORKER_ROLE_PREFILL, WORKER_ROLE_DECODE or WORKER_ROLE_BOTH" in (
                    refused.value.details() or ""
                )
            assert w.runtime.role == "decode" and w.runtime.roles.num_changes == 0

    run(body())


def test_a_draining_worker_keeps_its_role(tiny_dir: Path) -> None:
    async def body() -> None:
        async with engine_worker(tiny_dir, "decode") as w:
            await w.runtime.begin_drain()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await w.control.SetRole(worker_pb2.SetRoleRequest(role=PREFILL))
            assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert w.runtime.role == "decode"

    run(body())
