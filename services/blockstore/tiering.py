"""The block store's disk I/O, off the event loop: one thread writes, a small pool reads.

``DiskSpiller`` is the store's ``DiskSpill``. ``submit`` (on the loop) queues a block; the
spill thread takes whatever has queued, up to ``batch_bytes``, appends it with one fsync
(DiskTier.put_many) and reports back on the loop (``BlockStore.disk_written``), so the
store's view of the disk only ever changes on its own thread. A failed write (a full or
failing disk) is logged and reported as nothing written: the blocks stay in memory while
it holds them, and are not counted on disk. ``read`` runs checked reads on the pool.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from common.kv.layout import KvLayout
from services.blockstore.disk import DiskBlock, DiskTier, WriteResult
from services.blockstore.store import BlockKey, BlockStore, StoredBlock

log = logging.getLogger(__name__)

READ_THREADS = 2


class DiskSpiller:
    def __init__(
        self, disk: DiskTier, store: BlockStore, loop: asyncio.AbstractEventLoop,
        batch_bytes: int = 16 << 20,
    ) -> None:  # fmt: skip
        self.disk = disk
        self.store = store
        self.loop = loop
        self.batch_bytes = batch_bytes
        self._queue: queue.SimpleQueue[DiskBlock | None] = queue.SimpleQueue()
        self._outstanding = 0  # submitted, not yet reported (loop thread only)
        self._idle = asyncio.Event()
        self._idle.set()
        self._reads = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="blockstore-read")
        self.num_written = 0  # blocks, since start (spill thread)
        self.num_write_errors = 0
        self.write_seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="blockstore-spill", daemon=True)
        self._thread.start()

    # -- the loop's side ----------------------------------------------------------------

    def submit(self, block: StoredBlock, layout: KvLayout) -> None:
        self._outstanding += 1
        self._idle.clear()
        self._queue.put(DiskBlock(block.key, layout, block.data, block.crc32c))

    async def read(self, keys: Sequence[BlockKey]) -> list[DiskBlock | None]:
        keys = list(keys)
        return await self.loop.run_in_executor(
            self._reads, lambda: [self.disk.get(key) for key in keys]
        )

    async def flush(self, timeout_s: float) -> bool:
        """Waits until every submitted block is reported; False if ``timeout_s`` ran out."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def close(self) -> None:
        """Stops the spill thread after what is queued (a shutdown flushes first)."""
        self._queue.put(None)
        self._thread.join(timeout=30)
        self._reads.shutdown(wait=True)

    def _report(self, submitted: list[BlockKey], result: WriteResult) -> None:
        self.store.disk_written(submitted, result.written, result.evicted)
        self._outstanding -= len(submitted)
        if self._outstanding == 0:
            self._idle.set()

    # -- the spill thread ---------------------------------------------------------------

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch, size, stop = [first], len(first.data), False
            while size < self.batch_bytes:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                batch.append(more)
                size += len(more.data)
            start = time.perf_counter()
            try:
                result = self.disk.put_many(batch)
                self.num_written += len(result.written)
            except Exception as exc:
                log.warning("writing %d blocks to disk failed: %s", len(batch), exc)
                self.num_write_errors += 1
                result = WriteResult([], [])
            self.write_seconds += time.perf_counter() - start
            submitted = [block.key for block in batch]
            try:
                self.loop.call_soon_threadsafe(self._report, submitted, result)
            except RuntimeError:
                return  # the loop closed: the process is going away
            if stop:
                return
