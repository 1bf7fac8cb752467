"""``mooncake-trace``: replay of the Mooncake (Kimi) conversation trace, scaled to this machine.

Format (one JSON object a line, as in AIPerf's ``mooncake_trace`` dataset type):
``timestamp`` (ms from the start), ``input_length``, ``output_length`` (tokens) and
``hash_ids``, one id per 512-token block of the prompt; equal ids in two requests are the
same block, so equal leading ids are a shared prefix.

Scaling keeps the order, the arrival pattern and the sharing intact:
- each trace block becomes ``block_tokens`` synthetic tokens, the same tokens wherever the
  same hash id appears (a last, partial block keeps its share of a block, rounded up);
- output lengths are multiplied by ``output_scale`` (at least 1) and capped at ``max_osl``;
- the clock runs ``speedup_ratio`` times faster (AIPerf's ``--synthesis-speedup-ratio``);
- rows whose scaled prompt is longer than ``max_isl`` are left out (``--synthesis-max-isl``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loadtest.arrival import trace_offsets
from loadtest.datasets.base import FIRST_PLAIN_TOKEN_ID, SampleRequest

TRACE_BLOCK_TOKENS = 512  # tokens per hash id in the recorded trace
DEFAULT_TRACE = (
    Path(__file__).resolve().parents[3]
    / "shared"
    / "data"
    / "mooncake"
    / "conversation_trace.jsonl"
)


@dataclass(frozen=True)
class TraceRow:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: Path, start: int = 0) -> Iterator[TraceRow]:
    """The rows of a trace file from row ``start`` on, in file order."""
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i < start or not line.strip():
                continue
            raw = json.loads(line)
            yield TraceRow(float(raw["timestamp"]), int(raw["input_length"]),
                           int(raw["output_length"]), tuple(raw.get("hash_ids", ())))  # fmt: skip


class BlockTokens:
    """The synthetic tokens of each trace block: a pure function of (seed, hash id)."""

    def __init__(self, block_tokens: int, vocab_size: int, seed: int) -> None:
        self.block_tokens = block_tokens
        self.vocab_size = vocab_size
        self.seed = seed
        self._cache: dict[int, tuple[int, ...]] = {}

    def __call__(self, hash_id: int) -> tuple[int, ...]:
        block = self._cache.get(hash_id)
        if block is None:
            rng = np.random.default_rng([self.seed, hash_id])
            ids = rng.integers(FIRST_PLAIN_TOKEN_ID, self.vocab_size, size=self.block_tokens)
            block = self._cache[hash_id] = tuple(int(t) for t in ids)
        return block


def scaled_prompt(row: TraceRow, blocks: BlockTokens) -> tuple[int, ...]:
    """Full blocks for every hash id but the last; the last keeps its share of a block."""
    if not row.hash_ids:
        raise ValueError("a trace row without hash_ids cannot be replayed with prefix sharing")
    full = len(row.hash_ids) - 1
    last_tokens = row.input_length - full * TRACE_BLOCK_TOKENS
    if not 0 < last_tokens <= TRACE_BLOCK_TOKENS:
        raise ValueError(
            f"input_length {row.input_length} does not fit {len(row.hash_ids)} blocks of "
            f"{TRACE_BLOCK_TOKENS} tokens"
        )
    scaled_last = max(1, math.ceil(last_tokens * blocks.block_tokens / TRACE_BLOCK_TOKENS))
    prompt: tuple[int, ...] = ()
    for hash_id in row.hash_ids[:-1]:
        prompt += blocks(hash_id)
    return prompt + blocks(row.hash_ids[-1])[:scaled_last]


def mooncake_requests(
    num_prompts: int | None,
    vocab_size: int,
    *,
    path: Path = DEFAULT_TRACE,
    start: int = 0,
    block_tokens: int = 16,
    output_scale: float = 1.0,
    max_osl: int | None = None,
    max_isl: int | None = None,
    speedup_ratio: float = 1.0,
    seed: int = 0,
) -> list[SampleRequest]:
    if block_tokens < 1:
        raise ValueError(f"trace block tokens must be >= 1, got {block_tokens}")
    if not output_scale > 0:
        raise ValueError(f"output scale must be > 0, got {output_scale}")
    if not path.is_file():
        raise FileNotFoundError(f"Mooncake trace not found: {path} (pass --dataset-path)")
    blocks = BlockTokens(block_tokens, vocab_size, seed)
    kept: list[tuple[int, TraceRow, tuple[int, ...]]] = []
    for i, row in enumerate(read_trace(path, start)):
        if num_prompts is not None and len(kept) >= num_prompts:
            break
        prompt = scaled_prompt(row, blocks)
        if max_isl is None or len(prompt) <= max_isl:
            kept.append((start + i, row, prompt))
    offsets = trace_offsets([row.timestamp_ms for _, row, _ in kept], speedup_ratio)
    requests = []
    for (index, row, prompt), offset in zip(kept, offsets, strict=True):
        output_len = max(1, round(row.output_length * output_scale))
        if max_osl is not None:
            output_len = min(output_len, max_osl)
        requests.append(SampleRequest(f"mooncake-{index}", prompt, output_len,
                                      category="trace", arrival_s=offset))  # fmt: skip
    return requests
