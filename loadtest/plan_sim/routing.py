"""The gateway's routing rules (services/gateway/routing.py, policy prefix-aware) over the
simulated workers:

- decode: the fewest requests (running, waiting, on their way), then the most free KV,
  ties spread at random;
- conditional disaggregation: when the prompt minus the best-cached decode worker's prefix
  is under ``local_prefill_tokens``, or no prefill worker serves, that decode worker (or
  the least loaded, when none holds any of it) prefills locally;
- prefill: the highest ``overlap_weight * cached tokens - (queued tokens + prompt)``.

Loads are read live (the gateway's view lags by a heartbeat; the simulator's does not).
The least loaded workers come from heaps of (load, ..., version) entries, stale ones
dropped as they surface, so a route costs O(log workers) however many there are.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

from loadtest.plan_sim.prefix import PrefixIndex
from loadtest.plan_sim.worker import SimWorker

# Workers holding a prefix are scored one by one up to this many; beyond, the least
# loaded of them stands for the crowd (every worker holds a fleet-wide system prompt).
ROUTE_CANDIDATES = 16


@dataclass(frozen=True)
class Route:
    decode: SimWorker
    prefill: SimWorker | None  # None: the decode worker prefills locally


class Router:
    def __init__(
        self,
        index: PrefixIndex,
        block_tokens: int,
        local_prefill_tokens: int,
        overlap_weight: float,
        seed: int,
    ) -> None:
        self.index = index
        self.block_tokens = block_tokens
        self.local_prefill_tokens = local_prefill_tokens
        self.overlap_weight = overlap_weight
        self.decodes: dict[int, SimWorker] = {}
        self.prefills: dict[int, SimWorker] = {}
        self._version: dict[int, int] = {}
        # (load..., tiebreak, worker id, version): the last two read back as ints.
        self._decode_heap: list[tuple[float, ...]] = []
        self._prefill_heap: list[tuple[float, ...]] = []
        self._salt = random.Random(seed).getrandbits(24)

    # -- serving sets and loads ---------------------------------------------------------------

    def serve(self, worker: SimWorker, role: str) -> None:
        (self.prefills if role == "prefill" else self.decodes)[worker.worker_id] = worker
        self.load_changed(worker)

    def withdraw(self, worker: SimWorker) -> None:
        self.prefills.pop(worker.worker_id, None)
        self.decodes.pop(worker.worker_id, None)
        self._version[worker.worker_id] = self._version.get(worker.worker_id, 0) + 1

    def load_changed(self, worker: SimWorker) -> None:
        wid = worker.worker_id
        version = self._version[wid] = self._version.get(wid, 0) + 1
        rand = self._tiebreak(wid, version)
        if wid in self.decodes:
            entry = (worker.num_requests, -worker.kv_free, rand, wid, version)
            heapq.heappush(self._decode_heap, entry)
            if len(self._decode_heap) > 8 * len(self.decodes) + 64:
                self._decode_heap = self._rebuilt(self.decodes, decode=True)
        elif wid in self.prefills:
            heapq.heappush(self._prefill_heap, (worker.pending_tokens, rand, wid, version))
            if len(self._prefill_heap) > 8 * len(self.prefills) + 64:
                self._prefill_heap = self._rebuilt(self.prefills, decode=False)

    def _rebuilt(self, workers: dict[int, SimWorker], decode: bool) -> list[tuple[float, ...]]:
        """A heap of the current entries only (stale ones pile up under busy workers)."""
        entries: list[tuple[float, ...]] = []
        for wid, w in workers.items():
            version = self._version[wid] = self._version[wid] + 1
            rand = self._tiebreak(wid, version)
            if decode:
                entries.append((w.num_requests, -w.kv_free, rand, wid, version))
            else:
                entries.append((w.pending_tokens, rand, wid, version))
        heapq.heapify(entries)
        return entries

    def _tiebreak(self, wid: int, version: int) -> float:
        """Equal loads in a random order (a multiplicative hash: cheaper than a draw)."""
        return ((wid * 2654435761 + version * 40503 + self._salt) & 0xFFFFFF) / 0x1000000

    def least_decode(self) -> SimWorker | None:
        return self._least(self._decode_heap, self.decodes)

    def least_prefill(self) -> SimWorker | None:
        return self._least(self._prefill_heap, self.prefills)

    def _least(
        self, heap: list[tuple[float, ...]], workers: dict[int, SimWorker]
    ) -> SimWorker | None:
        while heap:
            wid, version = int(heap[0][-2]), int(heap[0][-1])
            if wid in workers and self._version[wid] == version:
                return workers[wid]
            heapq.heappop(heap)
        return None

    # -- a request's route ------------------------------------------------------------------

    def choose(
        self, prompt_tokens: int, blocks: tuple[int, ...], known_cached: int = 0
    ) -> Route | None:
        """None when no decode worker serves. ``known_cached``: prompt tokens cached
        wherever it goes (a recorded run's figure, without blocks to look up)."""
        least = self.least_decode()
        if least is None:
            return None
        bt = self.block_tokens
        depths, crowd, crowd_depth = (
            self.index.overlap(blocks, ROUTE_CANDIDATES) if blocks else ({}, set(), 0)
        )

        def cached(wid: int) -> int:
            depth = depths.get(wid) or (crowd_depth if wid in crowd else 0)
            return min(depth * bt, max(prompt_tokens - 1, 0))

        best_cached, best = least, max(cached(least.worker_id), known_cached)
        for wid in depths:
            w = self.decodes.get(wid)
            if w is not None:
                c = cached(wid)
                if c > best or (c == best and w.num_requests < best_cached.num_requests):
                    best_cached, best = w, c
        if prompt_tokens - best < self.local_prefill_tokens or not self.prefills:
            return Route(best_cached if best else least, None)
        candidates = [self.prefills[wid] for wid in depths if wid in self.prefills]
        lightest = self.least_prefill()
        if lightest is not None:
            candidates.append(lightest)
        prefill = max(
            candidates,
            key=lambda w: (
                self.overlap_weight * cached(w.worker_id) - w.pending_tokens - prompt_tokens,
                -w.worker_id,
            ),
        )
        return Route(least, prefill)
