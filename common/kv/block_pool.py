"""The block pool: every KV block of an engine, its reference count, and the prefix cache.

Invariants (checked by tests/unit/test_block_pool.py):
- a block is in the free queue iff its ref_count is 0;
- a block with a hash is findable through ``cached`` until it is evicted, even while free;
- ``allocate`` takes blocks from the head of the free queue (least recently freed first),
  evicting their hash; ``free`` appends to the tail in the order given, so callers pass a
  sequence's blocks last-first and its tail is evicted before its shared prefix.

Not thread-safe: one engine thread owns the pool.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from common.kv.hashing import BlockHash


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0
        # Hashes evicted since the last drain, kept only when someone mirrors the cache
        # elsewhere (a worker publishing BlockRemoved to the prefix index).
        self.evicted: list[BlockHash] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks allocatable now, cached-but-unreferenced ones included."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def cached(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash)

    def longest_cached_prefix(self, hashes: Sequence[BlockHash]) -> list[KVBlock]:
        """The cached blocks for the longest prefix of ``hashes`` (stops at the first miss)."""
        hits: list[KVBlock] = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def cached_hashes(self) -> list[BlockHash]:
        """Every block the prefix cache holds now (to republish the prefix index)."""
        return list(self._cached)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Takes a reference on already-computed blocks (prefix-cache hits)."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        if num_blocks > len(self._free):
            raise MemoryError(f"asked for {num_blocks} KV blocks, {len(self._free)} free")
        taken = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                if self.evicted is not None:
                    self.evicted.append(block.block_hash)
                block.block_hash = None
                self.num_evictions += 1
            block.ref_count = 1
            taken.append(block)
        return taken

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drops one reference from each block; unreferenced ones join the free queue's tail."""
        for block in blocks:
            assert block.ref_count > 0, f"double free of block {block.block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block

    def cache(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Publishes a full, computed block under its hash (first writer wins)."""
        if block.block_hash is not None:
            assert block.block_hash == block_hash, f"block {block.block_id} hashed twice"
            return
        if block_hash not in self._cached:
            block.block_hash = block_hash
            self._cached[block_hash] = block

    def track_evictions(self) -> None:
        if self.evicted is None:
            self.evicted = []

    def drain_evicted(self) -> list[BlockHash]:
        drained, self.evicted = (self.evicted or []), ([] if self.evicted is not None else None)
        return drained

    def forget(self, block_hashes: Iterable[BlockHash]) -> int:
        """As if these hashes had never been cached (a profile's throwaway prompts, which no
        request asks for again and nobody published): their unreferenced blocks leave the
        prefix cache for the head of the free queue, to be reused before any block still
        cached, and evictions of them not yet drained are dropped. Returns how many blocks
        were forgotten."""
        forgotten = dict.fromkeys(block_hashes)  # in the order given, once each
        count = 0
        for block_hash in forgotten:
            block = self._cached.get(block_hash)
            if block is None or block.ref_count > 0:
                continue
            del self._cached[block_hash]
            block.block_hash = None
            self._free.move_to_end(block.block_id, last=False)
            count += 1
        if self.evicted:
            self.evicted = [h for h in self.evicted if h not in forgotten]
        return count

    def evict_all_cached(self) -> int:
        """Forgets every unreferenced cached block (for tests and cache resets)."""
        count = 0
        for block in self._free.values():
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
                count += 1
        return count
