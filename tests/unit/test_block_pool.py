"""The block pool: reference counts, LRU free queue, prefix-cache map, exact eviction order."""

from __future__ import annotations

import pytest

from common.kv.block_pool import BlockPool
from common.kv.hashing import BlockHash


def ids(blocks: list) -> list[int]:
    return [b.block_id for b in blocks]


def test_allocate_takes_lowest_never_used_blocks_first() -> None:
    pool = BlockPool(6)
    assert ids(pool.allocate(2)) == [0, 1]
    assert ids(pool.allocate(3)) == [2, 3, 4]
    assert pool.num_free == 1
    with pytest.raises(MemoryError):
        pool.allocate(2)


def test_freed_blocks_are_reused_in_free_order() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)  # 0, 1
    b = pool.allocate(2)  # 2, 3
    pool.free(reversed(b))  # tail first: 3, 2
    pool.free(reversed(a))  # 1, 0
    assert ids(pool.allocate(4)) == [3, 2, 1, 0]


def test_eviction_order_is_lru_and_drops_the_hash() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    for i, block in enumerate(blocks):
        pool.cache(block, BlockHash(100 + i))
    # Free in the order a finishing sequence does (last block first), then another order.
    pool.free([blocks[3], blocks[2]])
    pool.free([blocks[0]])
    pool.free([blocks[1]])
    assert pool.num_cached == 4 and pool.num_free == 4
    evicted = pool.allocate(3)
    assert ids(evicted) == [3, 2, 0]
    assert [pool.cached(BlockHash(h)) for h in (100, 102, 103)] == [None, None, None]
    assert pool.cached(BlockHash(101)) is blocks[1]
    assert pool.num_evictions == 3


def test_touching_a_cached_free_block_takes_it_out_of_the_queue() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    pool.cache(blocks[0], BlockHash(7))
    pool.free(blocks)  # queue: 0, 1, 2
    hit = pool.cached(BlockHash(7))
    assert hit is blocks[0]
    pool.touch([hit])
    assert hit.ref_count == 1 and pool.num_free == 2
    assert ids(pool.allocate(2)) == [1, 2]  # the hit is not evicted
    pool.free([hit])
    assert ids(pool.allocate(1)) == [0]
    assert pool.cached(BlockHash(7)) is None


def test_shared_block_is_free_only_after_the_last_reference() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.touch([block])
    assert block.ref_count == 2
    pool.free([block])
    assert pool.num_free == 1
    pool.free([block])
    assert pool.num_free == 2
    with pytest.raises(AssertionError, match="double free"):
        pool.free([block])


def test_first_writer_wins_for_a_hash() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache(a, BlockHash(5))
    pool.cache(b, BlockHash(5))
    assert pool.cached(BlockHash(5)) is a and b.block_hash is None


def test_longest_cached_prefix_stops_at_first_miss() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    for block, h in zip(blocks, (1, 2, 4), strict=True):
        pool.cache(block, BlockHash(h))
    assert ids(pool.longest_cached_prefix([BlockHash(h) for h in (1, 2, 3, 4)])) == [0, 1]
    assert pool.longest_cached_prefix([BlockHash(9)]) == []


def test_forgotten_hashes_leave_the_cache_and_their_blocks_are_reused_first() -> None:
    pool = BlockPool(5)
    pool.track_evictions()
    blocks = pool.allocate(5)
    for i, block in enumerate(blocks):
        pool.cache(block, BlockHash(100 + i))
    pool.free(blocks[:4])  # free queue: 0, 1, 2, 3; block 4 still referenced
    # 102 and 103 are forgotten; 104 is in use, 999 unknown: both left as they are.
    assert pool.forget([BlockHash(103), BlockHash(102), BlockHash(104), BlockHash(999)]) == 2
    assert pool.cached(BlockHash(102)) is None and pool.cached(BlockHash(103)) is None
    assert pool.cached(BlockHash(104)) is blocks[4]
    assert ids(pool.allocate(3)) == [2, 3, 0]  # forgotten first, then the LRU order
    assert pool.drain_evicted() == [BlockHash(100)]  # a forgotten hash is no eviction


def test_forgetting_drops_evictions_not_yet_drained() -> None:
    pool = BlockPool(2)
    pool.track_evictions()
    blocks = pool.allocate(2)
    pool.cache(blocks[0], BlockHash(7))
    pool.cache(blocks[1], BlockHash(8))
    pool.free(blocks)
    pool.allocate(2)  # evicts 7 and 8
    assert pool.forget([BlockHash(8)]) == 0  # no block holds it any more
    assert pool.drain_evicted() == [BlockHash(7)]
