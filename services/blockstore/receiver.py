"""One PutBlocks stream: chunks in, whole checksum-checked blocks out into the store's put.

Order rules (kv_chunk.proto): blocks in increasing ``block_index``; a block's chunks
consecutive, from offset 0 with no gap or overlap, the last one flagged and carrying the
CRC-32C of the whole block. A block is handed to the store only once it is whole and its
checksum matches; a partial block (stream broken or cancelled) is simply dropped with the
receiver, while blocks already handed over stay in the put.
"""

from __future__ import annotations

from common.errors import DataLossError, InvalidRequestError
from common.kv.layout import crc32c
from common.rpc.options import KV_CHUNK_BYTES
from pdserve.kv.v1 import block_store_pb2
from services.blockstore.store import BlockStore


class PutStreamReceiver:
    def __init__(self, store: BlockStore) -> None:
        self.store = store
        self.put_id: str | None = None  # from the first message
        self.num_blocks_received = 0
        self._last_index = -1  # block_index of the last whole block
        self._index = -1  # block_index of the block being received; -1 between blocks
        self._hash = 0
        self._size = 0  # bytes_per_block of the put's layout
        self._offset = 0
        self._parts: list[bytes] = []

    def add(self, request: block_store_pb2.PutBlocksRequest) -> None:
        put_id = request.put_id
        if self.put_id is None:
            if not put_id:
                raise InvalidRequestError("put_id", "empty")
            self.put_id = put_id
        elif put_id != self.put_id:
            raise InvalidRequestError("put_id", "differs between messages of one stream")
        if not request.HasField("chunk"):
            raise InvalidRequestError("chunk", "missing")
        chunk = request.chunk
        data = chunk.data  # read the bytes field once: each access copies
        if self._index < 0:
            self._start_block(chunk.block_index, chunk.block_hash, chunk.offset_bytes)
        elif chunk.block_index != self._index or chunk.block_hash != self._hash:
            raise InvalidRequestError(
                "chunk.block_index",
                f"block {chunk.block_index} began before block {self._index} ended",
            )
        elif chunk.offset_bytes != self._offset:
            raise InvalidRequestError(
                "chunk.offset_bytes",
                f"block {self._index}: chunk at {chunk.offset_bytes}, expected {self._offset}",
            )
        if len(data) > KV_CHUNK_BYTES:
            raise InvalidRequestError("chunk.data", f"{len(data)} bytes, over {KV_CHUNK_BYTES}")
        if self._offset + len(data) > self._size:
            raise InvalidRequestError(
                "chunk.data", f"block {self._index} overflows its {self._size} bytes"
            )
        self._parts.append(data)
        self._offset += len(data)
        if chunk.last_chunk_of_block:
            self._finish_block(chunk.block_crc32c)

    def check_complete(self) -> None:
        """At the end of the stream: no block may be left half sent."""
        if self._index >= 0:
            raise InvalidRequestError(
                "chunk.last_chunk_of_block",
                f"the stream ended inside block {self._index} ({self._offset} of {self._size} bytes)",
            )

    def _start_block(self, block_index: int, block_hash: int, offset: int) -> None:
        assert self.put_id is not None
        if block_index <= self._last_index:
            raise InvalidRequestError(
                "chunk.block_index",
                f"block {block_index} after block {self._last_index}: blocks must come in "
                "increasing block_index",
            )
        if offset != 0:
            raise InvalidRequestError(
                "chunk.offset_bytes", f"block {block_index} starts at {offset}, not 0"
            )
        layout = self.store.check_block(self.put_id, block_index, block_hash)
        self._index, self._hash, self._size = block_index, block_hash, layout.bytes_per_block

    def _finish_block(self, expected_crc: int) -> None:
        assert self.put_id is not None
        index, block_hash = self._index, self._hash
        if self._offset != self._size:
            raise InvalidRequestError(
                "chunk.last_chunk_of_block",
                f"block {index} ended at {self._offset} of {self._size} bytes",
            )
        block = self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
        self._index, self._offset, self._parts = -1, 0, []
        self._last_index = index
        if crc32c(block) != expected_crc:
            raise DataLossError(f"block {index} ({block_hash:#x}) failed its CRC-32C check")
        self.store.receive_block(self.put_id, index, block_hash, block, expected_crc)
        self.num_blocks_received += 1
