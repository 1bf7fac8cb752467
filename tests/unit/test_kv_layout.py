"""KV wire layout: chunking, CRC-32C, reassembly, and the errors a receiver must raise."""

from __future__ import annotations

import pytest
import torch

from common.errors import DataLossError, FailedPreconditionError, InvalidRequestError
from common.kv.layout import BlockAssembler, KvLayout, block_chunks

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=16, dtype=torch.float32)


def blocks(n: int) -> torch.Tensor:
    return torch.randn(n, *LAYOUT.block_shape)  # [n, L, 2, S, Hkv, D]


def test_bytes_per_block_and_proto_round_trip() -> None:
    assert LAYOUT.bytes_per_block == 2 * 2 * 16 * 2 * 4 * 4
    assert KvLayout.from_pb(LAYOUT.to_pb()) == LAYOUT
    pb = LAYOUT.to_pb()
    pb.bytes_per_block += 1
    with pytest.raises(InvalidRequestError, match="bytes_per_block"):
        KvLayout.from_pb(pb)
    with pytest.raises(FailedPreconditionError):
        LAYOUT.check_same(KvLayout(2, 2, 4, 16, torch.float16), "test")


@pytest.mark.parametrize("chunk_bytes", [100, 1024, 4 << 20])
def test_round_trip_is_bit_exact(chunk_bytes: int) -> None:
    data = blocks(3)
    chunks = list(block_chunks(data, [11, 22], chunk_bytes))
    assert all(len(c.data) <= chunk_bytes for c in chunks)
    assert [c.block_hash for c in chunks if c.last_chunk_of_block] == [11, 22, 0]
    assembler = BlockAssembler(LAYOUT, 3)
    for chunk in chunks:
        assembler.add(chunk)
    assert torch.equal(assembler.tensor(), data)
    assert assembler.hashes == [11, 22, 0]
    assert assembler.num_bytes == 3 * LAYOUT.bytes_per_block


def test_corrupted_block_fails_its_checksum() -> None:
    chunks = list(block_chunks(blocks(2), [1, 2], 256))
    victim = chunks[3]
    victim.data = bytes([victim.data[0] ^ 1]) + victim.data[1:]
    assembler = BlockAssembler(LAYOUT, 2)
    with pytest.raises(DataLossError, match="CRC-32C"):
        for chunk in chunks:
            assembler.add(chunk)


def test_out_of_order_and_short_streams_are_rejected() -> None:
    chunks = list(block_chunks(blocks(2), [1, 2], 256))
    assembler = BlockAssembler(LAYOUT, 2)
    with pytest.raises(DataLossError, match="out of order"):
        assembler.add(chunks[1])
    short = BlockAssembler(LAYOUT, 2)
    for chunk in chunks[: len(chunks) // 2]:
        short.add(chunk)
    with pytest.raises(DataLossError, match="ended after"):
        short.tensor()


def test_first_index_offsets_block_numbers() -> None:
    data = blocks(2)
    assembler = BlockAssembler(LAYOUT, 2, first_index=5)
    for chunk in block_chunks(data, [7, 8], first_index=5):
        assert chunk.block_index in (5, 6)
        assembler.add(chunk)
    assert torch.equal(assembler.tensor(), data)
