"""The consumer side of KvTransferService: pull a handle's blocks, verify, release."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc
import torch
from opentelemetry.trace import SpanKind

from common.kv.layout import BlockAssembler, KvLayout
from common.rpc.errors import from_rpc_error
from common.rpc.tracing import outgoing_metadata, record_error
from common.telemetry.tracing import tracer
from pdserve.common.v1 import common_pb2
from pdserve.kv.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

RELEASE_RETRY_S = 60.0  # how long a lease release is retried when the producer does not answer
RELEASE_BACKOFF_S = 0.5
RELEASE_MAX_BACKOFF_S = 4.0
_NO_ANSWER = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN}
)


@dataclass
class PulledKv:
    data: torch.Tensor  # [n, L, 2, S, Hkv, D]
    num_bytes: int
    num_blocks: int
    num_chunks: int
    elapsed_ms: float


def transfer_attributes(num_bytes: int, num_blocks: int, seconds: float) -> dict[str, float]:
    """What a KV transfer span records (``pdserve.kv.*``)."""
    return {
        "pdserve.kv.bytes": num_bytes,
        "pdserve.kv.blocks": num_blocks,
        "pdserve.kv.duration_ms": seconds * 1000,
        "pdserve.kv.gbps": num_bytes / seconds / 1e9 if seconds > 0 else 0.0,
    }


async def pull_kv(
    channel: grpc.aio.Channel,
    handle: common_pb2.KvHandle,
    layout: KvLayout,
    timeout_s: float | None,
) -> PulledKv:
    """Pulls every block under the handle's lease; raises our errors on failure.

    Runs in a CLIENT span ``kv_transfer`` whose context travels to the producer.
    """
    num_blocks = -(-handle.num_tokens // layout.block_size)
    with tracer().start_as_current_span("kv_transfer", kind=SpanKind.CLIENT) as span:
        span.set_attributes(
            {
                "rpc.system": "grpc",
                "rpc.service": "pdserve.kv.v1.KvTransferService",
                "rpc.method": "PullBlocks",
                "server.address": handle.producer_address,
                "pdserve.kv.source": "producer",
                "pdserve.kv.lease_id": handle.lease_id,
                "pdserve.kv.num_tokens": handle.num_tokens,
            }
        )
        start = time.perf_counter()
        assembler = BlockAssembler(layout, num_blocks)
        stub = kv_transfer_pb2_grpc.KvTransferServiceStub(channel)
        request = kv_transfer_pb2.PullBlocksRequest(
            lease_id=handle.lease_id, request_id=handle.request_id
        )
        num_chunks = 0
        try:
            async for message in stub.PullBlocks(
                request, timeout=timeout_s, metadata=outgoing_metadata()
            ):
                if message.HasField("layout"):
                    layout.check_same(KvLayout.from_pb(message.layout), "pulled KV")
                assembler.add(message.chunk)
                num_chunks += 1
            data = assembler.tensor()
        except grpc.aio.AioRpcError as exc:
            record_error(span, exc)
            raise from_rpc_error(exc, f"pulling KV from {handle.producer_address}") from exc
        except BaseException as exc:
            record_error(span, exc)
            raise
        seconds = time.perf_counter() - start
        span.set_attributes(transfer_attributes(assembler.num_bytes, num_blocks, seconds))
        span.set_attribute("pdserve.kv.chunks", num_chunks)
    return PulledKv(data, assembler.num_bytes, num_blocks, num_chunks, seconds * 1000)


async def release_lease(
    channel: grpc.aio.Channel,
    lease_id: str,
    timeout_s: float = 5.0,
    retry_for_s: float = 0.0,
    expiry_unix_ms: int = 0,
) -> bool:
    """Hands a lease back; True when it was live. A producer that cannot be reached or does
    not answer (dead, restarting, or hung: SIGSTOPped, swapping) is asked again, with
    backoff, for ``retry_for_s`` or until the lease would have expired anyway
    (``expiry_unix_ms``, when known), so that a producer that resumes frees the blocks then
    instead of holding them until the lease's TTL. A release that arrives before the lease
    exists leaves a tombstone there (see common/kv/leases.py), so asking early is safe."""
    give_up = time.monotonic() + retry_for_s
    if expiry_unix_ms:
        give_up = min(give_up, time.monotonic() + expiry_unix_ms / 1000 - time.time())
    backoff = RELEASE_BACKOFF_S
    while True:
        released = await _release_once(channel, lease_id, timeout_s)
        if released is not None:
            return released
        if time.monotonic() + backoff >= give_up:
            return False  # the producer is gone: its lease died with it, or expires
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, RELEASE_MAX_BACKOFF_S)


async def _release_once(channel: grpc.aio.Channel, lease_id: str, timeout_s: float) -> bool | None:
    """True/False: the producer answered (the lease was live / was not); None: no answer."""
    stub = kv_transfer_pb2_grpc.KvTransferServiceStub(channel)
    try:
        response = await stub.ReleaseLease(
            kv_transfer_pb2.ReleaseLeaseRequest(lease_id=lease_id),
            timeout=timeout_s,
            metadata=outgoing_metadata(),
        )
    except grpc.aio.AioRpcError as exc:
        if exc.code() in _NO_ANSWER:
            return None
        return False
    return bool(response.released)
