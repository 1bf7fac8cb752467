"""The consumer side of KvTransferService: pull a handle's blocks and verify them (the lease
release, which needs no torch, is common/kv/release.py)."""

from __future__ import annotations

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
    """Pulls every block under the handle's lease (of a compressed prompt, the kept ones);
    raises our errors on failure.

    Runs in a CLIENT span ``kv_transfer`` whose context travels to the producer.
    """
    num_blocks = len(handle.kept_block_indices) or -(-handle.num_tokens // layout.block_size)
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
