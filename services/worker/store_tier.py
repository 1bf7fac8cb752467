"""The block store as a worker's second source of KV: best effort, short timeouts, and a
circuit breaker that leaves a failing store alone for a few seconds (requests then neither
wait on it nor fail because of it).

Reads: ``present`` (how many leading blocks the store holds) and ``read`` (those blocks,
with the transfer in the worker's metrics and on the current span); the prefill worker's
prefix import and the decode worker's fallback after a failed pull both read through these.
Writes: ``put`` (two-phase, existing blocks skipped) and ``write_behind`` (in the background,
bounded, blocks of many requests and steps together in one put)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import torch
from opentelemetry.trace import Span

from common.engine.request import FullBlocks, KvImport
from common.errors import PdserveError, UnavailableError
from common.kv.block_store_client import BlockStoreClient
from common.kv.layout import KvLayout
from common.kv.pull import transfer_attributes
from common.rpc.breaker import PEER_FAILURE_CODES, CircuitBreaker, CircuitState
from services.worker.config import WorkerConfig
from services.worker.metrics import BLOCK_STORE, RECEIVED, SENT, WorkerMetrics

log = logging.getLogger(__name__)

T = TypeVar("T")

STORE_FAILURE_THRESHOLD = 2  # consecutive failed block store calls that open its breaker
STORE_COOLDOWN_S = 5.0  # then no call for this long, then one probe
PUT_TIMEOUT_S = 30.0  # a write-through put runs in the background: it may take longer
# Write-behind: one put in flight at a time, started at most every WRITE_BEHIND_INTERVAL_S,
# carrying every block that filled since the previous one (of every request). A put costs
# three RPCs on each side whatever it carries: at 16 streams one put per block (a block fills
# about every step) took 15-20 % of a 2-core machine's output tok/s. A block is in the store
# about an interval after it filled; a request resumed elsewhere recomputes what was not.
WRITE_BEHIND_INTERVAL_S = 0.1
MAX_BLOCKS_PER_PUT = 256
# Blocks waiting at most; beyond, new ones are not written (a resumed request then
# recomputes them): the store is a cache, and this queue, like every queue, is bounded.
MAX_WRITE_BEHIND_BLOCKS = 4096
_TIMEOUT_CODES = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED})


class BlockStoreSkipped(UnavailableError):
    """The block store's breaker is open: the call was not made."""


@dataclass
class StoreRead:
    """Blocks read from the store: their tokens' KV, and the transfer's size and time."""

    kv: KvImport
    num_bytes: int
    seconds: float


