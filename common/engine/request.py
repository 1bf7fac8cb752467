"""A request's life inside one engine: tokens, progress, blocks' hashes, status."""

from __future__ import annotations

import enum
import logging
import random
import time
from dataclasses import dataclass, field

import torch

from common.contract.sampling import SamplingParams
from common.engine.compression import KvCompression, SnapState
from common.engine.eviction import KvEviction, StreamState
from common.engine.grammar import GrammarState
from common.engine.speculative.policy import Acceptance
from common.kv.hashing import BlockHash, extra_keys_for, hash_block, root_hash

log = logging.getLogger(__name__)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # eos, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the caller
    PREFILLED = "prefilled"  # prefill-only: first token sampled, KV held for export


@dataclass
class KvImport:
    """Prompt KV arriving from another engine, in the wire layout (see common/kv/layout.py).

    ``data`` is ``[n, L, 2, S, Hkv, D]`` for the ``n = ceil(num_tokens / S)`` blocks that
    cover the first ``num_tokens`` tokens of the request, or for a SnapKV-compressed prompt
    (compression.py) the blocks ``kept_blocks`` of those, in that order.
    """

    num_tokens: int
    data: torch.Tensor
    kept_blocks: list[int] | None = None


@dataclass
class FullBlocks:
    """Copies of full KV blocks with their hashes, in the wire layout.

    ``data`` is ``[n, L, 2, S, Hkv, D]`` with ``n = len(block_hashes)``.
    """

    block_hashes: list[BlockHash]
    data: torch.Tensor

    @staticmethod
    def join(parts: list[FullBlocks]) -> FullBlocks | None:
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        hashes = [h for part in parts for h in part.block_hashes]
        return FullBlocks(hashes, torch.cat([part.data for part in parts]))


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        *,
        eos_token_ids: tuple[int, ...] = (),
        cache_salt: str | None = None,
        prefill_only: bool = False,
        output_token_ids: list[int] | None = None,
        kv_import: KvImport | None = None,
        hash_seed: str = "",
        write_behind: bool = False,
        weight_identity: str | None = None,
        keep_prompt_rows: bool = False,
        grammar: GrammarState | None = None,
        eviction: KvEviction | None = None,
        block_size: int = 16,
        compression: KvCompression | None = None,
        compress_at: int | None = None,
    ) -> None:
        """``compression``: SnapKV once the first ``compress_at`` tokens (default: the
        prompt) are computed; a ``kv_import`` with ``kept_blocks`` arrives compressed."""
        self.request_id = request_id
        self.sampling = sampling
        self.seed = sampling.seed if sampling.seed is not None else random.getrandbits(63)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids = list(prompt_token_ids) + list(output_token_ids or [])
        self.stop_ids = frozenset(sampling.stop_token_ids) | (
            frozenset() if sampling.ignore_eos else frozenset(eos_token_ids)
        )
        self.cache_salt = cache_salt
        self.prefill_only = prefill_only
        self.kv_import = kv_import
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        # Context tokens (prompt and output tokens it came with) served from the prefix
        # cache: more than the prompt's for a continuation (a migration, a resume).
        self.num_context_cached_tokens = 0
        self.num_preemptions = 0
        self.logprobs: list[TokenLogprob] = []
        # sampling.prompt_logprobs: entry i scores prompt token i (None for token 0), grown
        # as prefill chunks run; handed out once, with the first output. keep_prompt_rows
        # (in-process scoring) also keeps the full log-softmax rows, [m, V] per chunk.
        wants = sampling.prompt_logprobs is not None
        self.prompt_logprobs: list[TokenLogprob | None] | None = [None] if wants else None
        self.prompt_logprob_rows: list[torch.Tensor] | None = (
            [] if wants and keep_prompt_rows else None
        )
        self.prompt_logprobs_sent = False
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        # The chain of full-block hashes over token_ids, grown as tokens arrive.
        self.block_hashes: list[BlockHash] = []
        # Write-behind: copies of the full blocks this engine computed, kept until the next
        # output hands them on (towards the block store). Blocks below num_written_blocks
        # were copied already, or came from elsewhere (imported, prefix-cache hits).
        self.write_behind = write_behind
        self.num_written_blocks = 0
        self.pending_writes: list[FullBlocks] = []
        # The speculative proposer's own state for this request (common/engine/speculative/
        # proposer.py), built from verified tokens only.
        self.proposer_state: object = None
        self.spec_acceptance: Acceptance | None = None  # its guesses' kept rate (policy.py)
        self.num_spec_rounds = 0  # verify steps, proposals verified, proposals kept
        self.num_spec_proposed = 0
        self.num_spec_accepted = 0
        # Structured output: the matcher, advanced over every verified output token.
        self.grammar = grammar
        self._hash_extra = extra_keys_for(cache_salt, weight_identity)
        self._hash_parent = root_hash(hash_seed)
        # StreamingLLM eviction (eviction.py): None keeps every token's KV.
        self.eviction = eviction
        self.stream: StreamState | None = None
        self.block_size = block_size
        # SnapKV (compression.py): the window's queries until the prompt is compressed.
        self.snap: SnapState | None = None
        if compression is not None:
            self.snap = SnapState(compression, compress_at or self.num_prompt_tokens)
        self.reset_stream()
        if kv_import is not None and kv_import.kept_blocks is not None:
            num_blocks = -(-kv_import.num_tokens // block_size)
            evicted = num_blocks - len(kv_import.kept_blocks)
            self.stream = StreamState(None, 0, num_evicted_blocks=evicted)
            if self.snap is not None:
                self.snap.done = True  # its producer compressed it
                self.snap.kept_blocks = list(kv_import.kept_blocks)

    def reset_stream(self) -> None:
        """A fresh eviction state (at start, and when a preemption drops the KV: the tokens
        are recomputed whole, and a SnapKV prompt compresses again)."""
        self.stream = None
        if self.eviction is not None:
            self.stream = StreamState(self.eviction, self.eviction.sink_blocks(self.block_size))
        if self.snap is not None:
            self.snap.reset()

    @property
    def num_evicted_tokens(self) -> int:
        """Tokens whose KV was evicted: kept KV covers ``num_computed_tokens`` less these."""
        return 0 if self.stream is None else self.stream.num_evicted_blocks * self.block_size

    @property
    def position_base(self) -> int:
        return 0 if self.stream is None else self.stream.position_base

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt tokens are still to be scored: every position up to the last prompt
        token must then be computed here (no prefix-cache hit may skip one)."""
        return (
            self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens
        )

    def prompt_logprob_positions(self, start: int, num_new: int) -> range:
        """The positions of ``[start, start + num_new)`` whose logits score a prompt token
        not scored yet (position p scores token p + 1); empty for most requests."""
        if self.prompt_logprobs is None:
            return range(0)
        first = max(start, len(self.prompt_logprobs) - 1)
        end = min(start + num_new, self.num_prompt_tokens - 1)
        return range(first, max(first, end))

    def update_block_hashes(self, block_size: int) -> None:
        num_full = len(self.token_ids) // block_size
        for i in range(len(self.block_hashes), num_full):
            parent = self.block_hashes[-1] if self.block_hashes else self._hash_parent
            tokens = self.token_ids[i * block_size : (i + 1) * block_size]
            self.block_hashes.append(hash_block(parent, tokens, self._hash_extra))

    def append_token(self, token_id: int, max_model_len: int) -> bool:
        """Adds a sampled token; returns True if it finishes the request."""
        self.token_ids.append(token_id)
        if self.grammar is not None and not self.grammar.advance(token_id):
            # The sampler masks every token the constraint refuses: a bug if it comes here.
            log.error("request %s: token %d breaks its %s: %s", self.request_id, token_id,
                      self.grammar.constraint.kind.value, self.grammar.error)  # fmt: skip
        if token_id in self.stop_ids:
            self.finish_reason = FinishReason.STOP
        elif self.grammar is not None and self.grammar.done:
            self.finish_reason = FinishReason.STOP  # the constraint is complete
        elif self.num_output_tokens >= self.sampling.max_tokens or (
            self.num_tokens >= max_model_len and self.eviction is None  # a stream goes on
        ):
            self.finish_reason = FinishReason.LENGTH
        return self.finish_reason is not None
