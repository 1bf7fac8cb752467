"""SnapKV prompt compression (Li et al., 2024) at KV-block granularity.

What is kept. Once a request's prompt is computed, the prompt's last ``window_tokens`` (the
observation window) have attended to every earlier token. The request keeps at most
``budget_tokens`` of KV, in whole blocks: always the first block (its attention sinks) and
the blocks the window lies in, then the best-scored of the rest; the others are freed. A
prompt within the budget keeps everything. A block's score is the window's attention to it,
per layer and head, among the blocks left to choose (renormalized per head, so the heads
that look far back count as much as those that look at the sink and the recent tokens),
averaged over layers and heads (block_scores).

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
    "fixed_blocks",
    "head_block_attention",
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


def head_block_attention(
    queries: list[torch.Tensor],  # per layer [W, Hq, D] float32
    query_positions: torch.Tensor,  # [W] int64
    keys: list[torch.Tensor],  # per layer [P, Hkv, D] (P = prompt tokens)
    block_size: int,
    scale: float,
) -> torch.Tensor:  # [L, Hq, ceil(P / S)] float32
    """Each layer's and head's window attention per block: the softmax over keys (causal:
    a query sees keys up to its position), averaged over the window's queries and summed
    per block (each row sums to one)."""
    num_tokens = keys[0].shape[0]
    num_blocks = -(-num_tokens // block_size)
    masked = torch.arange(num_tokens)[None, :] > query_positions[:, None]  # [W, P]
    out = []
    for q, k in zip(queries, keys, strict=True):
        W, Hq, D = q.shape
        Hkv = k.shape[1]
        group = q.view(W, Hkv, Hq // Hkv, D).permute(1, 2, 0, 3)  # [Hkv, G, W, D]
        logits = torch.matmul(group, k.float().permute(1, 2, 0)[:, None]) * scale  # [Hkv,G,W,P]
        logits.masked_fill_(masked, float("-inf"))
        per_token = torch.softmax(logits, dim=-1).mean(dim=2).reshape(Hq, num_tokens)
        padded = torch.zeros(Hq, num_blocks * block_size)
        padded[:, :num_tokens] = per_token
        out.append(padded.view(Hq, num_blocks, block_size).sum(dim=2))
    return torch.stack(out)


def block_scores(attention: torch.Tensor, fixed: list[int]) -> torch.Tensor:  # [nb]
    """What the blocks left to choose are worth: each head's attention over them (the
    ``fixed`` blocks, kept anyway, left out) renormalized to one, averaged over layers and
    heads. Most heads put nearly all their weight on the sink and the recent tokens; without
    renormalizing, the few heads that look far back (the ones that retrieve) would barely
    move the sum."""
    mass = attention.flatten(0, -2).clone()  # [L * Hq, nb]
    mass[:, fixed] = 0.0
    mass /= mass.sum(dim=1, keepdim=True).clamp_min(1e-30)
    return mass.mean(dim=0)


def fixed_blocks(policy: KvCompression, prompt_len: int, block_size: int) -> list[int]:
    """The blocks always kept: the first and those the window lies in."""
    num_blocks = -(-prompt_len // block_size)
    first_window = max(0, prompt_len - policy.window_tokens) // block_size
    return sorted({0, *range(first_window, num_blocks)})


def select_blocks(
    attention: torch.Tensor, policy: KvCompression, prompt_len: int, block_size: int
) -> list[int] | None:
    """The prompt blocks to keep, ascending: the fixed ones, then the best scored
    (block_scores; ties: the earlier block) up to the budget; None when all fit.
    ``attention``: head_block_attention's [L, Hq, nb]."""
    num_blocks = -(-prompt_len // block_size)
    budget = policy.budget_blocks(block_size)
    if num_blocks <= budget:
        return None
    fixed = fixed_blocks(policy, prompt_len, block_size)
    keep = set(fixed)
    if len(keep) >= budget:  # the check (KvCompression.check) leaves room; short budgets
        return fixed
    scores = block_scores(attention, fixed)
    candidates = [b for b in range(num_blocks) if b not in keep]
    ranked = sorted(candidates, key=lambda b: (-float(scores[b]), b))
    keep.update(ranked[: budget - len(keep)])
    return sorted(keep)