class StoreTier:
    def __init__(
        self,
        config: WorkerConfig,
        layout: KvLayout,
        metrics: WorkerMetrics,
        in_background: Callable[[Coroutine[Any, Any, Any]], object],
    ) -> None:
        self.config = config
        self.layout = layout
        self.metrics = metrics
        self.in_background = in_background
        self.client: BlockStoreClient | None = None
        self.breaker = CircuitBreaker(
            STORE_FAILURE_THRESHOLD, STORE_COOLDOWN_S, on_change=self._state_changed
        )
        self._pending: deque[FullBlocks] = deque()
        self.num_blocks_pending = 0
        self._writing = False  # a write-behind task runs
        self._hurry = asyncio.Event()  # write what is pending now (drain, stop)
        self._written = asyncio.Event()  # set while nothing is pending or being written
        self._written.set()
        self._last_put_at = -WRITE_BEHIND_INTERVAL_S

    @property
    def enabled(self) -> bool:
        return self.client is not None

    def open(self) -> None:
        if self.config.blockstore:
            self.client = BlockStoreClient(
                self.config.blockstore, self.config.served_model_name, self.layout,
                tls=self.config.tls,
            )  # fmt: skip

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    def timeout(self, timeout_s: float | None) -> float:
        """A block store read's timeout: the caller's time left, at most blockstore_timeout_s."""
        limit = self.config.blockstore_timeout_s
        return limit if timeout_s is None else min(timeout_s, limit)

    async def call(self, call: Awaitable[T]) -> T:
        """Runs one block store operation through the store's circuit breaker: raises
        UnavailableError at once while the breaker is open; a store that cannot be reached,
        errs or times out counts as a failure, any answer (NOT_FOUND too) as a success."""
        if not self.breaker.acquire():
            if inspect.iscoroutine(call):
                call.close()
            raise BlockStoreSkipped("the block store is failing; skipped for a few seconds")
        try:
            result = await call
        except grpc.aio.AioRpcError as exc:
            self._outcome(exc.code() not in PEER_FAILURE_CODES | _TIMEOUT_CODES)
            raise
        except (UnavailableError, asyncio.TimeoutError):
            self._outcome(False)
            raise
        except PdserveError:
            self._outcome(True)
            raise
        self._outcome(True)
        return result

    def _outcome(self, ok: bool) -> None:
        if ok:
            self.breaker.success()
        else:
            self.breaker.failure()

    def _state_changed(self, old: CircuitState, new: CircuitState) -> None:
        self.metrics.block_store_up.set(1 if new is CircuitState.CLOSED else 0)
        if new is CircuitState.OPEN:
            log.warning(
                "the block store at %s keeps failing; leaving it alone for %.0f s",
                self.config.blockstore,
                self.breaker.cooldown_s,
            )
        elif new is CircuitState.CLOSED:
            log.info("the block store at %s answers again", self.config.blockstore)

    # -- reads ----------------------------------------------------------------------------------

    async def present(self, block_hashes: list[int], timeout_s: float | None) -> int:
        """How many leading blocks of ``block_hashes`` the store holds (0 without a store)."""
        if self.client is None or not block_hashes:
            return 0
        return await self.call(
            self.client.contains(block_hashes, timeout_s=self.timeout(timeout_s))
        )

    async def read(self, block_hashes: list[int], timeout_s: float | None, span: Span) -> StoreRead:
        """The blocks of ``block_hashes`` (which ``present`` said the store holds), recorded
        as a transfer in the metrics and on ``span``. Raises what the store raised; the
        caller counts the failure, as it decides what a failure is."""
        assert self.client is not None
        start = time.perf_counter()
        data = await self.call(self.client.get(block_hashes, timeout_s=self.timeout(timeout_s)))
        seconds = time.perf_counter() - start
        num_bytes = data.numel() * data.element_size()
        num_blocks = len(block_hashes)
        self.metrics.transferred(BLOCK_STORE, RECEIVED, num_bytes, num_blocks, seconds)
        span.set_attributes(transfer_attributes(num_bytes, num_blocks, seconds))
        return StoreRead(KvImport(num_blocks * self.layout.block_size, data), num_bytes, seconds)

    # -- writes ---------------------------------------------------------------------------------

    async def put(self, block_hashes: list[int], data: Any) -> None:
        """Writes full blocks to the block store (two-phase put; existing ones skipped)."""
        if self.client is None or not block_hashes:
            return
        start = time.perf_counter()
        try:
            num_written = await self.call(
                self.client.put(block_hashes, data[: len(block_hashes)], timeout_s=PUT_TIMEOUT_S)
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
        (so that a request resumed elsewhere finds them), with those of other requests and
        steps in one put (see WRITE_BEHIND_INTERVAL_S); dropped when too many wait already."""
        if self.client is None or not blocks.block_hashes:
            return
        if self.num_blocks_pending + len(blocks.block_hashes) > MAX_WRITE_BEHIND_BLOCKS:
            log.debug("write-behind queue full: %d blocks not written", len(blocks.block_hashes))
            return
        self._pending.append(blocks)
        self.num_blocks_pending += len(blocks.block_hashes)
        self._written.clear()
        if not self._writing:
            self._writing = True
            self.in_background(self._write_pending())

    def hurry(self) -> None:
        """Write what is pending without waiting for the interval (the worker stops)."""
        self._hurry.set()

    async def flush(self) -> None:
        """Writes every block pending now, and returns once they are written (or failed)."""
        self._hurry.set()
        await self._written.wait()

    async def _write_pending(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                wait_s = self._last_put_at + WRITE_BEHIND_INTERVAL_S - loop.time()
                if wait_s > 0 and not self._hurry.is_set():
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._hurry.wait(), wait_s)
                hashes, data = self._take_batch()
                self._last_put_at = loop.time()
                await self.put(hashes, data)
        finally:
            self._writing = False
            self._hurry.clear()
            if self._pending:  # cancelled mid-put: what is left is not written
                self._pending.clear()
                self.num_blocks_pending = 0
            self._written.set()

    def _take_batch(self) -> tuple[list[int], torch.Tensor]:
        """Up to MAX_BLOCKS_PER_PUT pending blocks (at least one request's), each hash once:
        their hashes and data."""
        hashes: list[int] = []
        seen: set[int] = set()
        parts: list[torch.Tensor] = []
        num_taken = 0
        while self._pending and num_taken < MAX_BLOCKS_PER_PUT:
            part = self._pending.popleft()
            self.num_blocks_pending -= len(part.block_hashes)
            num_taken += len(part.block_hashes)
            ints = [int(h) for h in part.block_hashes]
            keep = [i for i, h in enumerate(ints) if h not in seen]
            fresh = [ints[i] for i in keep]
            hashes += fresh
            seen.update(fresh)
            parts.append(part.data if len(keep) == len(part.block_hashes) else part.data[keep])
        return hashes, parts[0] if len(parts) == 1 else torch.cat(parts)
