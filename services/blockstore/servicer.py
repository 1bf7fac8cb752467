"""BlockStoreService over the memory store: the only module that touches its messages.

Status codes are those block_store.proto documents; ``@rpc_method`` maps our errors to them
(InvalidRequestError -> INVALID_ARGUMENT, CapacityError -> RESOURCE_EXHAUSTED, ...). Every
store call is synchronous, so a unary RPC runs whole between two awaits (see store.py).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import grpc

from common.errors import InvalidRequestError, UnavailableError
from common.kv.layout import KvLayout, split_block
from common.rpc.errors import rpc_method
from common.rpc.options import KV_CHUNK_BYTES
from pdserve.common.v1 import common_pb2
from pdserve.kv.v1 import block_store_pb2, block_store_pb2_grpc
from services.blockstore.receiver import PutStreamReceiver
from services.blockstore.store import BlockStore

SERVICE_NAME = block_store_pb2.DESCRIPTOR.services_by_name["BlockStoreService"].full_name


class BlockStoreServicer(block_store_pb2_grpc.BlockStoreServiceServicer):
    def __init__(self, store: BlockStore, worker_id: str, address: str) -> None:
        self.store = store
        self.worker_id = worker_id
        self.address = address
        self.draining = False  # set when shutdown begins: new calls get UNAVAILABLE

    @rpc_method
    async def BeginPut(
        self, request: block_store_pb2.BeginPutRequest, context: grpc.aio.ServicerContext
    ) -> block_store_pb2.BeginPutResponse:
        self._check_serving()
        if not request.HasField("layout"):
            raise InvalidRequestError("layout", "missing")
        layout = KvLayout.from_pb(request.layout)
        result = self.store.begin_put(
            request.model, request.hash_scheme_version, layout, list(request.block_hashes)
        )
        return block_store_pb2.BeginPutResponse(
            put_id=result.put_id,
            missing_block_hashes=result.missing_block_hashes,
            put_expiry_unix_ms=result.expiry_unix_ms,
        )

    @rpc_method
    async def PutBlocks(
        self,
        request_iterator: AsyncIterator[block_store_pb2.PutBlocksRequest],
        context: grpc.aio.ServicerContext,
    ) -> block_store_pb2.PutBlocksResponse:
        self._check_serving()
        receiver = PutStreamReceiver(self.store)
        async for request in request_iterator:
            receiver.add(request)
        receiver.check_complete()
        return block_store_pb2.PutBlocksResponse(num_blocks_received=receiver.num_blocks_received)

    @rpc_method
    async def CommitPut(
        self, request: block_store_pb2.CommitPutRequest, context: grpc.aio.ServicerContext
    ) -> block_store_pb2.CommitPutResponse:
        self._check_serving()
        return block_store_pb2.CommitPutResponse(
            num_blocks_committed=self.store.commit_put(request.put_id)
        )

    @rpc_method
    async def AbortPut(
        self, request: block_store_pb2.AbortPutRequest, context: grpc.aio.ServicerContext
    ) -> block_store_pb2.AbortPutResponse:
        self._check_serving()
        return block_store_pb2.AbortPutResponse(aborted=self.store.abort_put(request.put_id))

    @rpc_method
    async def GetBlocks(
        self, request: block_store_pb2.GetBlocksRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[block_store_pb2.GetBlocksResponse]:
        self._check_serving()
        max_chunk_bytes = KV_CHUNK_BYTES
        if request.HasField("max_chunk_bytes"):
            if request.max_chunk_bytes == 0:
                raise InvalidRequestError("max_chunk_bytes", "must be > 0")
            max_chunk_bytes = min(request.max_chunk_bytes, KV_CHUNK_BYTES)
        pinned = self.store.pin_or_locate(
            request.model, request.hash_scheme_version, list(request.block_hashes)
        )
        layout = pinned.layout
        blocks = [block for block in pinned.blocks if block is not None]
        if pinned.on_disk:
            assert self.store.disk is not None, "a block on disk with no disk tier"
            try:
                reads = await self.store.disk.read(pinned.on_disk)
            except BaseException:
                self.store.unpin(blocks)
                raise
            blocks = self.store.fill(pinned, reads)  # on failure it unpins
        try:
            layout_pb: common_pb2.KvLayout | None = layout.to_pb()
            for index, block in enumerate(blocks):
                for piece in split_block(
                    index, block.key.block_hash, block.data, block.crc32c, max_chunk_bytes
                ):
                    message = block_store_pb2.GetBlocksResponse()
                    piece.fill(message.chunk)  # in place: see ChunkPiece.fill
                    if layout_pb is not None:  # on the first message only
                        message.layout.CopyFrom(layout_pb)
                        layout_pb = None
                    yield message
        finally:
            self.store.unpin(blocks)

    @rpc_method
    async def ContainsBlocks(
        self, request: block_store_pb2.ContainsBlocksRequest, context: grpc.aio.ServicerContext
    ) -> block_store_pb2.ContainsBlocksResponse:
        self._check_serving()
        present = self.store.contains(
            request.model, request.hash_scheme_version, list(request.block_hashes)
        )
        num_prefix = next((i for i, hit in enumerate(present) if not hit), len(present))
        return block_store_pb2.ContainsBlocksResponse(
            num_prefix_present=num_prefix, present=present
        )

    @rpc_method
    async def GetStatus(
        self, request: block_store_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> block_store_pb2.GetStatusResponse:
        self._check_serving()
        return block_store_pb2.GetStatusResponse(status=self.status_pb())

    def status_pb(self) -> common_pb2.WorkerStatus:
        """Capacity in blocks of the largest layout held (0 before the first put)."""
        stats = self.store.stats()
        bytes_per_block = max(stats.bytes_per_block.values(), default=0)
        models = list(stats.bytes_per_block)
        total = free = 0
        if bytes_per_block:
            total = stats.capacity_bytes // bytes_per_block
            # Evictable committed blocks count as free; reserved and pinned bytes do not.
            free = (
                stats.capacity_bytes - stats.reserved_bytes - stats.pinned_bytes
            ) // bytes_per_block
        return common_pb2.WorkerStatus(
            worker_id=self.worker_id,
            role=common_pb2.WORKER_ROLE_BLOCK_STORE,
            address=self.address,
            model=models[0] if len(models) == 1 else "",
            num_kv_blocks_total=total,
            num_kv_blocks_free=free,
            num_running_requests=stats.num_open_puts,
            prefix_cache_hit_rate=stats.prefix_hit_rate,
            pid=os.getpid(),
            draining=self.draining,
        )

    def _check_serving(self) -> None:
        if self.draining:
            raise UnavailableError("the block store is shutting down")
