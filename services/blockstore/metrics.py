"""The block store's Prometheus metrics: capacity, blocks, puts, evictions, lookups.

The store is single-threaded (the event loop's); a scrape reads its stats on that loop,
waiting at most ``STATS_TIMEOUT_S``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common.telemetry.metrics import RedisHealth, metric_name
from services.blockstore.store import BlockStore, StoreStats
from services.blockstore.tiering import DiskSpiller

STATS_TIMEOUT_S = 1.0


class BlockStoreMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.redis = RedisHealth(registry)

    def watch_store(self, store: BlockStore, loop: asyncio.AbstractEventLoop) -> None:
        self.registry.register(StoreCollector(lambda: _on_loop(loop, store.stats)))

    def watch_disk(self, spiller: DiskSpiller) -> None:
        self.registry.register(DiskCollector(spiller))


def _on_loop(loop: asyncio.AbstractEventLoop, read: Callable[[], StoreStats]) -> StoreStats | None:
    if loop.is_closed():
        return None
    future: concurrent.futures.Future[StoreStats] = concurrent.futures.Future()

    def run() -> None:
        with contextlib.suppress(Exception):
            try:
                future.set_result(read())
            except Exception as exc:
                future.set_exception(exc)

    loop.call_soon_threadsafe(run)
    try:
        return future.result(timeout=STATS_TIMEOUT_S)
    except concurrent.futures.TimeoutError:
        return None


class StoreCollector(Collector):
    def __init__(self, read: Callable[[], StoreStats | None]) -> None:
        self.read = read

    def describe(self) -> Iterator[Metric]:
        return iter(_families(None))

    def collect(self) -> Iterator[Metric]:
        return iter(_families(self.read()))


def _families(stats: StoreStats | None) -> list[Metric]:
    def gauge(name: str, doc: str, field: str) -> Metric:
        value = None if stats is None else getattr(stats, field)
        return GaugeMetricFamily(metric_name(name), doc, value=value)

    def counter(name: str, doc: str, field: str) -> Metric:
        value = None if stats is None else getattr(stats, field)
        return CounterMetricFamily(metric_name(name), doc, value=value)

    used = GaugeMetricFamily(
        metric_name("blockstore_used_bytes"),
        "Bytes held: committed blocks, reserved for open puts, pinned by readers.",
        labels=["state"],
    )
    if stats is not None:
        used.add_metric(["committed"], stats.committed_bytes)
        used.add_metric(["reserved"], stats.reserved_bytes)
        used.add_metric(["pinned"], stats.pinned_bytes)
    return [
        gauge("blockstore_capacity_bytes", "Memory for blocks.", "capacity_bytes"),
        used,
        gauge("blockstore_blocks", "Committed blocks held.", "num_blocks"),
        gauge("blockstore_open_puts", "Puts begun, not yet committed or aborted.",
              "num_open_puts"),
        counter("blockstore_evictions", "Blocks evicted to make room.", "num_evictions"),
        counter("blockstore_expired_puts", "Puts aborted because nobody finished them.",
                "num_expired_puts"),
        counter("blockstore_lookup_blocks", "Blocks looked up (ContainsBlocks).",
                "num_blocks_looked_up"),
        counter("blockstore_hit_blocks", "Blocks looked up and found.", "num_blocks_found"),
        counter("blockstore_disk_hit_blocks", "Blocks looked up and found on disk only.",
                "num_blocks_found_on_disk"),
        gauge("blockstore_disk_blocks", "Blocks on disk (the disk tier).", "num_disk_blocks"),
        gauge("blockstore_disk_writing_bytes", "Bytes waiting to be written to disk.",
              "writing_bytes"),
        counter("blockstore_disk_read_blocks", "Blocks read back from disk.", "num_disk_reads"),
        counter("blockstore_disk_promoted_blocks", "Blocks read from disk and kept in memory.",
                "num_promotions"),
        counter("blockstore_disk_dropped_blocks",
                "Blocks evicted from memory and not written to disk: writes were behind.",
                "num_spill_dropped"),
    ]  # fmt: skip


class DiskCollector(Collector):
    """The disk tier's files, read from the tier itself (thread-safe)."""

    def __init__(self, spiller: DiskSpiller) -> None:
        self.spiller = spiller

    def collect(self) -> Iterator[Metric]:
        stats = self.spiller.disk.stats()
        gauges: tuple[tuple[str, str, float], ...] = (
            ("blockstore_disk_capacity_bytes", "Bound on the disk tier's files.",
             stats.capacity_bytes),
            ("blockstore_disk_used_bytes", "The disk tier's files' size.", stats.used_bytes),
            ("blockstore_disk_segments", "The disk tier's segment files.", stats.num_segments),
        )  # fmt: skip
        for name, doc, value in gauges:
            yield GaugeMetricFamily(metric_name(name), doc, value=value)
        counters: tuple[tuple[str, str, float], ...] = (
            ("blockstore_disk_corrupt_records",
             "Records dropped for a bad checksum or a torn write.", stats.num_corrupt),
            ("blockstore_disk_written_blocks", "Blocks written to disk.",
             self.spiller.num_written),
            ("blockstore_disk_write_errors", "Batches the disk failed to take.",
             self.spiller.num_write_errors),
            ("blockstore_disk_write_seconds", "Time spent writing (and syncing) to disk.",
             self.spiller.write_seconds),
        )  # fmt: skip
        for name, doc, value in counters:
            yield CounterMetricFamily(metric_name(name), doc, value=value)
