"""A decode worker whose KV pull fails: from a dead producer it loads the full blocks the
block store holds (which the prefill worker wrote through to it), then recomputes the rest,
or with ``--kv-load-failure fail`` refuses with UNAVAILABLE (reason KV_LOAD_FAILED); a
producer that hangs is given up on after --kv-pull-timeout-s, and its lease is still
released once it answers. Every outcome generates exactly what an undisturbed run does,
and leaves no block held. Real workers (a tiny random llama) and block store, in process.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from common.engine.config import EngineConfig
from common.kv.hashing import HASH_SCHEME_VERSION
from common.rpc.errors import reason_of
from common.rpc.server import Server, create_server
from pdserve.common.v1 import common_pb2
from pdserve.decode.v1 import decode_pb2, decode_pb2_grpc
from pdserve.kv.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from pdserve.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from services.blockstore import server as blockstore_server
from services.blockstore.config import BlockStoreConfig
from services.worker.config import WorkerConfig
from services.worker.runtime import WorkerRuntime
from services.worker.serve import start_worker
from services.worker.server import add_servicers
from tests.factories import make_tiny_checkpoint

PROMPT = list(range(3, 56))  # 53 tokens: 3 full blocks of 16 and a partial one
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", "llama")


def worker_config(model_dir: Path, role: str, blockstore: str | None, **extra: Any) -> WorkerConfig:
    engine = EngineConfig(
        model=str(model_dir), num_kv_blocks=64, block_size=16, device="cpu", dtype="float32"
    )
    return WorkerConfig(role=role, engine=engine, port=0, blockstore=blockstore, **extra)


def dead_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"  # closed again: nothing listens there


@dataclass
class Decoder:
    runtime: WorkerRuntime
    stub: decode_pb2_grpc.DecodeServiceStub

    async def run(self, request: decode_pb2.DecodeRequest) -> list[int]:
        tokens: list[int] = []
        async for message in self.stub.Decode(request, timeout=30):
            tokens += list(message.token_ids)
        return tokens

    def fallbacks(self, outcome: str) -> float:
        value = self.runtime.metrics.registry.get_sample_value(
            "pdserve:kv_load_fallbacks_total", {"outcome": outcome}
        )
        return value or 0.0

    async def all_free(self) -> bool:
        stats = await self.runtime.stats()
        return stats.num_kv_blocks_free == stats.num_kv_blocks_total and not stats.num_held


def request(request_id: str, **fields: Any) -> decode_pb2.DecodeRequest:
    message = decode_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=PROMPT, **fields)
    message.sampling.max_tokens = MAX_TOKENS
    message.sampling.temperature = 0.0
    message.sampling.ignore_eos = True
    return message


def handle_for(runtime: WorkerRuntime, producer: str, lease_id: str) -> common_pb2.KvHandle:
    """A handle as a prefill worker of this model would make it for PROMPT."""
    return common_pb2.KvHandle(
        request_id="r-handle",
        hash_scheme_version=HASH_SCHEME_VERSION,
        block_hashes=runtime.block_hashes(PROMPT, None),
        num_tokens=len(PROMPT),
        layout=runtime.layout.to_pb(),
        producer_address=producer,
        lease_id=lease_id,
        model=runtime.model,
    )


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), timeout=120))


async def start_decoder(
    tiny_dir: Path,
    blockstore: str | None,
    cleanup: list[Callable[[], Awaitable[Any]]],
    **extra: Any,
) -> Decoder:
    server, runtime = await start_worker(
        worker_config(tiny_dir, "decode", blockstore, **extra), add_servicers
    )
    channel = grpc.aio.insecure_channel(runtime.address)
    cleanup += [channel.close, runtime.stop, lambda: server.stop(0)]
    return Decoder(runtime, decode_pb2_grpc.DecodeServiceStub(channel))


async def reference(decoder: Decoder, cache_salt: str = "") -> list[int]:
    """The undisturbed run: the decode worker prefills the prompt itself (and writes its full
    blocks behind to the store, when there is one, under ``cache_salt``)."""
    return await decoder.run(request("r-reference", local_prefill=True, cache_salt=cache_salt))


async def close_all(cleanup: list[Callable[[], Awaitable[Any]]]) -> None:
    for close in reversed(cleanup):
        await close()


def test_dead_producer_falls_back_to_the_blocks_it_wrote_to_the_store(tiny_dir: Path) -> None:
    async def body() -> None:
        cleanup: list[Callable[[], Awaitable[Any]]] = []
        try:
            store = await blockstore_server.start(BlockStoreConfig(capacity_bytes=64 << 20, port=0))
            cleanup.append(store.stop)
            store_address = f"127.0.0.1:{store.port}"
            prefill_server, prefill = await start_worker(
                worker_config(tiny_dir, "prefill", store_address), add_servicers
            )
            decoder = await start_decoder(tiny_dir, store_address, cleanup)
            expected = await reference(decoder)
            await decoder.runtime.loop.call(lambda e: e.kv.pool.evict_all_cached())

            async with grpc.aio.insecure_channel(prefill.address) as channel:
                prefill_request = prefill_pb2.PrefillRequest(
                    request_id="r-pd", prompt_token_ids=PROMPT, lease_id="lease-pd"
                )
                prefill_request.sampling.max_tokens = MAX_TOKENS
                prefill_request.sampling.temperature = 0.0
                prefill_request.sampling.ignore_eos = True
                prefilled = await prefill_pb2_grpc.PrefillServiceStub(channel).Prefill(
                    prefill_request, timeout=30
                )
            assert prefilled.first_token_id == expected[0]
            # The write-through reaches the store, then the producer dies with the lease.
            for _ in range(100):
                if store.store.committed_hashes().get(prefill.model):
                    break
                await asyncio.sleep(0.05)
            assert len(store.store.committed_hashes()[prefill.model]) == 3
            await prefill_server.stop(0)
            await prefill.stop()

            got = await decoder.run(
                request(
                    "r-pd",
                    kv_handle=prefilled.kv_handle,
                    generated_token_ids=[prefilled.first_token_id],
                )
            )
            assert got == expected[1:]
            assert decoder.fallbacks("block_store") == 1
            assert decoder.fallbacks("recompute") == 0
            assert await decoder.all_free()
        finally:
            await close_all(cleanup)

    run(body)


@pytest.mark.parametrize("with_store", [False, True], ids=["no_store", "store_lacks_it"])
def test_dead_producer_and_nothing_stored_recomputes(tiny_dir: Path, with_store: bool) -> None:
    async def body() -> None:
        cleanup: list[Callable[[], Awaitable[Any]]] = []
        try:
            store_address = None
            if with_store:
                store = await blockstore_server.start(
                    BlockStoreConfig(capacity_bytes=64 << 20, port=0)
                )
                cleanup.append(store.stop)
                store_address = f"127.0.0.1:{store.port}"
            decoder = await start_decoder(tiny_dir, store_address, cleanup)
            # Under another salt, so the blocks it writes behind are not the prompt's: the
            # store lacks them (greedy tokens do not depend on the salt).
            expected = await reference(decoder, cache_salt="reference-only")
            await decoder.runtime.loop.call(lambda e: e.kv.pool.evict_all_cached())
            handle = handle_for(decoder.runtime, dead_address(), "lease-x")
            got = await decoder.run(
                request("r-dead", kv_handle=handle, generated_token_ids=[expected[0]])
            )
            assert got == expected[1:]
            assert decoder.fallbacks("recompute") == 1
            assert await decoder.all_free()
        finally:
            await close_all(cleanup)

    run(body)


def test_kv_load_failure_fail_refuses_with_a_clear_status(tiny_dir: Path) -> None:
    async def body() -> None:
        cleanup: list[Callable[[], Awaitable[Any]]] = []
        try:
            decoder = await start_decoder(tiny_dir, None, cleanup, kv_load_failure="fail")
            handle = handle_for(decoder.runtime, dead_address(), "lease-y")
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await decoder.run(request("r-fail", kv_handle=handle, generated_token_ids=[7]))
            error = caught.value
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert reason_of(error) == "KV_LOAD_FAILED"
            assert "--kv-load-failure fail" in (error.details() or "")
            assert handle.producer_address in (error.details() or "")
            assert decoder.fallbacks("failed") == 1
            assert await decoder.all_free()
        finally:
            await close_all(cleanup)

    run(body)


class HungProducer(kv_transfer_pb2_grpc.KvTransferServiceServicer):
    """Accepts pulls and never answers them; answers releases only once ``wake`` is set."""

    def __init__(self) -> None:
        self.wake = asyncio.Event()
        self.released: list[str] = []

    async def PullBlocks(self, request: Any, context: Any) -> AsyncIterator[Any]:
        await asyncio.sleep(3600)
        yield kv_transfer_pb2.PullBlocksResponse()

    async def ReleaseLease(self, request: Any, context: Any) -> Any:
        await self.wake.wait()
        self.released.append(request.lease_id)
        return kv_transfer_pb2.ReleaseLeaseResponse(released=True)


def test_a_hung_producer_is_given_up_on_and_released_when_it_answers(tiny_dir: Path) -> None:
    async def body() -> None:
        cleanup: list[Callable[[], Awaitable[Any]]] = []
        try:
            producer = HungProducer()
            server: Server = await create_server(
                "127.0.0.1:0",
                lambda s: kv_transfer_pb2_grpc.add_KvTransferServiceServicer_to_server(producer, s),
                [],
            )
            cleanup.append(lambda: server.stop(0))
            decoder = await start_decoder(tiny_dir, None, cleanup, kv_pull_timeout_s=0.5)
            expected = await reference(decoder)
            await decoder.runtime.loop.call(lambda e: e.kv.pool.evict_all_cached())
            handle = handle_for(decoder.runtime, f"127.0.0.1:{server.port}", "lease-hung")
            handle.lease_expiry_unix_ms = 0  # unknown: retried for RELEASE_RETRY_S
            loop = asyncio.get_running_loop()
            start = loop.time()
            got = await decoder.run(
                request("r-hung", kv_handle=handle, generated_token_ids=[expected[0]])
            )
            assert got == expected[1:]
            assert loop.time() - start < 10  # not the 30 s deadline of the call
            assert decoder.fallbacks("recompute") == 1
            await asyncio.sleep(0.5)
            producer.wake.set()  # it resumes: a retried release gets through
            for _ in range(200):
                if producer.released:
                    break
                await asyncio.sleep(0.05)
            assert "lease-hung" in producer.released
        finally:
            await close_all(cleanup)

    run(body)
