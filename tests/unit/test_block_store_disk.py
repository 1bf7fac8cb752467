"""The block store with its disk tier, on real files and the real spill thread: every
committed block is written behind; memory evicting a block keeps it readable from disk; a
read promotes it back; a restart on the same directory keeps every written block; a damaged
record is never served; the disk's bound holds and what leaves both tiers leaves the index;
a model's blocks in an old layout give way to a new fleet's; writes that fall behind drop
evictions instead of growing without bound."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from common.errors import FailedPreconditionError, NotFoundError
from common.kv.layout import KvLayout
from services.blockstore.disk import DiskBlock, DiskTier, _record_head
from services.blockstore.store import BlockKey, BlockStore, StoredBlock
from services.blockstore.tiering import DiskSpiller
from tests.unit.test_block_store import BLOCK, LAYOUT, MODEL, V1, Events, block_bytes, put_blocks

RECORD = len(_record_head(DiskBlock(BlockKey(MODEL, V1, 1), LAYOUT, b"", 0))) + BLOCK
SEGMENT = 4 * RECORD  # four blocks a segment


def on_a_loop(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(asyncio.wait_for(test(*args, **kwargs), timeout=60))

    return run


def key(block_hash: int, model: str = MODEL) -> BlockKey:
    return BlockKey(model, V1, block_hash)


async def open_store(
    directory: Path, memory_blocks: int, disk_bytes: int = 1 << 20
) -> tuple[BlockStore, DiskSpiller, Events]:
    events = Events()
    store = BlockStore(memory_blocks * BLOCK, 30.0, listener=events)
    disk = DiskTier(directory, disk_bytes, segment_bytes=SEGMENT, fsync=False)
    held = await asyncio.to_thread(disk.open)
    spiller = DiskSpiller(disk, store, asyncio.get_running_loop())
    store.attach_disk(spiller, held)
    return store, spiller, events


async def read(store: BlockStore, hashes: Sequence[int], model: str = MODEL) -> list[bytes]:
    """What GetBlocks does: pin, read what only the disk has, fill, unpin."""
    pinned = store.pin_or_locate(model, V1, hashes)
    blocks = [block for block in pinned.blocks if block is not None]
    if pinned.on_disk:
        assert store.disk is not None
        blocks = store.fill(pinned, await store.disk.read(pinned.on_disk))
    try:
        return [block.data for block in blocks]
    finally:
        store.unpin(blocks)


def removed(events: Events) -> list[int]:
    return [h for kind, _, hashes in events.log if kind == "removed" for h in hashes]


@on_a_loop
async def test_evicted_blocks_are_read_back_from_disk_and_promoted(tmp_path: Path) -> None:
    store, spiller, events = await open_store(tmp_path, memory_blocks=4)
    for first in range(1, 13, 2):  # 12 blocks through 4 blocks of memory
        put_blocks(store, [first, first + 1])
    assert await spiller.flush(10)
    assert [k.block_hash for k in store.lru_order()] == [10, 9, 12, 11]  # heads last
    assert store.contains(MODEL, V1, list(range(1, 14))) == [True] * 12 + [False]
    assert removed(events) == []  # nothing left the store: the index still holds all 12
    stats = store.stats()
    assert stats.num_disk_blocks == 12 and stats.num_evictions == 8 and stats.writing_bytes == 0

    assert await read(store, [1, 2]) == [block_bytes(1), block_bytes(2)]
    assert store.num_disk_reads == 2 and store.num_promotions == 2
    assert [k.block_hash for k in store.lru_order()] == [12, 11, 2, 1]  # promoted, head last
    assert store.pin(MODEL, V1, [1, 2])[1][0].data == block_bytes(1)  # in memory now
    with pytest.raises(NotFoundError, match="on disk only"):
        store.pin(MODEL, V1, [3])  # a reader that cannot wait sees disk blocks as absent
    assert await read(store, [3, 12]) == [block_bytes(3), block_bytes(12)]
    spiller.close()


@on_a_loop
async def test_a_restart_keeps_every_written_block(tmp_path: Path) -> None:
    store, spiller, _ = await open_store(tmp_path, memory_blocks=4)
    for first in range(1, 11, 2):
        put_blocks(store, [first, first + 1])
    assert await spiller.flush(10)
    spiller.close()

    again, spiller, events = await open_store(tmp_path, memory_blocks=4)
    assert again.contains(MODEL, V1, list(range(1, 11))) == [True] * 10
    assert again.disk_only_hashes() == {MODEL: list(range(1, 11))}
    assert again.layout_of(MODEL) == LAYOUT  # from the records
    assert await read(again, list(range(1, 11))) == [block_bytes(h) for h in range(1, 11)]
    assert again.stats().prefix_hit_rate == 1.0 and again.stats().num_blocks_found_on_disk == 10
    # A put of blocks the disk holds sends nothing.
    assert again.begin_put(MODEL, V1, LAYOUT, [1, 2, 99]).missing_block_hashes == [99]
    assert removed(events) == []
    spiller.close()


@on_a_loop
async def test_a_damaged_record_is_never_served(tmp_path: Path) -> None:
    store, spiller, _ = await open_store(tmp_path, memory_blocks=2)
    put_blocks(store, [1, 2])
    put_blocks(store, [3])
    assert await spiller.flush(10)
    spiller.close()
    for segment in tmp_path.glob("seg-*.pdkv"):  # flip a byte inside block 2's data
        raw = bytearray(segment.read_bytes())
        if (where := raw.find(block_bytes(2))) >= 0:
            raw[where + BLOCK // 2] ^= 0x55
            segment.write_bytes(bytes(raw))

    again, spiller, events = await open_store(tmp_path, memory_blocks=2)
    with pytest.raises(NotFoundError, match="lost from the disk tier"):
        await read(again, [1, 2, 3])
    assert again.pinned_bytes == 0 and again.contains(MODEL, V1, [1, 2, 3]) == [True, False, True]
    assert removed(events) == [2]  # it leaves the prefix index
    assert spiller.disk.stats().num_corrupt == 1
    assert await read(again, [1, 3]) == [block_bytes(1), block_bytes(3)]
    spiller.close()


@on_a_loop
async def test_the_disk_bound_holds_and_what_leaves_both_tiers_leaves_the_index(
    tmp_path: Path,
) -> None:
    disk_bytes = 3 * SEGMENT
    store, spiller, events = await open_store(tmp_path, memory_blocks=2, disk_bytes=disk_bytes)
    for block_hash in range(1, 41):
        put_blocks(store, [block_hash])
        assert await spiller.flush(10)
        used = sum(p.stat().st_size for p in tmp_path.glob("seg-*.pdkv"))
        assert used <= disk_bytes
    looked_up = list(range(1, 41))
    hits = store.contains(MODEL, V1, looked_up)
    held = [h for h, hit in zip(looked_up, hits, strict=True) if hit]
    assert held == list(range(41 - len(held), 41)) and 9 <= len(held) <= 12  # the newest
    assert sorted(removed(events)) == list(range(1, 41 - len(held)))  # the rest, each once
    assert await read(store, held) == [block_bytes(h) for h in held]
    spiller.close()


@on_a_loop
async def test_a_new_layout_replaces_a_model_held_on_disk_only(tmp_path: Path) -> None:
    store, spiller, _ = await open_store(tmp_path, memory_blocks=4)
    put_blocks(store, [1, 2])
    assert await spiller.flush(10)
    other = KvLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=2, dtype=torch.float32)
    with pytest.raises(FailedPreconditionError):  # blocks in memory: the layout is fixed
        store.begin_put(MODEL, V1, other, [5])
    spiller.close()

    again, spiller, events = await open_store(tmp_path, memory_blocks=4)  # disk only now
    assert put_blocks(again, [5], layout=other) == 1
    assert removed(events) == [1, 2]
    assert again.contains(MODEL, V1, [1, 2, 5]) == [False, False, True]
    assert again.layout_of(MODEL) == other
    spiller.close()


class StuckDisk:
    """A DiskSpill whose writes never finish: what it was given stays in flight."""

    def __init__(self) -> None:
        self.submitted: list[BlockKey] = []

    def submit(self, block: StoredBlock, layout: KvLayout) -> None:
        self.submitted.append(block.key)

    async def read(self, keys: Sequence[BlockKey]) -> list[DiskBlock | None]:
        raise AssertionError("nothing is on this disk")


@on_a_loop
async def test_writes_that_fall_behind_drop_evictions_within_their_bound() -> None:
    events = Events()
    store = BlockStore(2 * BLOCK, 30.0, listener=events, max_writing_bytes=3 * BLOCK)
    disk = StuckDisk()
    store.attach_disk(disk, [])
    for block_hash in range(1, 7):
        put_blocks(store, [block_hash])
    assert disk.submitted == [key(1), key(2), key(3)]  # the bound: three in flight
    assert store.writing_bytes == 3 * BLOCK and store.num_spill_dropped == 1
    assert removed(events) == [4]  # evicted, not written: gone from the index
    assert store.contains(MODEL, V1, list(range(1, 7))) == [True, True, True, False, True, True]
    # Blocks in flight are still served, from the write's own copy.
    assert await read(store, [1, 3]) == [block_bytes(1), block_bytes(3)]
    store.disk_written([key(1), key(2), key(3)], [key(1), key(3)], [])  # key 2: the disk failed
    assert store.writing_bytes == 0 and removed(events) == [4, 2]
    assert store.stats().num_disk_blocks == 2
