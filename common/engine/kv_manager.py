"""Per-request KV blocks on top of the block pool: prefix hits, slot allocation, publishing.

Lifetime contract: a request owns one reference on each of its blocks from the
``allocate_slots`` that added them until ``free`` (finish, abort, preemption) or, for a
prefill-only request, until its KV export is released. Only the engine thread calls this.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.engine.eviction import KvOps, StreamState
from common.engine.request import Request
from common.kv.block_pool import BlockPool, KVBlock


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
        max_positions: int = 1 << 62,
    ) -> None:  # fmt: skip
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.max_positions = max_positions  # the rotary table: a stream's positions stay below
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks: dict[str, list[KVBlock]] = {}
        self._num_published: dict[str, int] = {}
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def computed_prefix(self, req: Request) -> list[KVBlock]:
        """Cached blocks for the longest prefix of ``req``; the last token is never a hit."""
        if not self.enable_prefix_caching:
            return []
        req.update_block_hashes(self.block_size)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits = self.pool.longest_cached_prefix(req.block_hashes[:max_blocks])
        self.prefix_query_tokens += req.num_tokens
        self.prefix_hit_tokens += len(hits) * self.block_size
        return hits

    def can_allocate(
        self, req: Request, num_new_tokens: int, new_computed: Sequence[KVBlock] = ()
    ) -> bool:
        return self._num_needed(req, num_new_tokens, new_computed) <= self.pool.num_free - sum(
            1 for b in new_computed if b.ref_count == 0
        )

    def allocate_slots(
        self, req: Request, num_new_tokens: int, new_computed: Sequence[KVBlock] = ()
    ) -> bool:
        """Makes room for ``num_new_tokens`` after the computed ones; False if blocks ran out.

        ``new_computed`` are prefix-cache hits being attached on admission; they count as
        computed tokens ahead of the new ones.
        """
        if not self.can_allocate(req, num_new_tokens, new_computed):
            return False
        needed = self._num_needed(req, num_new_tokens, new_computed)
        self.pool.touch(new_computed)
        blocks = self._blocks.setdefault(req.request_id, [])
        blocks.extend(new_computed)
        if needed > 0:
            blocks.extend(self.pool.allocate(needed))
        self._num_published.setdefault(req.request_id, 0)
        self._num_published[req.request_id] += len(new_computed)
        return True

    def _num_needed(
        self, req: Request, num_new_tokens: int, new_computed: Sequence[KVBlock]
    ) -> int:
        held = len(self._blocks.get(req.request_id, ()))
        num_tokens = req.num_computed_tokens + len(new_computed) * self.block_size + num_new_tokens
        num_tokens -= req.num_evicted_tokens
        return self.blocks_for_tokens(num_tokens) - held - len(new_computed)

    def publish_full_blocks(self, req: Request) -> None:
        """Makes the request's full, computed blocks findable by later requests."""
        if not self.enable_prefix_caching or (req.stream is not None and req.stream.evicted):
            return  # after an eviction no block holds the dense prefix's KV
        req.update_block_hashes(self.block_size)
        blocks = self._blocks[req.request_id]
        num_full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes))
        for i in range(self._num_published[req.request_id], num_full):
            self.pool.cache(blocks[i], req.block_hashes[i])
        self._num_published[req.request_id] = max(num_full, self._num_published[req.request_id])

    def trim(self, req: Request) -> None:
        """Frees the request's blocks past what its tokens need (after a speculative verify
        whose rejected positions had blocks of their own); they were never published."""
        blocks = self._blocks.get(req.request_id)
        keep = self.blocks_for_tokens(req.num_tokens - req.num_evicted_tokens)
        if blocks is None or len(blocks) <= keep:
            return
        assert self._num_published[req.request_id] <= keep, req.request_id
        surplus = blocks[keep:]
        del blocks[keep:]
        self.pool.free(reversed(surplus))

    def evict(self, req: Request, num_new_tokens: int) -> KvOps | None:
        """StreamingLLM (eviction.py), before a step computing ``num_new_tokens``: frees the
        whole blocks between the sinks and the window, and returns the cache edits that keep
        the positions right (sinks copied and rotated on, a rebase); None when none."""
        stream = req.stream
        blocks = self._blocks.get(req.request_id)
        if stream is None or stream.policy is None or not blocks:
            return None
        S = self.block_size
        num_sink = stream.num_sink_blocks
        first_window = (num_sink + stream.num_evicted_blocks) * S
        num_out = (req.num_computed_tokens - first_window - stream.policy.window_tokens) // S
        ops = KvOps()
        private = stream.sinks_private or num_sink == 0
        if num_out > 0 and (private or self.pool.num_free + num_out >= num_sink):
            victims = blocks[num_sink : num_sink + num_out]
            del blocks[num_sink : num_sink + num_out]
            self.pool.free(reversed(victims))  # published ones stay prefix hits
            if not private:  # shared prefix blocks are never rotated: copies of our own
                old = blocks[:num_sink]
                new = self.pool.allocate(num_sink)
                ops.copies += [(a.block_id, b.block_id) for a, b in zip(old, new, strict=True)]
                blocks[:num_sink] = new
                self.pool.free(reversed(old))
                stream.sinks_private = True
            stream.num_evicted_blocks += num_out
            ops.rotate([b.block_id for b in blocks[:num_sink]], num_out * S)
        top = req.num_computed_tokens + num_new_tokens - stream.position_base
        if top > self.max_positions:  # rebase: sinks at 0, the window right after them
            delta = stream.num_evicted_blocks * S - stream.position_base
            ops.rotate([b.block_id for b in blocks], -delta)
            stream.position_base += delta
        return ops if ops else None

    def compress(self, req: Request, keep: list[int]) -> None:
        """SnapKV (compression.py): frees the request's blocks not in ``keep`` (ascending
        indices into its block list, ending with its last block); published ones stay
        prefix hits. From here the request publishes nothing."""
        blocks = self._blocks[req.request_id]
        assert keep and keep[-1] == len(blocks) - 1, (req.request_id, keep, len(blocks))
        assert req.stream is None, f"{req.request_id} compresses after an eviction"
        kept = set(keep)
        victims = [b for i, b in enumerate(blocks) if i not in kept]
        self._blocks[req.request_id] = [blocks[i] for i in keep]
        self.pool.free(reversed(victims))
        self._num_published[req.request_id] = 0  # what trim may keep counts kept blocks only
        req.stream = StreamState(None, 0, num_evicted_blocks=len(victims))

    def block_ids(self, req: Request) -> list[int]:
        return [b.block_id for b in self._blocks.get(req.request_id, ())]

    def holds(self, request_id: str) -> bool:
        return request_id in self._blocks

    def free(self, request_id: str) -> None:
        blocks = self._blocks.pop(request_id, None)
        self._num_published.pop(request_id, None)
        if blocks:
            # Last block first: a sequence's tail is evicted before its shared prefix.
            self.pool.free(reversed(blocks))

    @property
    def prefix_hit_rate(self) -> float:
        return (
            self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
        )
