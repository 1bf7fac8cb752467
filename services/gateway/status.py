"""Cluster status: every live process, with fresh figures asked of each worker directly."""

from __future__ import annotations

import asyncio
import os

import grpc

from common.index.registry import WorkerInfo
from common.rpc.channels import ChannelPool
from pdserve.common.v1 import common_pb2
from pdserve.decode.v1 import decode_pb2, decode_pb2_grpc
from pdserve.kv.v1 import block_store_pb2, block_store_pb2_grpc

ROLES = {
    "prefill": common_pb2.WORKER_ROLE_PREFILL,
    "decode": common_pb2.WORKER_ROLE_DECODE,
    "both": common_pb2.WORKER_ROLE_BOTH,
    "blockstore": common_pb2.WORKER_ROLE_BLOCK_STORE,
    "gateway": common_pb2.WORKER_ROLE_GATEWAY,
    "planner": common_pb2.WORKER_ROLE_PLANNER,
}
ENGINE_ROLES = ("prefill", "decode", "both")
_ORDER = ["gateway", "planner", "prefill", "both", "decode", "blockstore"]
_TIMEOUT_S = 2.0


def _from_registry(info: WorkerInfo) -> common_pb2.WorkerStatus:
    return common_pb2.WorkerStatus(
        worker_id=info.worker_id,
        role=ROLES.get(info.role, common_pb2.WORKER_ROLE_UNSPECIFIED),
        address=info.address,
        model=info.model,
        num_kv_blocks_total=info.num_kv_blocks_total,
        num_kv_blocks_free=info.num_kv_blocks_free,
        num_running_requests=info.num_running,
        num_waiting_requests=info.num_waiting,
        prefix_cache_hit_rate=info.prefix_cache_hit_rate,
        pid=info.pid,
        draining=info.draining,
        weight_format=info.weights,
        role_since_unix_ms=info.role_since_unix_ms,
    )


async def _fresh(info: WorkerInfo, channels: ChannelPool) -> common_pb2.WorkerStatus:
    """The worker's own GetStatus; the registry entry (up to a heartbeat old) if it fails."""
    channel = channels.get(info.address)
    try:
        if info.role in ENGINE_ROLES:  # every engine worker serves both faces
            response = await decode_pb2_grpc.DecodeServiceStub(channel).GetStatus(
                decode_pb2.GetStatusRequest(), timeout=_TIMEOUT_S
            )
        elif info.role == "blockstore":
            response = await block_store_pb2_grpc.BlockStoreServiceStub(channel).GetStatus(
                block_store_pb2.GetStatusRequest(), timeout=_TIMEOUT_S
            )
        else:
            return _from_registry(info)
    except grpc.aio.AioRpcError:
        return _from_registry(info)
    status: common_pb2.WorkerStatus = response.status
    return status


async def cluster_status(
    workers: list[WorkerInfo], channels: ChannelPool, gateway_id: str, address: str, model: str,
    endpoints: list[str] | None = None,
) -> list[common_pb2.WorkerStatus]:  # fmt: skip
    others = [w for w in workers if w.worker_id != gateway_id]
    statuses = list(await asyncio.gather(*(_fresh(w, channels) for w in others)))
    statuses.append(
        common_pb2.WorkerStatus(
            worker_id=gateway_id,
            role=common_pb2.WORKER_ROLE_GATEWAY,
            address=address,
            model=model,
            pid=os.getpid(),
            endpoints=endpoints or [],
        )
    )
    role_rank = {ROLES[r]: i for i, r in enumerate(_ORDER)}
    statuses.sort(key=lambda s: (role_rank.get(s.role, 9), s.worker_id))
    return statuses
