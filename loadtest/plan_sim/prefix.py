"""Prefix caches: each worker's KV pool as an LRU of prefix blocks, the index the gateway
looks them up in (block -> workers holding it, as Redis holds it), and the block store
(a shared LRU every worker can fetch from).

A pool's cached blocks are not pinned by the requests using them (an approximation: at
the sizes simulated a block in use is also among the most recently used).
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixIndex:
    def __init__(self, store_blocks: int) -> None:
        self.holders: dict[int, set[int]] = {}  # block -> worker ids
        self._pools: dict[int, OrderedDict[int, None]] = {}
        self._capacity: dict[int, int] = {}
        self.store_blocks = store_blocks
        self._store: OrderedDict[int, None] = OrderedDict()

    def add_worker(self, worker_id: int, capacity_blocks: int) -> None:
        self._pools[worker_id] = OrderedDict()
        self._capacity[worker_id] = max(capacity_blocks, 1)

    def drop_worker(self, worker_id: int) -> None:
        """A stopped worker's blocks leave the index."""
        for block in self._pools.pop(worker_id, ()):
            self._unhold(block, worker_id)

    def _unhold(self, block: int, worker_id: int) -> None:
        holders = self.holders.get(block)
        if holders is not None:
            holders.discard(worker_id)
            if not holders:
                del self.holders[block]

    def insert(self, worker_id: int, blocks: tuple[int, ...]) -> None:
        """``worker_id`` now holds these blocks (it computed or imported them); the block
        store receives them too."""
        pool = self._pools.get(worker_id)
        if pool is not None:
            for block in blocks:
                if block in pool:
                    pool.move_to_end(block)
                    continue
                pool[block] = None
                self.holders.setdefault(block, set()).add(worker_id)
            capacity = self._capacity[worker_id]
            while len(pool) > capacity:
                evicted, _ = pool.popitem(last=False)
                self._unhold(evicted, worker_id)
        if self.store_blocks:
            store = self._store
            for block in blocks:
                if block in store:
                    store.move_to_end(block)
                else:
                    store[block] = None
            while len(store) > self.store_blocks:
                store.popitem(last=False)

    def depth(self, worker_id: int, blocks: tuple[int, ...]) -> int:
        """Leading blocks ``worker_id`` holds."""
        pool = self._pools.get(worker_id)
        if pool is None:
            return 0
        n = 0
        for block in blocks:
            if block not in pool:
                break
            n += 1
        return n

    def store_depth(self, blocks: tuple[int, ...]) -> int:
        n = 0
        for block in blocks:
            if block not in self._store:
                break
            n += 1
        return n

    def overlap(self, blocks: tuple[int, ...], limit: int) -> tuple[dict[int, int], set[int], int]:
        """The index lookup: leading blocks held per worker, walking the prompt's blocks
        while some worker holds them all. Where more than ``limit`` workers hold a prefix,
        they are not listed one by one: the answer is ``(explicit depths, the last such
        set, its depth)`` and a worker in that set holds at least that depth."""
        depths: dict[int, int] = {}
        crowd: set[int] = set()
        crowd_depth = 0
        current: set[int] | None = None
        for level, block in enumerate(blocks, start=1):
            holders = self.holders.get(block)
            if not holders:
                break
            if current is None:
                current = holders
            elif len(holders) < len(current):
                current = {w for w in holders if w in current}
            else:
                current = {w for w in current if w in holders}
            if not current:
                break
            if len(current) > limit:
                crowd, crowd_depth = current, level
            else:
                for w in current:
                    depths[w] = level
        return depths, crowd, crowd_depth
