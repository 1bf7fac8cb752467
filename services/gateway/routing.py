"""Routing: which prefill worker (if any) and which decode worker serve a request.

Prefill: the worker where the prompt's first token comes soonest, counted in tokens of
work: the highest ``overlap_weight * cached prompt tokens - load``, where load is the
tokens already waiting there (the more of the worker's own heartbeat figure and this
gateway's prefill calls in flight to it) plus the whole prompt. With weight 1 the score is
minus the tokens the worker must compute before this prompt's first token, so a cached
prefix wins until the queue behind it costs more than the prefix saves: requests sharing a
prefix do not all pile onto one worker.
Decode: the fewest running sequences (plus in-flight calls), then the most free blocks.
Conditional disaggregation: when what a decode worker would have to compute itself (the
prompt minus its cached prefix) is under ``local_prefill_tokens``, or no prefill worker is
alive, the decode worker prefills locally and no KV moves. A worker in the ``both`` role is
among the prefill and the decode workers; when one is chosen for both hops it prefills
locally (colocated).

Policies (``--routing-policy``): ``prefix-aware`` as above; ``load`` ignores the prefix
index (least load wins, ties spread by request hash); ``round-robin`` ignores index and load
and takes the workers of each role in turn, the baseline prefix-aware routing is measured
against.

Every route names its reason (``Route.reason``, one of ``REASONS``): traces and the
``pdserve:routing_decisions_total`` metric carry it.
"""

from __future__ import annotations

import contextlib
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from common.errors import UnavailableError
from common.index.registry import WorkerInfo

# Why a request went where it did.
PREFIX_OVERLAP = "prefix_overlap"  # remote prefill on a worker holding part of the prompt
LOAD = "load"  # remote prefill on the least loaded worker (no worker holds any of it)
LOCAL_PREFILL_SHORT = "local_prefill_short"  # the prompt is short: the decode worker prefills
LOCAL_PREFILL_CACHED = "local_prefill_cached"  # a decode worker holds nearly all of it
NO_PREFILL_WORKER = "no_prefill_worker"  # none is alive: the decode worker prefills
ROUND_ROBIN = "round_robin"  # remote prefill on the next worker in turn (policy round-robin)
COLOCATED = "colocated"  # the worker chosen to prefill is the decode worker (role both)
REASONS = (
    PREFIX_OVERLAP,
    LOAD,
    LOCAL_PREFILL_SHORT,
    LOCAL_PREFILL_CACHED,
    NO_PREFILL_WORKER,
    ROUND_ROBIN,
    COLOCATED,
)
POLICIES = ("prefix-aware", "load", "round-robin")


@dataclass(frozen=True)
class Route:
    decode: WorkerInfo
    prefill: WorkerInfo | None  # None: the decode worker prefills locally
    overlap_blocks: int  # cached leading blocks on the worker that will prefill
    reason: str  # one of REASONS


