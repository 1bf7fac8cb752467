"""KvTransferService: streams a lease's blocks to a consumer, and takes the lease back."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from common.errors import InvalidRequestError
from common.kv.layout import KvLayout, block_pieces
from common.kv.leases import LeaseTable
from common.rpc.errors import rpc_method
from common.rpc.options import KV_CHUNK_BYTES
from pdserve.kv.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc


class KvTransferServicer(kv_transfer_pb2_grpc.KvTransferServiceServicer):
    def __init__(self, leases: LeaseTable, layout: KvLayout) -> None:
        self.leases = leases
        self.layout = layout

    @rpc_method
    async def PullBlocks(
        self, request: kv_transfer_pb2.PullBlocksRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kv_transfer_pb2.PullBlocksResponse]:
        if not request.lease_id or not request.request_id:
            raise InvalidRequestError("lease_id", "lease_id and request_id are required")
        max_chunk = KV_CHUNK_BYTES
        if request.HasField("max_chunk_bytes"):
            if request.max_chunk_bytes == 0:
                raise InvalidRequestError("max_chunk_bytes", "must be > 0")
            max_chunk = min(request.max_chunk_bytes, KV_CHUNK_BYTES)
        lease = self.leases.get(request.lease_id, request.request_id)
        num_blocks = lease.data.shape[0]
        start = request.start_block_index
        if start >= num_blocks:
            raise InvalidRequestError(
                "start_block_index", f"{start} is past the last block ({num_blocks - 1})"
            )
        first = True
        for piece in block_pieces(
            lease.data[start:], lease.block_hashes[start:], max_chunk, first_index=start
        ):
            message = kv_transfer_pb2.PullBlocksResponse()
            piece.fill(message.chunk)
            if first:
                message.layout.CopyFrom(self.layout.to_pb())
                first = False
            yield message

    @rpc_method
    async def ReleaseLease(
        self, request: kv_transfer_pb2.ReleaseLeaseRequest, context: grpc.aio.ServicerContext
    ) -> kv_transfer_pb2.ReleaseLeaseResponse:
        if not request.lease_id:
            raise InvalidRequestError("lease_id", "lease_id is required")
        return kv_transfer_pb2.ReleaseLeaseResponse(
            released=await self.leases.release(request.lease_id)
        )
