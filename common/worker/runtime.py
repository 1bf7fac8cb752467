"""WorkerRuntime: what prefill and decode workers share around their engine.

It owns the engine thread (EngineLoop), the leases on exported KV, the worker's entry in
the Redis registry (heartbeat with load figures), its entries in the prefix index
(BlockStored on compute/import, BlockRemoved on eviction), and the block-store client.
Redis and the block store are optional and never fail a request: the index is advisory,
the store is a second source of KV.

Draining (SIGTERM, see common/worker/serve.py): ``begin_drain`` marks the worker draining in
the registry at once, so routers skip it, and ``admit`` refuses new calls with
``DrainingError`` (UNAVAILABLE); ``wait_idle`` waits for the calls in flight and the leases
on exported KV; ``end_streams`` ends whatever is left, so that callers resume elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

import grpc
from prometheus_client import CollectorRegistry

from common.engine.engine import Engine, EngineStats
from common.engine.engine_loop import EngineLoop
from common.engine.request import FullBlocks, KvImport
from common.errors import DrainingError, PdserveError, UnavailableError
from common.index import keys, redis_client
from common.index.expert_load import ExpertLoadStore
from common.index.prefix_index import PrefixIndex
from common.index.registry import WorkerInfo, WorkerRegistry
from common.kv.block_store_client import BlockStoreClient
from common.kv.hashing import hash_prompt_blocks
from common.kv.layout import KvLayout
from common.kv.leases import LeaseTable
from common.kv.pull import transfer_attributes
from common.rpc.breaker import PEER_FAILURE_CODES, CircuitBreaker, CircuitState
from common.rpc.channels import ChannelPool
from common.rpc.tracing import record_error
from common.telemetry.tracing import tracer
from common.worker.config import WorkerConfig
from common.worker.expert_load import ExpertLoadTracker
from common.worker.metrics import BLOCK_STORE, RECEIVED, SENT, WorkerMetrics
from pdserve.common.v1 import common_pb2

log = logging.getLogger(__name__)

T = TypeVar("T")

STORE_FAILURE_THRESHOLD = 2  # consecutive failed block store calls that open its breaker
STORE_COOLDOWN_S = 5.0  # then no call for this long, then one probe
BACKGROUND_GRACE_S = 5.0  # what stop() waits for background bookkeeping
PUT_TIMEOUT_S = 30.0  # a write-through put runs in the background: it may take longer
# Heartbeats go on with the last engine figures while a step runs, up to this long; an
# engine silent longer is stuck, and the worker lets its registry entry expire.
ENGINE_SILENCE_LIMIT_S = 60.0
_TIMEOUT_CODES = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED})

ROLE_PB = {"prefill": common_pb2.WORKER_ROLE_PREFILL, "decode": common_pb2.WORKER_ROLE_DECODE}
# Write-behind puts in flight at most; blocks beyond are not written (a resumed request then
# recomputes them): the store is a cache, and this queue, like every queue, is bounded.
MAX_WRITES_IN_FLIGHT = 64


class BlockStoreSkipped(UnavailableError):
    """The block store's breaker is open: the call was not made."""


