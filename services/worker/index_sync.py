"""A worker's entries in Redis: its registry entry (a heartbeat with load figures, so
routers see it), its blocks in the prefix index (published on compute and import, removed on
eviction, republished whole after Redis lost them) and, for MoE models, its expert load.
Redis is advisory: a failed write never fails a request, it marks the index stale and the
next heartbeat that gets through republishes every block held here."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from common.engine.engine import Engine, EngineStats
from common.engine.engine_loop import EngineLoop
from common.index import keys, redis_client
from common.index.expert_load import ExpertLoadStore
from common.index.prefix_index import PrefixIndex
from common.index.registry import WorkerInfo, WorkerRegistry
from services.worker.config import WorkerConfig
from services.worker.expert_load import ExpertLoadTracker
from services.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)

# Heartbeats go on with the last engine figures while a step runs, up to this long; an
# engine silent longer is stuck, and the worker lets its registry entry expire.
ENGINE_SILENCE_LIMIT_S = 60.0


class IndexSync:
    def __init__(
        self,
        config: WorkerConfig,
        loop: EngineLoop,
        metrics: WorkerMetrics,
        tier: str,
        expert_load: ExpertLoadTracker | None,
        entry: Callable[[EngineStats], WorkerInfo],
    ) -> None:
        self.config = config
        self.loop = loop
        self.metrics = metrics
        self.tier = tier  # the device tier blocks are published under
        self.expert_load = expert_load
        self.entry = entry  # this worker's registry entry for the engine's figures
        self.model = config.served_model_name
        self.worker_id = ""
        self.redis: Any = None
        self.index: PrefixIndex | None = None
        self.registry: WorkerRegistry | None = None
        self.expert_store: ExpertLoadStore | None = None
        # Whether the prefix index may lack blocks we hold (a write to Redis failed): the
        # next heartbeat that gets through republishes every cached block.
        self._index_stale = False
        self._pending_removals: list[int] = []
        # The engine's figures for heartbeats: read between engine steps, so a long step
        # (a big prefill chunk on a busy CPU) must not stop the beat (see heartbeat_once).
        self._stats_read: asyncio.Future[tuple[EngineStats, list[int]]] | None = None
        self._last_stats: tuple[EngineStats, float] | None = None  # and when read
        self._beating = True

    async def connect(self, worker_id: str) -> None:
        """Redis from the config (the caller checked there is one); evictions are tracked
        from now on, for the heartbeats to remove from the index."""
        assert self.config.redis_url
        self.worker_id = worker_id
        self.redis = redis_client.connect(self.config.redis_url)
        self.index = PrefixIndex(self.redis, self.model, self.config.index_ttl_s)
        self.registry = WorkerRegistry(self.redis, ttl_s=max(3.0, 5 * self.config.heartbeat_s))
        await self.loop.call(lambda e: e.kv.pool.track_evictions())
        if self.expert_load is not None:
            try:
                keys.expert_meta(self.model, worker_id)  # both usable in a key?
                self.expert_store = ExpertLoadStore(
                    self.redis,
                    self.model,
                    self.config.expert_load_window_s,
                    self.config.expert_load_windows,
                )
            except ValueError as exc:
                log.warning("expert load is not published to Redis: %s", exc)

    async def close(self) -> None:
        """Leaves the registry, publishes the expert load routed since the last interval,
        closes Redis; failures are only logged (Redis is advisory)."""
        if self.registry is not None:
            with contextlib.suppress(Exception):
                await self.registry.deregister(self.worker_id)
        if self.expert_store is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.publish_expert_load(), timeout=2.0)
        if self.redis is not None:
            await self.redis.aclose()

    # -- the registry entry and the prefix index ----------------------------------------------

    def stop_beating(self) -> None:
        """Ends ``heartbeat_forever`` at its next turn even if a cancellation of it is lost
        (Python 3.11's wait_for can swallow one that lands as its inner call completes)."""
        self._beating = False

    async def heartbeat_forever(self) -> None:
        while self._beating:
            try:
                await self.heartbeat_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._index_stale = True
                log.warning("heartbeat to Redis failed: %s", exc)
                self.metrics.redis.failed("heartbeat")
            await asyncio.sleep(self.config.heartbeat_s)

    async def _read_engine(
        self, read: Callable[[Engine], tuple[EngineStats, list[int]]]
    ) -> tuple[EngineStats, list[int]] | None:
        """``read`` run on the engine thread, or None when it has not run within a heartbeat
        interval; one read is outstanding at a time, and a late one's result is taken by
        the next beat (its evicted hashes are not lost)."""
        pending = self._stats_read
        if pending is None:
            pending = self._stats_read = asyncio.ensure_future(self.loop.call(read))
        try:
            return await asyncio.wait_for(asyncio.shield(pending), self.config.heartbeat_s)
        except TimeoutError:
            return None
        finally:
            if pending.done():
                self._stats_read = None

    async def heartbeat_once(self) -> None:
        """Registry entry, then the index: evictions since the last beat leave it, and when
        Redis lost our entry (it restarted, or we were unreachable past the TTL) or a write
        failed since, every block we hold is published again. So after an outage the index
        is rebuilt by the workers themselves within a heartbeat of Redis coming back."""
        assert self.registry is not None and self.index is not None

        def read(engine: Engine) -> tuple[EngineStats, list[int]]:
            pool = engine.kv.pool
            # A hash evicted and cached again since stays in the index.
            evicted = [int(h) for h in pool.drain_evicted() if pool.cached(h) is None]
            return engine.stats(), evicted

        fresh_stats = await self._read_engine(read)
        now = time.monotonic()
        if fresh_stats is not None:
            stats, evicted = fresh_stats
            self._last_stats = (stats, now)
            self._pending_removals.extend(evicted)
        elif self._last_stats is not None and now - self._last_stats[1] < ENGINE_SILENCE_LIMIT_S:
            # Mid-step: the process is alive, its figures are a step old. Skipping the beat
            # would drop the worker from routing (and a lone decode worker with it).
            stats = self._last_stats[0]
        else:
            since = now - self._last_stats[1] if self._last_stats else 0.0
            log.warning("the engine has not answered for %.0f s: no heartbeat", since)
            return
        fresh = await self.registry.heartbeat(self.entry(stats))
        self.metrics.redis.ok()
        if fresh or self._index_stale:
            await self._republish()
        elif self._pending_removals:
            removals = list(self._pending_removals)
            await self.index.remove(self.worker_id, removals)
            del self._pending_removals[: len(removals)]

    async def _republish(self) -> None:
        assert self.index is not None
        self._index_stale = False  # a write failing from here on marks it again

        def read(engine: Engine) -> list[int]:
            return [int(h) for h in engine.kv.pool.cached_hashes()]

        hashes = await self.loop.call(read)
        held = set(hashes)
        # Evictions Redis missed: gone from a Redis that kept its data, harmless on an empty one.
        removals = [h for h in self._pending_removals if h not in held]
        self._pending_removals.clear()
        try:
            await self.index.publish(self.worker_id, hashes, self.tier)
            await self.index.remove(self.worker_id, removals)
        except BaseException:
            self._index_stale = True
            self._pending_removals.extend(removals)
            raise
        self.metrics.index_republished(len(hashes))
        log.info("published the %d blocks held here to the prefix index", len(hashes))

    async def publish_blocks(self, block_hashes: list[int]) -> None:
        if self.index is None or not block_hashes:
            return
        try:
            await self.index.publish(self.worker_id, block_hashes, self.tier)
        except Exception as exc:
            self._index_stale = True
            self.metrics.redis.failed("index_publish")
            log.warning(
                "publishing %d blocks to the prefix index failed: %s", len(block_hashes), exc
            )

    # -- expert load (MoE) ----------------------------------------------------------------------

    async def publish_expert_load(self) -> None:
        """Reads the engine's expert counters (one device-to-host copy), updates the gauges'
        window and, with Redis, publishes what was routed since the last publish."""
        if self.expert_load is None:
            return
        counts = await self.loop.call(lambda e: e.expert_counts())
        if counts is None:
            return
        self.expert_load.observe(counts, time.monotonic())
        delta = self.expert_load.pending()
        if self.expert_store is None or delta is None:
            return
        try:
            await self.expert_store.publish(self.worker_id, delta)
        except Exception as exc:
            self.metrics.redis.failed("expert_load")
            log.warning("publishing expert load to Redis failed (retried next time): %s", exc)
            return
        self.expert_load.mark_published(counts)
        self.metrics.redis.ok()

    async def expert_load_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.expert_load_interval_s)
            try:
                await self.publish_expert_load()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reading expert load failed")
