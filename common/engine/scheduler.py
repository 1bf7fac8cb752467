"""Iteration-level scheduler: continuous batching with chunked prefill under a token budget.

Each step: running requests first (decodes and unfinished prefill chunks, oldest first),
then waiting requests in arrival order while the token budget, the sequence limit and the
KV pool allow. When a running request cannot get a block, the newest running request is
preempted (its blocks freed, its tokens kept) and later recomputed, using the prefix cache.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from common.engine.eviction import KvOps
from common.engine.kv_manager import KVCacheManager
from common.engine.request import FinishReason, Request, RequestStatus
from common.errors import QueueFullError


@dataclass
class ScheduledRequest:
    request: Request
    # The model computes token_ids[num_computed:] (this many, drafts included) and then the
    # drafts: a speculative verify is the request's last token and len(draft_token_ids)
    # proposed ones, with logits at every row.
    num_new_tokens: int
    import_block_ids: list[int] = field(default_factory=list)  # blocks to fill from kv_import
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def prompt_logprob_positions(self) -> range:
        """Positions of this chunk whose logits score prompt tokens (prompt_logprobs)."""
        return self.request.prompt_logprob_positions(
            self.request.num_computed_tokens, self.num_new_tokens
        )

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so a token is sampled."""
        req = self.request
        return req.num_computed_tokens + self.num_new_tokens - len(self.draft_token_ids) == (
            req.num_tokens
        )


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[Request]
    # Requests the scheduler ended itself (e.g. alone and still out of KV blocks).
    finished: list[Request]
    # Cache edits of StreamingLLM evictions, to make before the forward pass.
    kv_ops: KvOps | None = None

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_waiting: int,
        propose: Callable[[Request, int], list[int]] | None = None,
    ) -> None:
        """``propose(request, at_most)``: a decoding request's speculative guesses for this
        step (none: no speculation)."""
        self.kv = kv
        self.propose = propose
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_waiting = max_waiting
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        if len(self.waiting) >= self.max_waiting:
            raise QueueFullError(
                f"the waiting queue is full ({self.max_waiting} requests); retry later"
            )
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Takes a request out of whichever queue holds it (abort or finish)."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def pending_tokens(self) -> int:
        """Tokens still to compute for the queued and running requests (a waiting request
        counts in full: its cache hit is only known once it is admitted)."""
        return sum(r.num_tokens - r.num_computed_tokens for r in (*self.waiting, *self.running))

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        finished: list[Request] = []
        kv_ops = KvOps()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget,
                          _chunk_cap(req, req.num_computed_tokens))  # fmt: skip
            draft: list[int] = []
            if self.propose is not None and req.num_tokens - req.num_computed_tokens == 1:
                draft = self.propose(req, budget - 1) if budget > 1 else []
                # Short of blocks for the guesses: verify nothing rather than preempt.
                if draft and not self.kv.can_allocate(req, 1 + len(draft)):
                    draft = []
                num_new += len(draft)
            ops = self.kv.evict(req, num_new)
            if ops is not None:
                kv_ops.extend(ops)
            while not self.kv.allocate_slots(req, num_new):
                victim = self.running.pop()
                if victim is req and not self.running:
                    # Alone and still short of blocks: it can never grow further.
                    self._finish_out_of_blocks(req)
                    finished.append(req)
                    break
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break
            scheduled.append(ScheduledRequest(req, num_new, draft_token_ids=draft))
            budget -= num_new
            i += 1

        while (
            not preempted and self.waiting and len(self.running) < self.max_num_seqs and budget > 0
        ):
            req = self.waiting[0]
            item = self._admit(req, budget)
            if item is None:
                break
            self.waiting.popleft()
            self.running.append(req)
            scheduled.append(item)
            budget -= item.num_new_tokens
        return SchedulerOutput(scheduled, preempted, finished, kv_ops if kv_ops else None)

    def _admit(self, req: Request, budget: int) -> ScheduledRequest | None:
        assert req.num_computed_tokens == 0, f"{req.request_id} waits with computed tokens"
        if req.kv_import is not None:
            num_imported = req.kv_import.num_tokens
            num_new = min(req.num_tokens - num_imported, budget, _chunk_cap(req, num_imported))
            if not self.kv.allocate_slots(req, num_imported + num_new):
                return None
            kept = num_imported - req.num_evicted_tokens  # a compressed import: fewer blocks
            block_ids = self.kv.block_ids(req)[: self.kv.blocks_for_tokens(kept)]
            req.num_computed_tokens = num_imported
            req.status = RequestStatus.RUNNING
            return ScheduledRequest(req, num_new, import_block_ids=block_ids)
        # Prompt logprobs come from the logits of every prompt position: none may be skipped
        # (as vLLM, such a request recomputes its prefix; its blocks are still published).
        hits = [] if req.needs_prompt_logprobs else self.kv.computed_prefix(req)
        if req.snap is not None and not req.snap.done:  # its window is computed here
            hits = hits[: req.snap.window_start // self.kv.block_size]
        num_hit_tokens = len(hits) * self.kv.block_size
        num_new = min(req.num_tokens - num_hit_tokens, budget, _chunk_cap(req, num_hit_tokens))
        if not self.kv.allocate_slots(req, num_new, hits):
            return None
        req.num_computed_tokens = num_hit_tokens
        if req.num_preemptions == 0:
            req.num_cached_tokens = min(num_hit_tokens, req.num_prompt_tokens)
            req.num_context_cached_tokens = num_hit_tokens
        req.status = RequestStatus.RUNNING
        return ScheduledRequest(req, num_new)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.kv_import = None  # its blocks are gone; recompute from tokens
        req.reset_stream()  # and a stream evicts afresh as it recomputes
        self.waiting.appendleft(req)

    def _finish_out_of_blocks(self, req: Request) -> None:
        self.kv.free(req.request_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason = FinishReason.LENGTH


def _chunk_cap(req: Request, start: int) -> int:
    """A stream computes at most a window per step (eviction.py), so what attention sees
    and the positions it needs stay bounded however long its prompt; a chunk starting at
    ``start`` ends where a SnapKV prompt compresses (compression.py), so the compression
    comes before anything past it is computed."""
    cap = req.eviction.window_tokens if req.eviction is not None else 1 << 62
    snap = req.snap
    if snap is not None and not snap.done and start < snap.prompt_len:
        cap = min(cap, snap.prompt_len - start)
    return cap
