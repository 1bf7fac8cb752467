"""The block store process: gRPC server, put expiry, and (with Redis) registry and index.

Lifecycle: ``start`` binds and serves; ``BlockStoreProcess.stop`` refuses new calls
(UNAVAILABLE), drains in-flight ones for ``drain_grace_s``, stops the background tasks,
withdraws the store's blocks from the prefix index and deregisters. ``serve`` runs that
until SIGTERM or SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from common.index import redis_client
from common.index.registry import WorkerInfo, WorkerRegistry
from common.rpc.interceptors import RpcMetrics, TelemetryInterceptor
from common.rpc.server import Server, Started, create_server, serve_process
from pdserve.kv.v1 import block_store_pb2_grpc
from services.blockstore.config import BlockStoreConfig
from services.blockstore.disk import DiskTier
from services.blockstore.index_sync import IndexSync
from services.blockstore.metrics import BlockStoreMetrics
from services.blockstore.servicer import SERVICE_NAME, BlockStoreServicer
from services.blockstore.store import BlockStore
from services.blockstore.tiering import DiskSpiller

log = logging.getLogger(__name__)

ROLE = "blockstore"  # the role in the worker registry
EXPIRY_SWEEP_S = 1.0
REDIS_CLEANUP_S = 5.0


class BlockStoreProcess:
    def __init__(
        self,
        config: BlockStoreConfig,
        server: Server,
        servicer: BlockStoreServicer,
        metrics: BlockStoreMetrics,
        spiller: DiskSpiller | None = None,
    ) -> None:
        self.config = config
        self.spiller = spiller
        self.metrics = metrics
        self.server = server
        self.servicer = servicer
        self.store = servicer.store
        self.port = server.port
        self.redis: Any = None
        self.registry: WorkerRegistry | None = None
        self.index_sync: IndexSync | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def stop(self) -> None:
        self.servicer.draining = True
        await self.server.stop(self.config.drain_grace_s)
        await self.close()

    async def close(self) -> None:
        """After the server stopped: background tasks, then Redis cleanup (bounded)."""
        self.servicer.draining = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self.spiller is not None:
            # What was committed reaches the disk before the process goes (bounded).
            if not await self.spiller.flush(self.config.drain_grace_s):
                log.warning("the disk tier did not finish its writes in time")
            await asyncio.to_thread(self.spiller.close)
            self.spiller = None
        if self.redis is None:
            return
        try:
            await asyncio.wait_for(self._leave_redis(), REDIS_CLEANUP_S)
        except Exception as exc:
            log.warning("leaving Redis failed (its entries expire by TTL): %s", exc)
        await self.redis.aclose()
        self.redis = None

    async def _leave_redis(self) -> None:
        if self.index_sync is not None:
            await self.index_sync.withdraw_all()
        if self.registry is not None:
            await self.registry.deregister(self.servicer.worker_id)

    def worker_info(self) -> WorkerInfo:
        status = self.servicer.status_pb()
        return WorkerInfo(
            worker_id=status.worker_id,
            role=ROLE,
            address=status.address,
            model=status.model,
            num_kv_blocks_total=status.num_kv_blocks_total,
            num_kv_blocks_free=status.num_kv_blocks_free,
            num_running=status.num_running_requests,
            prefix_cache_hit_rate=status.prefix_cache_hit_rate,
            pid=status.pid,
            draining=status.draining,
        )

    async def start_background(self) -> None:
        """Put expiry; with a Redis URL also the heartbeat and the prefix index."""
        self._spawn(self._expire_puts_forever())
        if self.config.redis_url:
            await self._connect_redis(self.config.redis_url)

    async def _connect_redis(self, url: str) -> None:
        self.redis = redis_client.connect(url)
        try:
            await asyncio.wait_for(self.redis.ping(), REDIS_CLEANUP_S)
        except Exception as exc:
            await self.redis.aclose()
            self.redis = None
            raise OSError(f"cannot reach Redis at {url}: {exc}") from exc
        self.registry = WorkerRegistry(self.redis, ttl_s=max(3.0, 5 * self.config.heartbeat_s))
        self.index_sync = IndexSync(self.redis, self.store, self.config.index_ttl_s)
        self.store.listener = self.index_sync
        self._spawn(self.index_sync.run())
        self._spawn(self._heartbeat_forever())

    async def _heartbeat_forever(self) -> None:
        assert self.registry is not None
        stale = False
        while True:
            try:
                fresh = await self.registry.heartbeat(self.worker_info())
                self.metrics.redis.ok()
                if (fresh or stale) and self.index_sync is not None:
                    # Redis lost our entry (it restarted empty) or missed writes: put every
                    # block back into the prefix index now, not at the next refresh.
                    self.index_sync.refresh_soon()
                stale = False
            except Exception as exc:
                stale = True
                log.warning("heartbeat to Redis failed: %s", exc)
                self.metrics.redis.failed("heartbeat")
            await asyncio.sleep(self.config.heartbeat_s)

    async def _expire_puts_forever(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_SWEEP_S)
            expired = self.store.expire_puts()
            if expired:
                log.info("aborted %d expired puts", expired)

    def _spawn(self, coro: Any) -> None:
        self._tasks.append(asyncio.create_task(coro))


async def start(
    config: BlockStoreConfig, metrics_registry: CollectorRegistry | None = None
) -> BlockStoreProcess:
    """Binds ``config.bind_address`` (port 0 picks a free port) and starts serving. Metrics
    go to ``metrics_registry`` (default: a registry of its own, ``process.metrics``)."""
    store = BlockStore(config.capacity_bytes, config.put_expiry_s)
    spiller = await _open_disk(config, store) if config.disk_dir else None
    servicer = BlockStoreServicer(store, worker_id="", address="")
    metrics = BlockStoreMetrics(metrics_registry or CollectorRegistry())
    metrics.watch_store(store, asyncio.get_running_loop())
    if spiller is not None:
        metrics.watch_disk(spiller)

    try:
        server = await _create_server(config, servicer, metrics)
    except BaseException:
        if spiller is not None:
            spiller.close()
        raise
    servicer.worker_id = config.resolved_worker_id(server.port)
    servicer.address = config.advertised_address(server.port)
    process = BlockStoreProcess(config, server, servicer, metrics, spiller)
    try:
        await process.start_background()
    except BaseException:
        await server.stop(0)
        await process.close()
        raise
    log.info(
        "block store %s serving at %s (%d bytes%s%s)",
        servicer.worker_id,
        servicer.address,
        config.capacity_bytes,
        f", disk tier {config.disk_dir} ({config.disk_capacity_bytes} bytes)" if spiller else "",
        ", prefix index on" if config.redis_url else "",
    )
    return process


async def _open_disk(config: BlockStoreConfig, store: BlockStore) -> DiskSpiller:
    """Reindexes the disk tier (on a thread: it reads every segment) and attaches it."""
    assert config.disk_dir
    disk = DiskTier(config.disk_dir, config.disk_capacity_bytes, config.disk_segment_bytes,
                    fsync=config.disk_fsync)  # fmt: skip
    start = time.perf_counter()
    held = await asyncio.to_thread(disk.open)
    spiller = DiskSpiller(disk, store, asyncio.get_running_loop())
    taken = store.attach_disk(spiller, held)
    stats = disk.stats()
    log.info(
        "disk tier %s: %d blocks in %d segments (%d bytes), reindexed in %.2f s%s",
        config.disk_dir, taken, stats.num_segments, stats.used_bytes,
        time.perf_counter() - start,
        f"; {stats.num_corrupt} damaged or torn records dropped" if stats.num_corrupt else "",
    )  # fmt: skip
    return spiller


async def _create_server(
    config: BlockStoreConfig, servicer: BlockStoreServicer, metrics: BlockStoreMetrics
) -> Server:
    def register(server: grpc.aio.Server) -> None:
        block_store_pb2_grpc.add_BlockStoreServiceServicer_to_server(servicer, server)

    return await create_server(
        config.bind_address,
        register,
        [SERVICE_NAME],
        interceptors=[TelemetryInterceptor(RpcMetrics(metrics.registry))],
        credentials=config.tls.server_credentials() if config.tls else None,
    )


async def serve(config: BlockStoreConfig) -> None:
    """The block store process (common/rpc/server.py's serve_process), until SIGTERM."""

    async def started(registry: CollectorRegistry) -> Started:
        process = await start(config, registry)
        return Started(process.server, on_stop=process.close)

    await serve_process(
        ROLE, config.worker_id, config.host, config.metrics_port, config.drain_grace_s, started
    )