class WorkerRuntime:
    def __init__(
        self,
        config: WorkerConfig,
        engine: Engine,
        metrics_registry: CollectorRegistry | None = None,
    ) -> None:
        self.config = config
        self.engine = engine
        self.model = config.served_model_name
        self.loop = EngineLoop(engine, name=f"{config.role}-engine")
        spec = engine.spec
        self.layout = KvLayout(
            spec.num_layers,
            spec.num_kv_heads,
            spec.head_dim,
            engine.block_size,
            engine.runner.kv_cache.dtype,
        )
        self.tier = engine.runner.device.type
        self.leases = LeaseTable(config.lease_ttl_s, on_release=self._release_engine_blocks)
        self.metrics = WorkerMetrics(metrics_registry or CollectorRegistry(), self.model)
        self.metrics.watch_engine(self.loop, self.leases)
        # MoE models: expert load, read from the engine every interval (publish_expert_load).
        self.expert_load: ExpertLoadTracker | None = None
        self.expert_store: ExpertLoadStore | None = None
        if spec.is_moe:
            self.expert_load = ExpertLoadTracker(config.expert_load_window_s)
            self.metrics.watch_expert_load(self.expert_load, config.expert_metrics_per_expert)
        self.channels = ChannelPool(config.tls)
        # A block store that fails twice running is left alone for a few seconds: requests
        # then neither wait on it nor fail because of it (no reuse across workers meanwhile).
        self.store_breaker = CircuitBreaker(
            STORE_FAILURE_THRESHOLD, STORE_COOLDOWN_S, on_change=self._store_state_changed
        )
        # Whether the prefix index may lack blocks we hold (a write to Redis failed): the
        # next heartbeat that gets through republishes every cached block.
        self._index_stale = False
        self._pending_removals: list[int] = []
        # The engine's figures for heartbeats: read between engine steps, so a long step
        # (a big prefill chunk on a busy CPU) must not stop the beat (see heartbeat_once).
        self._stats_read: asyncio.Future[tuple[EngineStats, list[int]]] | None = None
        self._last_stats: tuple[EngineStats, float] | None = None  # and when read
        self.redis: Any = None
        self.index: PrefixIndex | None = None
        self.registry: WorkerRegistry | None = None
        self.store: BlockStoreClient | None = None
        self.worker_id = ""
        self.address = ""
        self._tasks: list[asyncio.Task[Any]] = []
        self._background: set[asyncio.Task[Any]] = set()
        self.draining = False
        self.num_active_calls = 0  # Prefill / Decode calls admitted and not yet ended
        self.num_writes_in_flight = 0

    async def start(self, port: int) -> None:
        self.worker_id = self.config.resolved_worker_id(port)
        self.address = self.config.advertised_address(port)
        self.loop.start()
        if self.config.redis_url:
            self.redis = redis_client.connect(self.config.redis_url)
            self.index = PrefixIndex(self.redis, self.model, self.config.index_ttl_s)
            self.registry = WorkerRegistry(self.redis, ttl_s=max(3.0, 5 * self.config.heartbeat_s))
            await self.loop.call(lambda e: e.kv.pool.track_evictions())
            self._tasks.append(asyncio.create_task(self._heartbeat_forever()))
            if self.expert_load is not None:
                try:
                    keys.expert_meta(self.model, self.worker_id)  # both usable in a key?
                    self.expert_store = ExpertLoadStore(
                        self.redis,
                        self.model,
                        self.config.expert_load_window_s,
                        self.config.expert_load_windows,
                    )
                except ValueError as exc:
                    log.warning("expert load is not published to Redis: %s", exc)
        if self.expert_load is not None:
            self._tasks.append(asyncio.create_task(self._expert_load_forever()))
        if self.config.blockstore:
            self.store = BlockStoreClient(
                self.config.blockstore, self.model, self.layout, tls=self.config.tls
            )
        self._tasks.append(asyncio.create_task(self.leases.run_expiry()))
        log.info("%s %s serving at %s", self.config.role, self.worker_id, self.address)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        # Bookkeeping still running (store writes, lease releases retried against a producer
        # that does not answer) gets a few seconds, then is cancelled.
        if self._background:
            _, late = await asyncio.wait(list(self._background), timeout=BACKGROUND_GRACE_S)
            for task in late:
                task.cancel()
        for task in [*self._tasks, *self._background]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.leases.release_all()
        if self.registry is not None:
            with contextlib.suppress(Exception):
                await self.registry.deregister(self.worker_id)
        if self.expert_store is not None:  # what was routed since the last interval
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.publish_expert_load(), timeout=2.0)
        if self.redis is not None:
            await self.redis.aclose()
        if self.store is not None:
            await self.store.close()
        await self.channels.close()
        self.loop.stop()

    # -- admission and draining ---------------------------------------------------------------

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        """Wraps one Prefill / Decode call; refuses it while draining."""
        if self.draining:
            raise DrainingError(f"{self.config.role} worker {self.worker_id} is draining")
        self.num_active_calls += 1
        try:
            yield
        finally:
            self.num_active_calls -= 1

    async def begin_drain(self) -> None:
        """No new calls from now on; the registry says so at once (routers skip us)."""
        self.draining = True
        if self.registry is not None:
            try:
                await asyncio.wait_for(self.heartbeat_once(), timeout=2.0)
            except Exception as exc:
                log.warning("could not mark this worker draining in the registry: %s", exc)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Waits until no call is in flight and no lease pins exported KV; False if
        ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        while self.num_active_calls or len(self.leases):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def end_streams(self) -> None:
        """Ends every request still in the engine with UNAVAILABLE (reason DRAINING), so
        that its caller resumes it elsewhere; their blocks are freed."""
        self.loop.fail_all(
            DrainingError(
                f"{self.config.role} worker {self.worker_id} ended its drain grace period; "
                "resume the request elsewhere"
            )
        )

    # -- status -----------------------------------------------------------------------------

    async def stats(self) -> EngineStats:
        return await self.loop.call(lambda e: e.stats())

    def status_pb(self, stats: EngineStats) -> common_pb2.WorkerStatus:
        return common_pb2.WorkerStatus(
            worker_id=self.worker_id,
            role=ROLE_PB[self.config.role],
            address=self.address,
            model=self.model,
            num_kv_blocks_total=stats.num_kv_blocks_total,
            num_kv_blocks_free=stats.num_kv_blocks_free,
            num_running_requests=stats.num_running,
            num_waiting_requests=stats.num_waiting,
            prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
            pid=os.getpid(),
            draining=self.draining,
            weight_format=self.engine.weight_identity or "",
        )

    async def _heartbeat_forever(self) -> None:
        while True:
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
        fresh = await self.registry.heartbeat(
            WorkerInfo(
                worker_id=self.worker_id,
                role=self.config.role,
                address=self.address,
                model=self.model,
                num_kv_blocks_total=stats.num_kv_blocks_total,
                num_kv_blocks_free=stats.num_kv_blocks_free,
                num_running=stats.num_running,
                num_waiting=stats.num_waiting,
                num_pending_tokens=stats.num_pending_tokens,
                prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
                max_model_len=self.engine.max_model_len,
                pid=os.getpid(),
                draining=self.draining,
                weights=self.engine.weight_identity or "",
            )
        )
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

    async def _expert_load_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.expert_load_interval_s)
            try:
                await self.publish_expert_load()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reading expert load failed")

    # -- KV bookkeeping -------------------------------------------------------------------------

    def block_hashes(self, token_ids: list[int], cache_salt: str | None) -> list[int]:
        return [
            int(h)
            for h in hash_prompt_blocks(
                token_ids,
                self.engine.block_size,
                cache_salt or None,
                seed=self.engine.config.hash_seed,
                weights=self.engine.weight_identity,
            )
        ]

    def in_background(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Runs bookkeeping that must not delay or fail a request."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

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

    # -- the block store: best effort, short timeouts, skipped while failing ----------------------

    def store_timeout(self, timeout_s: float | None) -> float:
        """A block store read's timeout: the caller's time left, at most blockstore_timeout_s."""
        limit = self.config.blockstore_timeout_s
        return limit if timeout_s is None else min(timeout_s, limit)

    async def store_call(self, call: Awaitable[T]) -> T:
        """Runs one block store operation through the store's circuit breaker: raises
        UnavailableError at once while the breaker is open; a store that cannot be reached,
        errs or times out counts as a failure, any answer (NOT_FOUND too) as a success."""
        if not self.store_breaker.acquire():
            if inspect.iscoroutine(call):
                call.close()
            raise BlockStoreSkipped("the block store is failing; skipped for a few seconds")
        try:
            result = await call
        except grpc.aio.AioRpcError as exc:
            self._store_outcome(exc.code() not in PEER_FAILURE_CODES | _TIMEOUT_CODES)
            raise
        except (UnavailableError, asyncio.TimeoutError):
            self._store_outcome(False)
            raise
        except PdserveError:
            self._store_outcome(True)
            raise
        self._store_outcome(True)
        return result

    def _store_outcome(self, ok: bool) -> None:
        if ok:
            self.store_breaker.success()
        else:
            self.store_breaker.failure()

    def _store_state_changed(self, old: CircuitState, new: CircuitState) -> None:
        self.metrics.block_store_up.set(1 if new is CircuitState.CLOSED else 0)
        if new is CircuitState.OPEN:
            log.warning(
                "the block store at %s keeps failing; leaving it alone for %.0f s",
                self.config.blockstore,
                self.store_breaker.cooldown_s,
            )
        elif new is CircuitState.CLOSED:
            log.info("the block store at %s answers again", self.config.blockstore)

    async def store_blocks(self, block_hashes: list[int], data: Any) -> None:
        """Writes full blocks to the block store (two-phase put; existing ones skipped)."""
        if self.store is None or not block_hashes:
            return
        start = time.perf_counter()
        try:
            num_written = await self.store_call(
                self.store.put(block_hashes, data[: len(block_hashes)], timeout_s=PUT_TIMEOUT_S)
            )
        except BlockStoreSkipped:
            return
        except Exception as exc:
            self.metrics.transfer_failed(BLOCK_STORE, SENT)
            log.warning("writing %d blocks to the block store failed: %s", len(block_hashes), exc)
            return
        self.metrics.transferred(
            BLOCK_STORE,
            SENT,
            num_written * self.layout.bytes_per_block,
            num_written,
            time.perf_counter() - start,
        )

    def write_behind(self, blocks: FullBlocks) -> None:
        """Writes full blocks a request computed here to the block store, in the background
        (so that a request resumed elsewhere finds them); dropped when too many writes are
        in flight already."""
        if self.store is None:
            return
        if self.num_writes_in_flight >= MAX_WRITES_IN_FLIGHT:
            log.debug("write-behind queue full: %d blocks not written", len(blocks.block_hashes))
            return
        self.num_writes_in_flight += 1

        async def write() -> None:
            try:
                await self.store_blocks([int(h) for h in blocks.block_hashes], blocks.data)
            finally:
                self.num_writes_in_flight -= 1

        self.in_background(write())

    async def import_from_store(
        self, token_ids: list[int], cache_salt: str | None, timeout_s: float | None
    ) -> KvImport | None:
        """Full prompt blocks from the block store, when it holds more than our own cache."""
        if self.store is None:
            return None
        block_size = self.engine.block_size
        hashes = self.block_hashes(token_ids, cache_salt)[: (len(token_ids) - 1) // block_size]
        if not hashes:
            return None
        with tracer().start_as_current_span("kv_import") as span:
            span.set_attributes(
                {"pdserve.kv.source": BLOCK_STORE, "pdserve.kv.num_blocks_wanted": len(hashes)}
            )
            try:
                store = self.store
                present = await self.store_call(
                    store.contains(hashes, timeout_s=self.store_timeout(timeout_s))
                )
                span.set_attribute("pdserve.kv.store_blocks", present)
                if present == 0:
                    return None  # without asking the engine, which answers between steps
                local = await self.loop.call(
                    lambda e: e.num_cached_prefix_tokens(token_ids, cache_salt)
                )
                span.set_attribute("pdserve.kv.local_tokens", local)
                if present * block_size <= local:
                    return None
                start = time.perf_counter()
                data = await self.store_call(
                    store.get(hashes[:present], timeout_s=self.store_timeout(timeout_s))
                )
            except BlockStoreSkipped:
                span.set_attribute("pdserve.kv.store_skipped", True)
                return None
            except Exception as exc:
                self.metrics.transfer_failed(BLOCK_STORE, RECEIVED)
                record_error(span, exc)
                log.warning("block store lookup failed, computing instead: %s", exc)
                return None
            seconds = time.perf_counter() - start
            num_bytes = data.numel() * data.element_size()
            self.metrics.transferred(BLOCK_STORE, RECEIVED, num_bytes, present, seconds)
            span.set_attributes(transfer_attributes(num_bytes, present, seconds))
        return KvImport(present * block_size, data)

    async def _release_engine_blocks(self, request_id: str) -> None:
        await self.loop.call(lambda e: e.release(request_id))
