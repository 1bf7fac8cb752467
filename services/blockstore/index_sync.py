"""Mirrors the store's committed blocks into the Redis prefix index, location ``store``.

The store tells us synchronously (``StoreListener``) which blocks it committed or evicted;
we only note the latest state of each block in a pending map, so the store never waits on
Redis and a block stored and evicted between two flushes costs one HDEL. One task (``run``)
writes the pending changes as they come, and every ``ttl_s / 2`` republishes every block
the store holds, so that entries (which carry a TTL) outlive neither the block nor a store
that died without cleaning up. Because that one task does every index write, a refresh can
never overwrite a later removal. When Redis comes back from an outage (the heartbeat finds
the store's registry entry gone, or had failed), ``refresh_soon`` republishes everything at
once, so the index is whole again within a heartbeat. The index is advisory: a failed write is logged, kept
pending and retried; it never fails an RPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from common.index import keys
from common.index.prefix_index import PrefixIndex
from services.blockstore.store import BlockStore

log = logging.getLogger(__name__)

TIER = "memory"
DISK_TIER = "disk"  # held on disk only (republished with the tier it is in at each refresh)
BATCH = 1024  # hashes per Redis pipeline
RETRY_S = 1.0


class IndexSync:
    def __init__(self, redis: Any, store: BlockStore, ttl_s: int) -> None:
        self.redis = redis
        self.store = store
        self.ttl_s = ttl_s
        self._pending: dict[tuple[str, int], bool] = {}  # (model, hash) -> stored (else removed)
        self._wake = asyncio.Event()
        self._indexes: dict[str, PrefixIndex] = {}
        self._unindexable: set[str] = set()  # model names that cannot be part of a key
        self._refresh_now = False

    # -- StoreListener ------------------------------------------------------------------------

    def blocks_stored(self, model: str, block_hashes: Sequence[int]) -> None:
        self._note(model, block_hashes, True)

    def blocks_removed(self, model: str, block_hashes: Sequence[int]) -> None:
        self._note(model, block_hashes, False)

    # -- the writer task ----------------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        refresh_s = self.ttl_s / 2
        next_refresh = loop.time() + refresh_s
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(0.0, next_refresh - loop.time()))
            self._wake.clear()
            try:
                await self.flush()
                if self._refresh_now or loop.time() >= next_refresh:
                    self._refresh_now = False
                    try:
                        await self.refresh()
                    except BaseException:
                        self._refresh_now = True
                        raise
                    next_refresh = loop.time() + refresh_s
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("writing the prefix index failed, will retry: %s", exc)
                await asyncio.sleep(RETRY_S)
                self._wake.set()

    def refresh_soon(self) -> None:
        """Republish every committed block at once (Redis came back without them)."""
        self._refresh_now = True
        self._wake.set()

    async def flush(self) -> None:
        """Writes the pending changes; on failure they stay pending (unless superseded)."""
        batch, self._pending = self._pending, {}
        try:
            stored: dict[str, list[int]] = {}
            removed: dict[str, list[int]] = {}
            for (model, block_hash), is_stored in batch.items():
                (stored if is_stored else removed).setdefault(model, []).append(block_hash)
            for model, hashes in removed.items():
                for part in _batches(hashes):
                    await self._index(model).remove(keys.STORE_LOCATION, part)
            for model, hashes in stored.items():
                for part in _batches(hashes):
                    await self._index(model).publish(keys.STORE_LOCATION, part, TIER)
        except BaseException:
            for key, is_stored in batch.items():
                self._pending.setdefault(key, is_stored)
            raise

    async def refresh(self) -> None:
        """Republishes every block held, in memory or on disk, renewing the entries' TTL."""
        for tier, held in (
            (TIER, self.store.committed_hashes()),
            (DISK_TIER, self.store.disk_only_hashes()),
        ):
            for model, hashes in held.items():
                if model in self._unindexable:
                    continue
                for part in _batches(hashes):
                    await self._index(model).publish(keys.STORE_LOCATION, part, tier)

    async def withdraw_all(self) -> None:
        """On shutdown: the store's blocks leave the index (they die with the process)."""
        self._pending.clear()
        for held in (self.store.committed_hashes(), self.store.disk_only_hashes()):
            for model, hashes in held.items():
                if model in self._unindexable:
                    continue
                for part in _batches(hashes):
                    await self._index(model).remove(keys.STORE_LOCATION, part)

    def _note(self, model: str, block_hashes: Sequence[int], stored: bool) -> None:
        if model in self._unindexable:
            return
        try:
            keys.block(model, 0)
        except ValueError as exc:
            log.warning("blocks of model %r stay out of the prefix index: %s", model, exc)
            self._unindexable.add(model)
            return
        for block_hash in block_hashes:
            self._pending[(model, block_hash)] = stored
        self._wake.set()

    def _index(self, model: str) -> PrefixIndex:
        index = self._indexes.get(model)
        if index is None:
            index = self._indexes[model] = PrefixIndex(self.redis, model, self.ttl_s)
        return index


def _batches(hashes: list[int]) -> list[list[int]]:
    return [hashes[i : i + BATCH] for i in range(0, len(hashes), BATCH)]
