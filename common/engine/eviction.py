"""StreamingLLM eviction (Xiao et al., 2023): a stream keeps its first tokens (attention
sinks) and a window of its latest tokens, so it runs without bound in a fixed number of KV
blocks.

What is kept. The first ``sink_tokens`` rounded up to whole blocks, and at least
``window_tokens`` of the latest computed tokens: before each step, every whole block between
the sinks and the window is freed (block-granular, like the cache itself), so a stream holds
at most sinks + window + one block + the step's chunk. The kept blocks are the request's
block list in order (sinks, then the window), so attention reads them as one contiguous
sequence of ``num_computed_tokens - evicted * block_size`` tokens; token ``p`` of the window
lies in kept block ``p // block_size - evicted``.

Positions. Keys keep the rotation of the position they were written at, so a query and a
window key are as far apart as in the text. The sinks are moved instead: StreamingLLM puts
them just before the window, so each time ``k`` blocks are evicted the sink keys are
rotated ``k * block_size`` positions on (RoPE rotations compose, so this is exact up to one
float32 rounding per eviction). Positions given to the model are ``position - base``; when
they would pass the model's rotary table, ``base`` is moved up to the evicted span and every
kept key rotated back by as much, so the sinks sit at 0 and the window right after them, as
StreamingLLM's cache positions, and positions stay inside the table however long the stream
runs.

Identity. Sink blocks may be shared prefix-cache blocks: at the first eviction a stream
copies them into blocks of its own before rotating them. KV computed after an eviction is
not the dense prefix's KV, so from then on the stream publishes no block to the prefix
cache, the prefix index or the block store (kv_manager.py, engine.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.contract.eviction import KV_EVICTIONS, STREAMING, KvEviction

__all__ = ["KV_EVICTIONS", "STREAMING", "KvEviction", "KvOps", "StreamState"]


@dataclass
class StreamState:
    """One request's eviction so far (policy None: a SnapKV prompt's, which drops blocks
    once, at compression, and never again; compression.py)."""

    policy: KvEviction | None
    num_sink_blocks: int
    num_evicted_blocks: int = 0
    position_base: int = 0  # the model sees position - base
    sinks_private: bool = False  # the sink blocks are copies of this request's own

    @property
    def evicted(self) -> bool:
        return self.num_evicted_blocks > 0


@dataclass
class KvOps:
    """Cache edits to make before a step's forward pass, in this order."""

    copies: list[tuple[int, int]] = field(default_factory=list)  # (from block, to block)
    rotations: dict[int, int] = field(default_factory=dict)  # block -> positions to rotate by

    def rotate(self, block_ids: list[int], delta: int) -> None:
        for block_id in block_ids:
            self.rotations[block_id] = self.rotations.get(block_id, 0) + delta

    def extend(self, other: KvOps) -> None:
        self.copies += other.copies
        for block_id, delta in other.rotations.items():
            self.rotations[block_id] = self.rotations.get(block_id, 0) + delta

    def __bool__(self) -> bool:
        return bool(self.copies) or any(self.rotations.values())
