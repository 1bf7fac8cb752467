"""The block store's disk tier on real files: blocks survive a reopen; a torn or corrupted
record is detected by its checksum and never served; the bound on disk use holds, oldest
segments going first; a crash mid-append (a truncated file) leaves every whole record."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from common.kv.layout import KvLayout, crc32c
from services.blockstore.disk import DiskTier
from services.blockstore.store import BlockKey

LAYOUT = KvLayout(num_layers=1, num_kv_heads=1, head_dim=125, block_size=1, dtype=torch.float32)
BLOCK = LAYOUT.bytes_per_block  # 1000 bytes of data per block


def key(i: int, model: str = "m") -> BlockKey:
    return BlockKey(model, 1, 0xABC0000 + i)


def data(i: int) -> bytes:
    return bytes([i % 251]) * BLOCK


def put(tier: DiskTier, i: int) -> list[BlockKey]:
    result = tier.put(key(i), LAYOUT, data(i), crc32c(data(i)))
    assert result.written == [key(i)]
    return result.evicted


def read(tier: DiskTier, k: BlockKey) -> bytes | None:
    block = tier.get(k)
    if block is not None:
        assert block.layout == LAYOUT and block.key == k
    return None if block is None else block.data


def keys_of(held: list[tuple[BlockKey, KvLayout]]) -> list[BlockKey]:
    assert all(layout == LAYOUT for _, layout in held)
    return sorted(k for k, _ in held)


def test_blocks_survive_a_reopen(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=100_000, segment_bytes=10_000)
    tier.open()
    for i in range(20):
        assert put(tier, i) == []
    assert read(tier, key(3)) == data(3) and key(19) in tier and read(tier, key(99)) is None
    again = DiskTier(tmp_path, capacity_bytes=100_000, segment_bytes=10_000)
    assert keys_of(again.open()) == sorted(key(i) for i in range(20))
    assert all(read(again, key(i)) == data(i) for i in range(20))
    stats = again.stats()
    assert stats.num_blocks == 20 and stats.num_segments == 3 and stats.num_corrupt == 0
    put(again, 20)  # appends go on after the reopen
    assert read(again, key(20)) == data(20) and read(again, key(19)) == data(19)


def test_the_newest_copy_wins(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=100_000, segment_bytes=10_000)
    tier.open()
    tier.put(key(1), LAYOUT, b"old" * 10, crc32c(b"old" * 10))
    tier.put(key(1), LAYOUT, b"new" * 10, crc32c(b"new" * 10))
    assert read(tier, key(1)) == b"new" * 10
    reopened = DiskTier(tmp_path, capacity_bytes=100_000, segment_bytes=10_000)
    reopened.open()
    assert read(reopened, key(1)) == b"new" * 10


def test_a_corrupted_block_is_never_served(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=100_000, segment_bytes=50_000)
    tier.open()
    for i in range(3):
        put(tier, i)
    (segment,) = tmp_path.glob("seg-*.pdkv")
    raw = bytearray(segment.read_bytes())
    where = raw.index(data(1))  # flip one byte of block 1's data
    raw[where + 10] ^= 0xFF
    segment.write_bytes(bytes(raw))
    assert read(tier, key(1)) is None and key(1) not in tier
    assert read(tier, key(0)) == data(0) and read(tier, key(2)) == data(2)
    assert tier.stats().num_corrupt == 1


def test_a_torn_append_leaves_every_whole_record(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=100_000, segment_bytes=50_000)
    tier.open()
    for i in range(4):
        put(tier, i)
    (segment,) = tmp_path.glob("seg-*.pdkv")
    size = segment.stat().st_size
    os.truncate(segment, size - BLOCK // 2)  # the last record's write cut short
    reopened = DiskTier(tmp_path, capacity_bytes=100_000, segment_bytes=50_000)
    assert keys_of(reopened.open()) == [key(0), key(1), key(2)]
    assert reopened.stats().num_corrupt == 1
    put(reopened, 9)  # the torn tail was cut: the new record reads back whole
    assert read(reopened, key(9)) == data(9) and read(reopened, key(2)) == data(2)
    again = DiskTier(tmp_path, capacity_bytes=100_000, segment_bytes=50_000)
    assert keys_of(again.open()) == [key(0), key(1), key(2), key(9)]


def test_disk_use_stays_under_its_bound_oldest_segments_first(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=30_000, segment_bytes=10_000)
    tier.open()
    evicted: list[BlockKey] = []
    for i in range(100):
        evicted += put(tier, i)
        used = sum(p.stat().st_size for p in tmp_path.glob("seg-*.pdkv"))
        assert used <= 30_000 and tier.stats().used_bytes == used
    held = [i for i in range(100) if key(i) in tier]
    assert held == list(range(100 - len(held), 100))  # the newest blocks, contiguous
    assert sorted(evicted) == sorted(key(i) for i in range(100 - len(held)))
    assert all(read(tier, key(i)) == data(i) for i in held)
    smaller = DiskTier(tmp_path, capacity_bytes=15_000, segment_bytes=10_000)
    kept = keys_of(smaller.open())  # reopened under a smaller bound: the oldest go at once
    assert smaller.stats().used_bytes <= 15_000 and kept == [key(i) for i in held[-len(kept) :]]
    assert 0 < len(kept) < len(held)


def test_a_segment_must_fit_the_capacity(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="segment_bytes"):
        DiskTier(tmp_path, capacity_bytes=1000, segment_bytes=2000)
