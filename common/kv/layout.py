"""KV blocks on the wire: the layout message, chunking with CRC-32C, and reassembly.

One block = all layers' K and V for ``block_size`` tokens, ``[L, 2, S, Hkv, D]`` row-major,
little-endian elements of ``dtype`` (ARCHITECTURE.md). A block travels as chunks of at most
4 MiB; the chunk that ends a block carries the CRC-32C of the whole block.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import google_crc32c
import torch

from common.errors import DataLossError, FailedPreconditionError, InvalidRequestError
from common.rpc.options import KV_CHUNK_BYTES
from pdserve.common.v1 import common_pb2
from pdserve.kv.v1 import kv_chunk_pb2

_DTYPES: dict[torch.dtype, int] = {
    torch.float32: common_pb2.KV_DTYPE_FLOAT32,
    torch.bfloat16: common_pb2.KV_DTYPE_BFLOAT16,
    torch.float16: common_pb2.KV_DTYPE_FLOAT16,
    torch.int8: common_pb2.KV_DTYPE_INT8,
    torch.float8_e4m3fn: common_pb2.KV_DTYPE_FP8_E4M3,
}
_FROM_PB = {v: k for k, v in _DTYPES.items()}


@dataclass(frozen=True)
class KvLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty(0, dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * element

    def to_pb(self) -> common_pb2.KvLayout:
        return common_pb2.KvLayout(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=self.block_size,
            dtype=_DTYPES[self.dtype],  # type: ignore[arg-type]
            bytes_per_block=self.bytes_per_block,
        )

    @classmethod
    def from_pb(cls, pb: common_pb2.KvLayout) -> KvLayout:
        if pb.dtype not in _FROM_PB:
            raise InvalidRequestError("layout.dtype", f"unknown KV dtype {pb.dtype}")
        layout = cls(pb.num_layers, pb.num_kv_heads, pb.head_dim, pb.block_size, _FROM_PB[pb.dtype])
        if pb.bytes_per_block != layout.bytes_per_block:
            raise InvalidRequestError(
                "layout.bytes_per_block",
                f"{pb.bytes_per_block} disagrees with the shape ({layout.bytes_per_block})",
            )
        return layout

    def check_same(self, other: KvLayout, what: str) -> None:
        if other != self:
            raise FailedPreconditionError(
                f"{what}: KV layout {other} differs from this worker's {self}"
            )


def crc32c(data: bytes) -> int:
    return int(google_crc32c.value(data))


def block_chunks(
    blocks: torch.Tensor,  # [n, L, 2, S, Hkv, D] contiguous, on CPU
    block_hashes: Sequence[int],
    max_chunk_bytes: int = KV_CHUNK_BYTES,
    first_index: int = 0,
) -> Iterator[kv_chunk_pb2.KvBlockChunk]:
    """Chunks of every block in order; block i gets hash ``block_hashes[i]`` or 0 past them."""
    max_chunk_bytes = max(1, min(max_chunk_bytes, KV_CHUNK_BYTES))
    data = blocks.contiguous().view(torch.uint8).reshape(blocks.shape[0], -1).numpy()
    for i in range(blocks.shape[0]):
        block = data[i].tobytes()
        block_hash = block_hashes[i] if i < len(block_hashes) else 0
        checksum = crc32c(block)
        for offset in range(0, len(block), max_chunk_bytes):
            piece = block[offset : offset + max_chunk_bytes]
            last = offset + len(piece) == len(block)
            yield kv_chunk_pb2.KvBlockChunk(
                block_index=first_index + i,
                block_hash=block_hash,
                offset_bytes=offset,
                data=piece,
                last_chunk_of_block=last,
                block_crc32c=checksum if last else 0,
            )


class BlockAssembler:
    """Rebuilds blocks from a chunk stream, checking order and checksums."""

    def __init__(self, layout: KvLayout, num_blocks: int, first_index: int = 0) -> None:
        self.layout = layout
        self.first_index = first_index
        self.num_blocks = num_blocks
        self.buffer = bytearray(num_blocks * layout.bytes_per_block)
        self.hashes: list[int] = [0] * num_blocks
        self.num_complete = 0
        self._offset = 0  # bytes of the current block received
        self._crc = google_crc32c.Checksum()  # of the current block, chunk by chunk
        self.num_bytes = 0

    def add(self, chunk: kv_chunk_pb2.KvBlockChunk) -> None:
        index = chunk.block_index - self.first_index
        size = self.layout.bytes_per_block
        if index != self.num_complete or chunk.offset_bytes != self._offset:
            raise DataLossError(
                f"KV chunk out of order: block {chunk.block_index} offset {chunk.offset_bytes}, "
                f"expected block {self.num_complete + self.first_index} offset {self._offset}"
            )
        data = chunk.data  # read the bytes field once: each access copies
        end = self._offset + len(data)
        if end > size:
            raise DataLossError(f"KV block {chunk.block_index} overflows {size} bytes")
        base = index * size
        self.buffer[base + self._offset : base + end] = data
        self._crc.update(data)
        self._offset = end
        self.num_bytes += len(data)
        if not chunk.last_chunk_of_block:
            return
        if end != size:
            raise DataLossError(f"KV block {chunk.block_index} ended at {end} of {size} bytes")
        if int.from_bytes(self._crc.digest(), "big") != chunk.block_crc32c:
            raise DataLossError(f"KV block {chunk.block_index} failed its CRC-32C check")
        self.hashes[index] = chunk.block_hash
        self.num_complete += 1
        self._offset = 0
        self._crc = google_crc32c.Checksum()

    @property
    def done(self) -> bool:
        return self.num_complete == self.num_blocks

    def tensor(self) -> torch.Tensor:
        """[n, L, 2, S, Hkv, D] view over the received bytes (no copy)."""
        if not self.done:
            raise DataLossError(
                f"KV stream ended after {self.num_complete} of {self.num_blocks} blocks"
            )
        flat = (
            torch.frombuffer(self.buffer, dtype=self.layout.dtype)
            if self.buffer
            else torch.empty(0, dtype=self.layout.dtype)
        )
        return flat.view(self.num_blocks, *self.layout.block_shape)
