"""SnapKV prompt compression (Li et al., 2024) at KV-block granularity.

What is kept. Once a request's prompt is computed, the prompt's last ``window_tokens`` (the
observation window) have attended to every earlier token. Their attention weights, summed
over the window's queries and every head, and averaged over layers, score each block of the
prompt. The request keeps at most ``budget_tokens`` of KV, in whole blocks: always the first
block (its attention sinks) and the blocks the window lies in, then the best-scored of the
rest; the others are freed. A prompt within the budget keeps everything.

Why blocks, not tokens. SnapKV keeps its own token set per layer and head. The paged cache
holds every layer and head of a token span in one block, and a block is what is freed, moved
between workers (KvHandle.kept_block_indices) and stored, so one choice of blocks serves all
layers. The scores still come from every head and layer.

Positions. Kept keys keep the rotation of the position they were computed at, and generated
tokens continue at the prompt's true length, as SnapKV does: a query and a kept key are as
far apart as in the text. The kept blocks are the request's block list in order, and the
last prompt block is always kept, so every evicted block lies before the tokens still to be
written: the StreamState of eviction.py (evicted blocks, no rebase) places them, and the
attention backends, the runner and the KV manager need nothing else.

Identity. The kept blocks are dense KV, but the request's KV as a whole is not the dense
prefix's, so from compression on it publishes nothing (prefix cache, index, block store),
as an evicted stream does. A preempted request recomputes its prompt and compresses again.

Cost. Scoring reads the prompt's keys once per layer against the window's queries: for a
4096-token prompt, 30 layers, 9 heads and a 32-token window about 2 GFLOP, next to the
prompt's prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.contract.eviction import DEFAULT_SNAPKV_WINDOW, KV_COMPRESSIONS, SNAPKV, KvCompression

__all__ = [
    "DEFAULT_SNAPKV_WINDOW",
    "KV_COMPRESSIONS",
    "SNAPKV",
    "KvCompression",
    "QueryTap",
    "SnapState",
    "block_scores",
    "select_blocks",
]


@dataclass
class SnapState:
    """One request's compression: the window's queries as they are computed, per layer."""

    policy: KvCompression
    prompt_len: int  # the window ends here
    queries: list[list[torch.Tensor]] = field(default_factory=list)  # [layer][chunk] [w, Hq, D]
    positions: list[int] = field(default_factory=list)  # of the captured queries
    done: bool = False
    kept_blocks: list[int] | None = None  # prompt block indices kept; None: all

    @property
    def window_start(self) -> int:
        return max(0, self.prompt_len - self.policy.window_tokens)

    def reset(self) -> None:
        """After a preemption dropped the KV: capture and compress afresh."""
        self.queries, self.positions, self.done, self.kept_blocks = [], [], False, None


class QueryTap:
    """Copies of chosen rows of each layer's queries (after rotary) in one forward pass;
    the runner sets it on the model's attention layers for the step and takes it off."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows  # [n] int64 row indices into the step's tokens
        self.per_layer: list[torch.Tensor] = []

    def record(self, q: torch.Tensor) -> None:  # q [T, Hq, D]
        self.per_layer.append(q.index_select(0, self.rows).float())


def block_scores(
    queries: list[torch.Tensor],  # per layer [W, Hq, D] float32
    query_positions: torch.Tensor,  # [W] int64
    keys: list[torch.Tensor],  # per layer [P, Hkv, D] (P = prompt tokens)
    block_size: int,
    scale: float,
) -> torch.Tensor:  # [ceil(P / S)] float32
    """Each block's share of the window's attention, averaged over layers: per layer the
    softmax over keys (causal: a query sees keys up to its position) summed over queries
    and heads, divided by their count, summed per block."""
    num_tokens = keys[0].shape[0]
    num_blocks = -(-num_tokens // block_size)
    total = torch.zeros(num_blocks * block_size, dtype=torch.float32)
    key_positions = torch.arange(num_tokens)
    masked = key_positions[None, :] > query_positions[:, None]  # [W, P]
    for q, k in zip(queries, keys, strict=True):
        W, Hq, D = q.shape
        Hkv = k.shape[1]
        group = q.view(W, Hkv, Hq // Hkv, D).permute(1, 2, 0, 3)  # [Hkv, G, W, D]
        logits = torch.matmul(group, k.float().permute(1, 2, 0)[:, None]) * scale  # [Hkv,G,W,P]
        logits.masked_fill_(masked, float("-inf"))
        weights = torch.softmax(logits, dim=-1).sum(dim=(0, 1, 2)) / (W * Hq)  # [P]
        total[:num_tokens] += weights
    return total.view(num_blocks, block_size).sum(dim=1) / len(queries)


def select_blocks(
    scores: torch.Tensor, policy: KvCompression, prompt_len: int, block_size: int
) -> list[int] | None:
    """The prompt blocks to keep, ascending: the first, those the window lies in, then the
    best scored (ties: the earlier block) up to the budget; None when all fit."""
    num_blocks = -(-prompt_len // block_size)
    budget = policy.budget_blocks(block_size)
    if num_blocks <= budget:
        return None
    first_window = max(0, prompt_len - policy.window_tokens) // block_size
    keep = {0, *range(first_window, num_blocks)}
    if len(keep) >= budget:  # the check (KvCompression.check) leaves room; short budgets
        return sorted(keep)
    candidates = [b for b in range(num_blocks) if b not in keep]
    ranked = sorted(candidates, key=lambda b: (-float(scores[b]), b))
    keep.update(ranked[: budget - len(keep)])
    return sorted(keep)
