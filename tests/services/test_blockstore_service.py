"""The block store as a real gRPC server (port 0, in-process), through BlockStoreClient and
raw stubs; and, with a real redis-server, its prefix-index entries and registry heartbeat."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.errors import (
    DataLossError,
    FailedPreconditionError,
    NotFoundError,
    QueueFullError,
)
from common.index import keys
from common.index.prefix_index import PrefixIndex
from common.index.registry import WorkerRegistry
from common.kv.block_store_client import BlockStoreClient
from common.kv.layout import BlockAssembler, KvLayout, block_chunks
from common.rpc.channels import create_channel
from common.rpc.errors import reason_of
from pdserve.common.v1 import common_pb2
from pdserve.kv.v1 import block_store_pb2, block_store_pb2_grpc
from services.blockstore.config import BlockStoreConfig
from services.blockstore.server import BlockStoreProcess, start
from services.blockstore.servicer import SERVICE_NAME
from tests.polling import until_async
from tests.redis_server import redis_server

pytestmark = pytest.mark.redis

# [n, L=2, 2, S=4, Hkv=2, D=8] bfloat16: 512 bytes a block
LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.bfloat16)
BLOCK = LAYOUT.bytes_per_block
MODEL = "tiny"


def random_blocks(num_blocks: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, *LAYOUT.block_shape, generator=generator).to(torch.bfloat16)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), timeout=60))


@contextlib.asynccontextmanager
async def block_store(num_blocks: int = 64, **overrides: Any) -> AsyncIterator[BlockStoreProcess]:
    config = BlockStoreConfig(
        capacity_bytes=num_blocks * BLOCK, host="127.0.0.1", port=0, drain_grace_s=1.0, **overrides
    )
    process = await start(config)
    try:
        yield process
    finally:
        await process.stop()


@contextlib.asynccontextmanager
async def client_and_stub(
    process: BlockStoreProcess, layout: KvLayout = LAYOUT
) -> AsyncIterator[tuple[BlockStoreClient, block_store_pb2_grpc.BlockStoreServiceStub]]:
    client = BlockStoreClient(f"127.0.0.1:{process.port}", MODEL, layout)
    channel = create_channel(f"127.0.0.1:{process.port}")
    try:
        yield client, block_store_pb2_grpc.BlockStoreServiceStub(channel)
    finally:
        await client.close()
        await channel.close()


async def begin(stub: Any, hashes: list[int]) -> block_store_pb2.BeginPutResponse:
    return await stub.BeginPut(
        block_store_pb2.BeginPutRequest(
            block_hashes=hashes, layout=LAYOUT.to_pb(), model=MODEL, hash_scheme_version=1
        )
    )


def put_stream(
    put_id: str, blocks: torch.Tensor, hashes: list[int], **kwargs: Any
) -> Iterator[Any]:
    for chunk in block_chunks(blocks, hashes, **kwargs):
        yield block_store_pb2.PutBlocksRequest(put_id=put_id, chunk=chunk)


async def status_of(call: Awaitable[Any]) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value.code()


# -- round trips ------------------------------------------------------------------------------


def test_put_get_round_trip_is_bit_exact() -> None:
    async def body() -> None:
        async with block_store() as process, client_and_stub(process) as (client, _):
            blocks = random_blocks(5)
            hashes = [101, 102, 103, 104, 105]
            assert await client.put(hashes, blocks, timeout_s=10) == 5
            assert await client.put(hashes, blocks, timeout_s=10) == 0  # nothing missing
            got = await client.get([103, 101, 105], timeout_s=10)
            assert got.dtype == torch.bfloat16
            assert same_bits(got, blocks[[2, 0, 4]])
            assert same_bits(await client.get(hashes), blocks)

    run(body)


def test_put_sends_only_the_missing_blocks() -> None:
    async def body() -> None:
        async with block_store() as process, client_and_stub(process) as (client, _):
            blocks = random_blocks(4)
            await client.put([1, 3], blocks[[0, 2]])
            assert await client.put([1, 2, 3, 4], blocks) == 2
            assert same_bits(await client.get([1, 2, 3, 4]), blocks)

    run(body)


def test_multi_chunk_blocks_both_ways() -> None:
    async def body() -> None:
        async with block_store() as process, client_and_stub(process) as (_, stub):
            blocks = random_blocks(3, seed=1)
            hashes = [7, 8, 9]
            opened = await begin(stub, hashes)
            sent = await stub.PutBlocks(
                put_stream(opened.put_id, blocks, hashes, max_chunk_bytes=300)
            )
            assert sent.num_blocks_received == 3
            assert (
                await stub.CommitPut(block_store_pb2.CommitPutRequest(put_id=opened.put_id))
            ).num_blocks_committed == 3

            call = stub.GetBlocks(
                block_store_pb2.GetBlocksRequest(
                    block_hashes=hashes, model=MODEL, hash_scheme_version=1, max_chunk_bytes=300
                )
            )
            responses = [r async for r in call]
            assert BLOCK == 512
            assert len(responses) == 3 * 2  # 512 bytes in chunks of 300
            assert [r.HasField("layout") for r in responses] == [True] + [False] * 5
            assert KvLayout.from_pb(responses[0].layout) == LAYOUT
            assembler = BlockAssembler(LAYOUT, 3)
            for response in responses:
                assembler.add(response.chunk)
            assert assembler.hashes == hashes
            assert same_bits(assembler.tensor(), blocks)

    run(body)


def test_contains_reports_the_longest_present_prefix() -> None:
    async def body() -> None:
        async with block_store() as process, client_and_stub(process) as (client, stub):
            blocks = random_blocks(3)
            await client.put([1, 2, 4], blocks)
            assert await client.contains([1, 2, 3, 4]) == 2
            assert await client.contains([3, 1]) == 0
            assert await client.contains([]) == 0
            response = await stub.ContainsBlocks(
                block_store_pb2.ContainsBlocksRequest(
                    block_hashes=[1, 2, 3, 4], model=MODEL, hash_scheme_version=1
                )
            )
            assert response.num_prefix_present == 2
            assert list(response.present) == [True, True, False, True]

    run(body)


# -- error statuses ---------------------------------------------------------------------------


def test_a_corrupt_block_is_data_loss_and_the_put_stays_open() -> None:
    async def body() -> None:
        async with block_store() as process, client_and_stub(process) as (client, stub):
            blocks = random_blocks(2)
            opened = await begin(stub, [1, 2])
            requests = list(put_stream(opened.put_id, blocks, [1, 2]))
            requests[1].chunk.block_crc32c ^= 1
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.PutBlocks(iter(requests))
            assert info.value.code() == grpc.StatusCode.DATA_LOSS
            assert reason_of(info.value) == "DATA_LOSS"
            assert await client.contains([1, 2]) == 0

            commit = stub.CommitPut(block_store_pb2.CommitPutRequest(put_id=opened.put_id))
            assert await status_of(commit) == grpc.StatusCode.FAILED_PRECONDITION
            resent = await stub.PutBlocks(put_stream(opened.put_id, blocks[1:], [2], first_index=1))
            assert resent.num_blocks_received == 1
            await stub.CommitPut(block_store_pb2.CommitPutRequest(put_id=opened.put_id))
            assert same_bits(await client.get([1, 2]), blocks)

    run(body)


def test_unknown_put_is_not_found() -> None:
    async def body() -> None:
        async with block_store() as process, client_and_stub(process) as (_, stub):
            blocks = random_blocks(1)
            assert (
                await status_of(stub.PutBlocks(put_stream("nope", blocks, [1])))
                == grpc.StatusCode.NOT_FOUND
            )
            commit = stub.CommitPut(block_store_pb2.CommitPutRequest(put_id="nope"))
            assert await status_of(commit) == grpc.StatusCode.NOT_FOUND
            aborted = await stub.AbortPut(block_store_pb2.AbortPutRequest(put_id="nope"))
            assert aborted.aborted is False
            empty = stub.CommitPut(block_store_pb2.CommitPutRequest(put_id=""))
            assert await status_of(empty) == grpc.StatusCode.INVALID_ARGUMENT

    run(body)


def test_an_expired_put_is_not_found() -> None:
    async def body() -> None:
        async with block_store(put_expiry_s=0.2) as process, client_and_stub(process) as (_, stub):
            opened = await begin(stub, [1])
            assert opened.put_expiry_unix_ms == pytest.approx(time.time() * 1000 + 200, abs=500)
            await asyncio.sleep(0.3)
            commit = stub.CommitPut(block_store_pb2.CommitPutRequest(put_id=opened.put_id))
            assert await status_of(commit) == grpc.StatusCode.NOT_FOUND
            assert process.store.stats().reserved_bytes == 0

    run(body)


def test_a_full_store_is_resource_exhausted() -> None:
    async def body() -> None:
        async with block_store(num_blocks=2) as process, client_and_stub(process) as (client, stub):
            await begin(stub, [1, 2])  # reserves the whole store, never committed
            assert await status_of(begin(stub, [3])) == grpc.StatusCode.RESOURCE_EXHAUSTED
            with pytest.raises(QueueFullError, match="no room"):
                await client.put([3], random_blocks(1))
            assert await status_of(begin(stub, [4, 5, 6])) == grpc.StatusCode.RESOURCE_EXHAUSTED

    run(body)


def test_invalid_requests_and_preconditions() -> None:
    async def body() -> None:
        async with block_store() as process, client_and_stub(process) as (client, stub):
            assert await status_of(begin(stub, [])) == grpc.StatusCode.INVALID_ARGUMENT
            assert await status_of(begin(stub, [1, 0])) == grpc.StatusCode.INVALID_ARGUMENT
            bad_layout = LAYOUT.to_pb()
            bad_layout.bytes_per_block += 1
            no_layout = stub.BeginPut(
                block_store_pb2.BeginPutRequest(
                    block_hashes=[1], model=MODEL, hash_scheme_version=1
                )
            )
            assert await status_of(no_layout) == grpc.StatusCode.INVALID_ARGUMENT
            mismatched = stub.BeginPut(
                block_store_pb2.BeginPutRequest(
                    block_hashes=[1], layout=bad_layout, model=MODEL, hash_scheme_version=1
                )
            )
            assert await status_of(mismatched) == grpc.StatusCode.INVALID_ARGUMENT
            version_2 = stub.ContainsBlocks(
                block_store_pb2.ContainsBlocksRequest(
                    block_hashes=[1], model=MODEL, hash_scheme_version=2
                )
            )
            assert await status_of(version_2) == grpc.StatusCode.FAILED_PRECONDITION
            zero_chunk = stub.GetBlocks(
                block_store_pb2.GetBlocksRequest(
                    block_hashes=[1], model=MODEL, hash_scheme_version=1, max_chunk_bytes=0
                )
            )
            assert await status_of(_drain(zero_chunk)) == grpc.StatusCode.INVALID_ARGUMENT

            await client.put([1], random_blocks(1))
            other = KvLayout(2, 2, 8, 4, torch.float16)
            async with client_and_stub(process, layout=other) as (other_client, _):
                with pytest.raises(FailedPreconditionError, match="differs"):
                    await other_client.put(
                        [2], torch.zeros(1, *other.block_shape, dtype=torch.float16)
                    )
            with pytest.raises(NotFoundError):
                await client.get([1, 99])

    run(body)


async def _drain(call: Any) -> None:
    async for _ in call:
        pass


def test_get_checks_the_layout_and_checksums_it_receives() -> None:
    async def body() -> None:
        async with block_store() as process, client_and_stub(process) as (client, _):
            await client.put([1], random_blocks(1))
            _, (stored,) = process.store.pin(MODEL, 1, [1])
            process.store.unpin([stored])
            stored.crc32c ^= 1  # the bytes no longer match what travels with them
            with pytest.raises(DataLossError, match="CRC-32C"):
                await client.get([1])

    run(body)


def test_a_put_over_its_budget_is_deadline_exceeded_and_aborted() -> None:
    # 256 blocks of 128 KiB: 32 MiB cannot be streamed within the 20 ms the whole put gets.
    big = KvLayout(num_layers=2, num_kv_heads=8, head_dim=64, block_size=16, dtype=torch.float32)

    async def body() -> None:
        config = BlockStoreConfig(capacity_bytes=256 * big.bytes_per_block, port=0)
        process = await start(config)
        try:
            async with client_and_stub(process, layout=big) as (client, _):
                blocks = torch.zeros(256, *big.block_shape)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await client.put(list(range(1, 257)), blocks, timeout_s=0.02)
                assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                stats = process.store.stats()
                assert (stats.num_open_puts, stats.reserved_bytes, stats.num_blocks) == (0, 0, 0)
        finally:
            await process.stop()

    run(body)


def test_a_draining_store_answers_unavailable() -> None:
    async def body() -> None:
        async with block_store() as process, client_and_stub(process) as (_, stub):
            process.servicer.draining = True
            status = stub.GetStatus(block_store_pb2.GetStatusRequest())
            assert await status_of(status) == grpc.StatusCode.UNAVAILABLE
            assert await status_of(begin(stub, [1])) == grpc.StatusCode.UNAVAILABLE

    run(body)


# -- concurrency ------------------------------------------------------------------------------


def test_concurrent_readers_never_see_an_uncommitted_block() -> None:
    hashes = list(range(1, 17))

    async def body() -> None:
        async with block_store() as process, client_and_stub(process) as (client, stub):
            blocks = random_blocks(len(hashes))
            phase = {"committing": False, "committed": False}
            # (committed when the read began, commit begun when it ended, prefix present, got all)
            seen: list[tuple[bool, bool, int, bool]] = []

            async def reader() -> None:
                while True:
                    committed_at_start = phase["committed"]
                    present = await client.contains(hashes)
                    try:
                        got = same_bits(await client.get(hashes), blocks)
                    except NotFoundError:
                        got = False
                    seen.append((committed_at_start, phase["committing"], present, got))
                    if committed_at_start:
                        return

            readers = [asyncio.create_task(reader()) for _ in range(3)]
            opened = await begin(stub, hashes)
            for i in range(len(hashes)):
                await stub.PutBlocks(
                    put_stream(opened.put_id, blocks[i : i + 1], [hashes[i]], first_index=i)
                )
                await asyncio.sleep(0.01)
            phase["committing"] = True
            await stub.CommitPut(block_store_pb2.CommitPutRequest(put_id=opened.put_id))
            phase["committed"] = True
            await asyncio.gather(*readers)

            before = [(p, g) for _, committing, p, g in seen if not committing]
            after = [(p, g) for committed, _, p, g in seen if committed]
            assert len(before) >= 3 and len(after) == 3
            assert all(p == 0 and not g for p, g in before)
            assert all(p == len(hashes) and g for p, g in after)
            assert [s for s in seen if s[2] not in (0, len(hashes))] == []  # never partly visible

    run(body)


def test_get_pins_every_block_before_streaming_and_unpins_when_cancelled() -> None:
    # [L=2, 2, S=16, Hkv=8, D=64] float32: 128 KiB a block, 256 blocks = 32 MiB, far more than
    # gRPC's flow-control window, so the stream cannot finish before the client reads it.
    big = KvLayout(num_layers=2, num_kv_heads=8, head_dim=64, block_size=16, dtype=torch.float32)
    num_blocks = 256

    async def body() -> None:
        config = BlockStoreConfig(
            capacity_bytes=num_blocks * big.bytes_per_block, port=0, drain_grace_s=1.0
        )
        process = await start(config)
        try:
            async with client_and_stub(process, layout=big) as (client, stub):
                hashes = list(range(1, num_blocks + 1))
                blocks = torch.zeros(num_blocks, *big.block_shape)
                assert await client.put(hashes, blocks, timeout_s=30) == num_blocks
                call = stub.GetBlocks(
                    block_store_pb2.GetBlocksRequest(
                        block_hashes=hashes, model=MODEL, hash_scheme_version=1
                    )
                )
                first = await call.read()
                assert first.chunk.block_index == 0
                assert process.store.stats().pinned_bytes == num_blocks * big.bytes_per_block
                with pytest.raises(QueueFullError, match="pinned by reads"):
                    await client.put([999], blocks[:1])
                call.cancel()

                async def unpinned() -> bool:
                    return process.store.stats().pinned_bytes == 0

                await until_async("unpinned", unpinned, timeout_s=5.0)
                assert await client.put([999], blocks[:1]) == 1  # evicts the LRU block
                assert await client.contains(hashes) == num_blocks - 1  # the tail went
        finally:
            await process.stop()

    run(body)


# -- health, reflection, status ---------------------------------------------------------------


def test_health_reflection_and_status() -> None:
    async def body() -> None:
        async with (
            block_store(num_blocks=10, worker_id="bs-1") as process,
            client_and_stub(process) as (client, stub),
        ):
            channel = create_channel(f"127.0.0.1:{process.port}")
            try:
                health = health_pb2_grpc.HealthStub(channel)
                for service in ("", SERVICE_NAME):
                    reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING

                reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
                call = reflection.ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")])
                )
                reply = await call.read()
                call.cancel()
                names = {s.name for s in reply.list_services_response.service}
                assert SERVICE_NAME == "pdserve.kv.v1.BlockStoreService"
                assert SERVICE_NAME in names
            finally:
                await channel.close()

            await client.put([1, 2, 3], random_blocks(3))
            await begin(stub, [4, 5])
            status = (await stub.GetStatus(block_store_pb2.GetStatusRequest())).status
            assert status.worker_id == "bs-1"
            assert status.role == common_pb2.WORKER_ROLE_BLOCK_STORE
            assert status.address == f"127.0.0.1:{process.port}"
            assert status.model == MODEL
            assert (status.num_kv_blocks_total, status.num_kv_blocks_free) == (10, 8)
            assert status.num_running_requests == 1

    run(body)


# -- Redis: prefix index and registry ---------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    with redis_server(tmp_path) as url:
        yield url


def test_redis_prefix_index_and_registry(redis_url: str) -> None:
    import redis.asyncio

    async def body() -> None:
        redis_client = redis.asyncio.from_url(redis_url)
        index = PrefixIndex(redis_client, MODEL)
        registry = WorkerRegistry(redis_client)
        store = block_store(num_blocks=3, redis_url=redis_url, worker_id="bs-r", heartbeat_s=0.1)
        try:
            async with store as process, client_and_stub(process) as (client, _):
                await client.put([1, 2, 3], random_blocks(3))

                async def indexed() -> bool:
                    return len(await index.lookup([1, 2, 3])) == 3

                await until_async("indexed", indexed, timeout_s=5.0)
                assert await index.lookup([1, 2, 3]) == [{keys.STORE_LOCATION: "memory"}] * 3
                assert 0 < await redis_client.ttl(keys.block(MODEL, 1)) <= 600

                async def registered() -> bool:
                    workers = await registry.list(role="blockstore")
                    return [(w.worker_id, w.model) for w in workers] == [("bs-r", MODEL)]

                await until_async("registered", registered, timeout_s=5.0)
                (info,) = await registry.list(role="blockstore")
                assert info.address == f"127.0.0.1:{process.port}"
                assert info.num_kv_blocks_total == 3

                async def beats_again() -> bool:
                    (again,) = await registry.list(role="blockstore")
                    return again.heartbeat_unix_ms > info.heartbeat_unix_ms

                await until_async("beats_again", beats_again, timeout_s=5.0)

                await client.put([4, 5], random_blocks(2, seed=3))  # evicts 3 and 2, the tail

                async def moved() -> bool:
                    gone = await redis_client.exists(keys.block(MODEL, 3)) == 0
                    return gone and len(await index.lookup([4, 5])) == 2

                await until_async("moved", moved, timeout_s=5.0)
                assert await index.lookup([1, 2]) == [{keys.STORE_LOCATION: "memory"}]
                assert await redis_client.hgetall(keys.block(MODEL, 2)) == {}

            # Stopped: the store left the registry and withdrew its blocks.
            assert await registry.list() == []
            assert await index.lookup([4]) == []
            assert await index.lookup([1]) == []
        finally:
            await redis_client.aclose()

    run(body)


def test_unreachable_redis_fails_start_with_a_clear_error() -> None:
    async def body() -> None:
        url = f"redis://127.0.0.1:{_free_port()}/0"
        with pytest.raises(OSError, match="cannot reach Redis"):
            async with block_store(redis_url=url):
                pass

    run(body)
