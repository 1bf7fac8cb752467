"""The consumer side of KvTransferService: pull a handle's blocks, verify, release."""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc
import torch

from common.kv.layout import BlockAssembler, KvLayout
from common.rpc.errors import from_rpc_error
from pdserve.common.v1 import common_pb2
from pdserve.kv.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc


@dataclass
class PulledKv:
    data: torch.Tensor  # [n, L, 2, S, Hkv, D]
    num_bytes: int
    elapsed_ms: float


async def pull_kv(
    channel: grpc.aio.Channel,
    handle: common_pb2.KvHandle,
    layout: KvLayout,
    timeout_s: float | None,
) -> PulledKv:
    """Pulls every block under the handle's lease; raises our errors on failure."""
    start = time.perf_counter()
    num_blocks = -(-handle.num_tokens // layout.block_size)
    assembler = BlockAssembler(layout, num_blocks)
    stub = kv_transfer_pb2_grpc.KvTransferServiceStub(channel)
    request = kv_transfer_pb2.PullBlocksRequest(
        lease_id=handle.lease_id, request_id=handle.request_id
    )
    try:
        async for message in stub.PullBlocks(request, timeout=timeout_s):
            if message.HasField("layout"):
                layout.check_same(KvLayout.from_pb(message.layout), "pulled KV")
            assembler.add(message.chunk)
    except grpc.aio.AioRpcError as exc:
        raise from_rpc_error(exc, f"pulling KV from {handle.producer_address}") from exc
    data = assembler.tensor()
    return PulledKv(data, assembler.num_bytes, (time.perf_counter() - start) * 1000)


async def release_lease(channel: grpc.aio.Channel, lease_id: str, timeout_s: float = 5.0) -> bool:
    stub = kv_transfer_pb2_grpc.KvTransferServiceStub(channel)
    try:
        response = await stub.ReleaseLease(
            kv_transfer_pb2.ReleaseLeaseRequest(lease_id=lease_id), timeout=timeout_s
        )
    except grpc.aio.AioRpcError:
        return False  # the producer is gone: its lease died with it
    return bool(response.released)
