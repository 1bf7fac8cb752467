"""WorkerRuntime: what prefill and decode workers share around their engine, and its
lifecycle.

It owns the engine thread (EngineLoop), the leases on exported KV, and two parts of its own
module each: the worker's entries in Redis (services/worker/index_sync.py: the registry
heartbeat, the prefix index, expert load) and the block store as a second source of KV
(services/worker/store_tier.py). Redis and the block store are optional and never fail a
request: the index is advisory, the store is a cache.

Draining (SIGTERM, see services/worker/serve.py): ``begin_drain`` marks the worker draining in
the registry at once, so routers skip it, and ``admit`` refuses new calls with
``DrainingError`` (UNAVAILABLE); ``wait_idle`` waits for the calls in flight and the leases
on exported KV; ``end_streams`` ends whatever is left, so that callers resume elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Coroutine, Iterator
from typing import Any

from prometheus_client import CollectorRegistry

from common.engine.engine import Engine, EngineStats
from common.engine.engine_loop import EngineLoop
from common.engine.request import KvImport
from common.errors import DrainingError
from common.index.registry import WorkerInfo
from common.kv.hashing import hash_prompt_blocks
from common.kv.layout import KvLayout
from common.kv.leases import LeaseTable
from common.rpc.channels import ChannelPool
from common.rpc.tracing import record_error
from common.telemetry.tracing import tracer
from pdserve.common.v1 import common_pb2
from services.worker.config import WorkerConfig
from services.worker.expert_load import ExpertLoadTracker
from services.worker.index_sync import IndexSync
from services.worker.metrics import BLOCK_STORE, RECEIVED, WorkerMetrics
from services.worker.store_tier import BlockStoreSkipped, StoreTier

log = logging.getLogger(__name__)

BACKGROUND_GRACE_S = 5.0  # what stop() waits for background bookkeeping

ROLE_PB = {"prefill": common_pb2.WORKER_ROLE_PREFILL, "decode": common_pb2.WORKER_ROLE_DECODE}


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
        assert self.layout.wire_shape == engine.runner.kv_wire_shape, "wire layouts disagree"
        self.tier = engine.runner.device.type
        self.leases = LeaseTable(config.lease_ttl_s, on_release=self._release_engine_blocks)
        self.metrics = WorkerMetrics(metrics_registry or CollectorRegistry(), self.model)
        self.metrics.watch_engine(self.loop, self.leases)
        # MoE models: expert load, read from the engine every interval (publish_expert_load).
        self.expert_load: ExpertLoadTracker | None = None
        if spec.is_moe:
            self.expert_load = ExpertLoadTracker(config.expert_load_window_s)
            self.metrics.watch_expert_load(self.expert_load, config.expert_metrics_per_expert)
        self.channels = ChannelPool(config.tls)
        self.worker_id = ""
        self.address = ""
        self.sync = IndexSync(
            config, self.loop, self.metrics, self.tier, self.expert_load, self.entry
        )
        self.store = StoreTier(config, self.layout, self.metrics, self.in_background)
        self._tasks: list[asyncio.Task[Any]] = []
        self._background: set[asyncio.Task[Any]] = set()
        self.draining = False
        self.num_active_calls = 0  # Prefill / Decode calls admitted and not yet ended

    async def start(self, port: int) -> None:
        self.worker_id = self.config.resolved_worker_id(port)
        self.address = self.config.advertised_address(port)
        self.loop.start()
        if self.config.redis_url:
            await self.sync.connect(self.worker_id)
            self._tasks.append(asyncio.create_task(self.sync.heartbeat_forever()))
        if self.expert_load is not None:
            self._tasks.append(asyncio.create_task(self.sync.expert_load_forever()))
        self.store.open()
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
        await self.sync.close()
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
        if self.sync.registry is not None:
            try:
                await asyncio.wait_for(self.sync.heartbeat_once(), timeout=2.0)
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

    def entry(self, stats: EngineStats) -> WorkerInfo:
        """This worker's registry entry for the engine's figures ``stats``."""
        return WorkerInfo(
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

    async def import_from_store(
        self, token_ids: list[int], cache_salt: str | None, timeout_s: float | None
    ) -> KvImport | None:
        """Full prompt blocks from the block store, when it holds more than our own cache."""
        if not self.store.enabled:
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
                present = await self.store.present(hashes, timeout_s)
                span.set_attribute("pdserve.kv.store_blocks", present)
                if present == 0:
                    return None  # without asking the engine, which answers between steps
                local = await self.loop.call(
                    lambda e: e.num_cached_prefix_tokens(token_ids, cache_salt)
                )
                span.set_attribute("pdserve.kv.local_tokens", local)
                if present * block_size <= local:
                    return None
                read = await self.store.read(hashes[:present], timeout_s, span)
            except BlockStoreSkipped:
                span.set_attribute("pdserve.kv.store_skipped", True)
                return None
            except Exception as exc:
                self.metrics.transfer_failed(BLOCK_STORE, RECEIVED)
                record_error(span, exc)
                log.warning("block store lookup failed, computing instead: %s", exc)
                return None
        return read.kv

    async def _release_engine_blocks(self, request_id: str) -> None:
        await self.loop.call(lambda e: e.release(request_id))
