"""Routing: which prefill worker (if any) and which decode worker serve a request.

Prefill: the highest ``overlap_weight * leading cached blocks - load``, where load counts
the worker's queued requests (registry) and this gateway's calls in flight to it.
Decode: the fewest running sequences (plus in-flight calls), then the most free blocks.
Conditional disaggregation: when what a decode worker would have to compute itself (the
prompt minus its cached prefix) is under ``local_prefill_tokens``, or no prefill worker is
alive, the decode worker prefills locally and no KV moves.

Every route names its reason (``Route.reason``, one of ``REASONS``): traces and the
``pdserve:routing_decisions_total`` metric carry it.
"""

from __future__ import annotations

import zlib
from collections import Counter
from dataclasses import dataclass

from common.errors import UnavailableError
from common.index.registry import WorkerInfo

# Why a request went where it did.
PREFIX_OVERLAP = "prefix_overlap"  # remote prefill on a worker holding part of the prompt
LOAD = "load"  # remote prefill on the least loaded worker (no worker holds any of it)
LOCAL_PREFILL_SHORT = "local_prefill_short"  # the prompt is short: the decode worker prefills
LOCAL_PREFILL_CACHED = "local_prefill_cached"  # a decode worker holds nearly all of it
NO_PREFILL_WORKER = "no_prefill_worker"  # none is alive: the decode worker prefills
REASONS = (PREFIX_OVERLAP, LOAD, LOCAL_PREFILL_SHORT, LOCAL_PREFILL_CACHED, NO_PREFILL_WORKER)


@dataclass(frozen=True)
class Route:
    decode: WorkerInfo
    prefill: WorkerInfo | None  # None: the decode worker prefills locally
    overlap_blocks: int  # cached leading blocks on the worker that will prefill
    reason: str  # one of REASONS


class Router:
    def __init__(self, block_size: int, local_prefill_tokens: int, overlap_weight: float) -> None:
        self.block_size = block_size
        self.local_prefill_tokens = local_prefill_tokens
        self.overlap_weight = overlap_weight
        self.in_flight: Counter[str] = Counter()

    def choose(
        self,
        request_id: str,
        prompt_len: int,
        overlap: dict[str, int],
        prefills: list[WorkerInfo],
        decodes: list[WorkerInfo],
    ) -> Route:
        if not decodes:
            raise UnavailableError("no decode worker is alive; retry later")

        def tiebreak(w: WorkerInfo) -> int:
            return _tiebreak(request_id, w)

        def decode_key(w: WorkerInfo) -> tuple[float, ...]:
            return self._decode_key(request_id, w)

        best_cached = max(decodes, key=lambda w: (overlap.get(w.worker_id, 0), -decode_key(w)[0]))
        cached_tokens = overlap.get(best_cached.worker_id, 0) * self.block_size
        if prompt_len - cached_tokens < self.local_prefill_tokens or not prefills:
            target = best_cached if cached_tokens else min(decodes, key=decode_key)
            if not prefills:
                reason = NO_PREFILL_WORKER
            else:
                reason = LOCAL_PREFILL_CACHED if cached_tokens else LOCAL_PREFILL_SHORT
            return Route(target, None, overlap.get(target.worker_id, 0), reason)

        def prefill_score(w: WorkerInfo) -> tuple[float, int]:
            load = w.num_waiting + self.in_flight[w.worker_id]
            return (self.overlap_weight * overlap.get(w.worker_id, 0) - load, -tiebreak(w))

        prefill = max(prefills, key=prefill_score)
        overlap_blocks = overlap.get(prefill.worker_id, 0)
        reason = PREFIX_OVERLAP if overlap_blocks else LOAD
        return Route(min(decodes, key=decode_key), prefill, overlap_blocks, reason)

    def choose_decode(self, request_id: str, decodes: list[WorkerInfo]) -> WorkerInfo:
        """The decode worker that continues a request elsewhere (migration): the least
        loaded, as for a new request."""
        if not decodes:
            raise UnavailableError("no decode worker is alive; retry later")
        return min(decodes, key=lambda w: self._decode_key(request_id, w))

    def _decode_key(self, request_id: str, w: WorkerInfo) -> tuple[float, ...]:
        return (
            w.num_running + self.in_flight[w.worker_id],
            -w.num_kv_blocks_free,
            _tiebreak(request_id, w),
        )


def _tiebreak(request_id: str, w: WorkerInfo) -> int:
    # Stable per request, different across requests: spreads ties evenly.
    return zlib.crc32(f"{request_id}/{w.worker_id}".encode())