class Router:
    def __init__(
        self,
        block_size: int,
        local_prefill_tokens: int,
        overlap_weight: float,
        policy: str = "prefix-aware",
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.block_size = block_size
        self.local_prefill_tokens = local_prefill_tokens
        self.overlap_weight = overlap_weight
        self.policy = policy
        self._in_flight: Counter[str] = Counter()  # calls in flight per worker
        # Prompt tokens to compute in this gateway's prefill calls in flight, per worker.
        self._in_flight_tokens: Counter[str] = Counter()
        self._turns: Counter[str] = Counter()  # round-robin position per role

    def call_started(self, worker_id: str, prompt_tokens: int = 0) -> None:
        """One more call to ``worker_id`` in flight, making it compute ``prompt_tokens``:
        counted in that worker's load (between its heartbeats) until ``call_ended``."""
        self._in_flight[worker_id] += 1
        self._in_flight_tokens[worker_id] += prompt_tokens

    def call_ended(self, worker_id: str, prompt_tokens: int = 0) -> None:
        self._in_flight[worker_id] -= 1
        self._in_flight_tokens[worker_id] -= prompt_tokens

    @contextlib.contextmanager
    def calling(self, worker_id: str, prompt_tokens: int = 0) -> Iterator[None]:
        """``call_started`` ... ``call_ended`` around a block."""
        self.call_started(worker_id, prompt_tokens)
        try:
            yield
        finally:
            self.call_ended(worker_id, prompt_tokens)

    def _next_in_turn(self, role: str, workers: list[WorkerInfo]) -> WorkerInfo:
        ordered = sorted(workers, key=lambda w: w.worker_id)
        chosen = ordered[self._turns[role] % len(ordered)]
        self._turns[role] += 1
        return chosen

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
        if self.policy == "round-robin":
            decode = self._next_in_turn("decode", decodes)
            if prompt_len < self.local_prefill_tokens or not prefills:
                reason = NO_PREFILL_WORKER if not prefills else LOCAL_PREFILL_SHORT
                return Route(decode, None, overlap.get(decode.worker_id, 0), reason)
            prefill = self._next_in_turn("prefill", prefills)
            if prefill.worker_id == decode.worker_id:
                return Route(decode, None, overlap.get(decode.worker_id, 0), COLOCATED)
            return Route(decode, prefill, overlap.get(prefill.worker_id, 0), ROUND_ROBIN)
        if self.policy == "load":
            overlap = {}

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

        prefill = self.best_prefill(request_id, prompt_len, overlap, prefills)
        decode = min(decodes, key=decode_key)
        if prefill.worker_id == decode.worker_id:
            return Route(decode, None, overlap.get(decode.worker_id, 0), COLOCATED)
        overlap_blocks = overlap.get(prefill.worker_id, 0)
        reason = PREFIX_OVERLAP if overlap_blocks else LOAD
        return Route(decode, prefill, overlap_blocks, reason)

    def best_prefill(
        self,
        request_id: str,
        prompt_len: int,
        overlap: dict[str, int],
        prefills: list[WorkerInfo],
    ) -> WorkerInfo:
        """The prefill worker with the highest ``overlap_weight * cached tokens - load``
        (module docstring); also where a request goes next when its prefill worker failed
        (``prefills`` without it)."""

        def prefill_score(w: WorkerInfo) -> tuple[float, int]:
            cached = self.cached_tokens(prompt_len, overlap, w)
            load = self.pending_tokens(w) + prompt_len
            return (self.overlap_weight * cached - load, -_tiebreak(request_id, w))

        return max(prefills, key=prefill_score)

    def cached_tokens(self, prompt_len: int, overlap: dict[str, int], w: WorkerInfo) -> int:
        """Prompt tokens the index says ``w`` holds (the last token is always computed)."""
        return min(overlap.get(w.worker_id, 0) * self.block_size, max(prompt_len - 1, 0))

    def pending_tokens(self, w: WorkerInfo) -> int:
        """Tokens queued on ``w`` ahead of a new prompt. The worker's heartbeat counts every
        gateway's work but is up to an interval old; this gateway's own calls are counted
        the moment they start. The larger of the two is the estimate."""
        return max(w.num_pending_tokens, self._in_flight_tokens[w.worker_id])

    def weight_format(self, request_id: str, decodes: list[WorkerInfo]) -> str:
        """The weight format a request is served in when workers serve several (a fleet
        moving from one format to another): the least loaded decode worker's. KV never
        moves between formats, so prefill and decode workers are then chosen among that
        format's, and the prompt is hashed with its identity."""
        formats = {w.weights for w in decodes}
        if len(formats) <= 1:
            return next(iter(formats), "")
        return self.choose_decode(request_id, decodes).weights

    def choose_decode(self, request_id: str, decodes: list[WorkerInfo]) -> WorkerInfo:
        """The decode worker that continues a request elsewhere (migration): the least
        loaded, as for a new request."""
        if not decodes:
            raise UnavailableError("no decode worker is alive; retry later")
        return min(decodes, key=lambda w: self._decode_key(request_id, w))

    def _decode_key(self, request_id: str, w: WorkerInfo) -> tuple[float, ...]:
        return (
            w.num_running + self._in_flight[w.worker_id],
            -w.num_kv_blocks_free,
            _tiebreak(request_id, w),
        )


def _tiebreak(request_id: str, w: WorkerInfo) -> int:
    # Stable per request, different across requests: spreads ties evenly.
    return zlib.crc32(f"{request_id}/{w.worker_id}".encode())
