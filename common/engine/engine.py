"""Engine: the token-level core every worker wraps (scheduler -> KV manager -> model runner).

One thread owns an Engine: ``add_request``/``abort``/``step`` are not thread-safe (see
common/engine/engine_loop.py for the threaded driver the services use). Text, chat
templates and stop strings live a layer above (common/engine/llm.py, the gateway).

The prefill/decode split:
- ``add_request(..., prefill_only=True)`` runs prefill, samples the first token, and then
  holds the prompt's blocks; ``export_kv`` returns them in the wire layout and
  ``release`` drops them.
- ``add_request(..., output_token_ids=[first], kv_import=KvImport(...))`` admits a request
  whose prompt KV came from elsewhere; it continues exactly as if prefilled here.
- Resuming a request elsewhere (migration) is the same call with every token generated so
  far as ``output_token_ids`` and whatever full blocks of them were found as ``kv_import``:
  max_tokens, penalties and the seeded sampler's positions count those tokens as output.
- ``add_request(..., write_behind=True)``: each output also carries copies of the full
  blocks this engine computed for the request since the previous output
  (``RequestOutput.full_blocks``), for the caller to write to a shared store.

Prompt logprobs (``SamplingParams.prompt_logprobs``): the runner scores every prompt
position of such a request as its prefill chunks run (a prefix-cache hit or a ``kv_import``
would skip positions, so neither is used for it); the first output carries them
(``RequestOutput.prompt_logprobs``), and, with ``add_request(..., keep_prompt_rows=True)``,
the full log-softmax rows too (``prompt_logprob_rows``, what ``LLM.score`` returns).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from common.contract.model_spec import ModelSpec, load_spec
from common.contract.sampling import SamplingParams
from common.engine.compression import KvCompression, SnapState, select_blocks
from common.engine.config import EngineConfig
from common.engine.eviction import KvEviction
from common.engine.grammar import GrammarCompiler, GrammarState, StepMasks
from common.engine.kv_manager import KVCacheManager
from common.engine.model_runner import ModelRunner
from common.engine.request import (
    FinishReason,
    FullBlocks,
    KvImport,
    Request,
    RequestStatus,
    TokenLogprob,
)
from common.engine.sampler import Sampler, prompt_logprob_entries
from common.engine.scheduler import ScheduledRequest, Scheduler
from common.engine.speculative.policy import Acceptance, StepCost, allocate
from common.engine.speculative.proposer import proposer_for
from common.engine.speculative.stats import SpecDecodeStats
from common.engine.speculative.verify import VerifyRow, accepted
from common.errors import AlreadyExistsError, InvalidRequestError, NotFoundError
from common.experts.counts import ExpertCounts
from common.kv.hashing import BlockHash, hash_prompt_blocks
from common.openmp import OMP_POLICY_UNSET

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_context_cached_tokens: int = 0  # num_cached_tokens, output tokens it came with too
    first_scheduled_time: float | None = None  # time.monotonic() of the first step it ran in
    # write_behind requests: copies of full blocks computed since the previous output.
    full_blocks: FullBlocks | None = None
    # With sampling.prompt_logprobs, on the first output only: entry i scores prompt
    # token i (entry 0, for the first token, is None).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # keep_prompt_rows requests, first output only: [P-1, V] float32 log-softmax rows, row i
    # the distribution of prompt token i + 1 given tokens 0..i.
    prompt_logprob_rows: torch.Tensor | None = None
    # Speculation on this request so far: (verify rounds, proposals verified, kept).
    spec: tuple[int, int, int] = (0, 0, 0)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class KvExport:
    """A prefill-only request's prompt KV, ready to ship (see common/kv/layout.py)."""

    request_id: str
    num_tokens: int
    block_hashes: list[BlockHash]  # full blocks only
    data: torch.Tensor  # [n, L, 2, S, Hkv, D], n = ceil(num_tokens / S)
    # SnapKV (compression.py): the prompt blocks kept, ascending; data holds only these.
    kept_blocks: list[int] | None = None


@dataclass
class EngineStats:
    num_kv_blocks_total: int
    num_kv_blocks_free: int
    num_running: int
    num_waiting: int
    num_held: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_pending_tokens: int = 0  # tokens still to compute, queued or running
    # SnapKV (compression.py): prompts compressed, and their blocks kept and dropped.
    num_compressed: int = 0
    num_compressed_kept_blocks: int = 0
    num_compressed_dropped_blocks: int = 0


class Engine:
    def __init__(self, config: EngineConfig, spec: ModelSpec | None = None) -> None:
        self.config = config
        self.spec = spec or load_spec(config.model)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        if OMP_POLICY_UNSET and torch.get_num_threads() > 1:
            log.warning(
                "torch was imported before the engine with OMP_WAIT_POLICY unset: its OpenMP "
                "threads spin between parallel regions and slow the engine's kernels; set "
                "OMP_WAIT_POLICY=PASSIVE before starting Python (common/openmp.py)"
            )
        start = time.monotonic()
        self.runner = ModelRunner(config, self.spec)
        self.block_size = config.block_size
        capacity = self.runner.num_blocks * self.block_size
        self.max_model_len = min(
            config.max_model_len or self.spec.max_position_embeddings,
            self.spec.max_position_embeddings,
            capacity,
        )
        self.kv = KVCacheManager(
            self.runner.num_blocks, self.block_size, config.enable_prefix_caching,
            max_positions=self.spec.max_position_embeddings,
        )  # fmt: skip
        self.default_eviction = config.eviction  # StreamingLLM for every request, or None
        if self.default_eviction is not None:
            self.check_eviction(self.default_eviction)
        self.default_compression = config.compression  # SnapKV for every prompt, or None
        if self.default_compression is not None:
            self.check_compression(self.default_compression, self.default_eviction)
        self.num_compressed = 0  # prompts compressed, and their blocks kept and dropped
        self.num_compressed_kept_blocks = 0
        self.num_compressed_dropped_blocks = 0
        self.speculative = config.speculative
        self.proposer = (
            proposer_for(self.speculative, config, self.spec.vocab_size)
            if self.speculative
            else None
        )
        self._proposals: dict[str, list[int]] = {}  # this step's guesses, by request
        self.spec_stats = SpecDecodeStats()
        self.step_cost = StepCost()  # decode steps' milliseconds by rows (speculative policy)
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens, config.max_waiting,
            propose=self._propose if self.proposer is not None else None,
        )  # fmt: skip
        self.sampler = Sampler(self.spec.vocab_size)
        eos = self.spec.eos_token_ids
        self.grammars = GrammarCompiler(config.model, self.spec.vocab_size, eos[0] if eos else None)
        self.grammar_masks = StepMasks(self.grammars.stats, self.spec.vocab_size)
        self.requests: dict[str, Request] = {}
        self.held: dict[str, Request] = {}
        self.num_preemptions = 0
        log.info(
            "engine ready in %.1fs: %s, %d KV blocks (%d tokens), max_model_len %d, %d CPU threads",
            time.monotonic() - start,
            self.spec.architecture,
            self.runner.num_blocks,
            capacity,
            self.max_model_len,
            torch.get_num_threads(),
        )

    @property
    def weight_identity(self) -> str | None:
        """The weight format's KV identity (None for float weights): part of every block
        hash this engine computes, so KV of another format never matches."""
        return self.runner.weight_format.identity

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        *,
        cache_salt: str | None = None,
        prefill_only: bool = False,
        output_token_ids: list[int] | None = None,
        kv_import: KvImport | None = None,
        write_behind: bool = False,
        keep_prompt_rows: bool = False,
        grammar: GrammarState | None = None,
        eviction: KvEviction | None = None,
        compression: KvCompression | None = None,
        compress_at: int | None = None,
    ) -> Request:
        """``grammar``: the request's matcher when the caller compiled it already
        (``self.grammars.compile``, on a thread of its own); else it compiles here.
        ``eviction``: StreamingLLM for this request (default: the engine's, if any); a
        prefill-only request never evicts (its KV is exported whole).
        ``compression``: SnapKV for this request (default: the request's, then the
        engine's); ``compress_at`` compresses after that many tokens instead of the prompt
        (scoring text past it against the compressed KV, as loadtest/bench_snapkv.py does)."""
        if request_id in self.requests or request_id in self.held:
            raise AlreadyExistsError(f"request {request_id!r} is already in flight here")
        eviction = eviction or sampling.kv_eviction or self.default_eviction
        if eviction is not None:
            self.check_eviction(eviction)
        self.validate(prompt_token_ids, sampling, len(output_token_ids or ()), eviction,
                      prefill_only)  # fmt: skip
        if prefill_only:
            eviction = None  # its KV is exported whole: the prompt fits the context
        compression = compression or sampling.kv_compression or self.default_compression
        if kv_import is not None and kv_import.kept_blocks is not None:
            compression = compression or sampling.kv_compression  # compressed already
        if compression is not None:
            self.check_compression(compression, eviction)
        if compress_at is not None and not 0 < compress_at <= len(prompt_token_ids):
            raise InvalidRequestError("compress_at", f"{compress_at} is outside the prompt")
        if sampling.structured_output is not None:
            if grammar is None:
                grammar = self.grammars.compile(sampling.structured_output)
            grammar.replay(output_token_ids or [])
        if sampling.prompt_logprobs is not None:
            kv_import = None  # every prompt position is computed here, as for prefix hits
        if kv_import is not None:
            self._check_import(kv_import, len(prompt_token_ids) + len(output_token_ids or ()))
        if compression is not None and kv_import is not None and kv_import.kept_blocks is None:
            # Dense KV from elsewhere covers at most what precedes the window: the window's
            # queries are computed here, all of them (as for prefix-cache hits).
            end = compress_at or len(prompt_token_ids)
            n = max(0, end - compression.window_tokens) // self.block_size
            if n * self.block_size < kv_import.num_tokens:
                kv_import = KvImport(n * self.block_size, kv_import.data[:n]) if n else None
        req = Request(
            request_id,
            prompt_token_ids,
            sampling,
            eos_token_ids=self.spec.eos_token_ids,
            cache_salt=cache_salt,
            prefill_only=prefill_only,
            output_token_ids=output_token_ids,
            kv_import=kv_import,
            hash_seed=self.config.hash_seed,
            write_behind=write_behind and not prefill_only,
            weight_identity=self.weight_identity,
            keep_prompt_rows=keep_prompt_rows,
            grammar=grammar,
            eviction=eviction,
            block_size=self.block_size,
            compression=compression,
            compress_at=compress_at,
        )
        self.scheduler.add(req)
        self.requests[request_id] = req
        return req

    def check_eviction(self, eviction: KvEviction) -> None:
        eviction.check(self.block_size, self.spec.max_position_embeddings)
        if self.runner.kv_quantized:
            raise InvalidRequestError(
                "kv_eviction", "StreamingLLM eviction needs a float KV cache (kv_dtype auto)"
            )
        if self.spec.sliding_window:
            raise InvalidRequestError(
                "kv_eviction", "this model attends through a sliding window of its own"
            )

    def check_compression(
        self, compression: KvCompression, eviction: KvEviction | None = None
    ) -> None:
        compression.check(self.block_size)
        if eviction is not None:
            raise InvalidRequestError(
                "sampling.kv_compression", "SnapKV does not combine with StreamingLLM eviction"
            )
        if self.spec.sliding_window:
            raise InvalidRequestError(
                "sampling.kv_compression", "this model attends through a sliding window of its own"
            )

    def validate(
        self, prompt: list[int], sampling: SamplingParams, num_generated: int = 0,
        eviction: KvEviction | None = None, prefill_only: bool = False,
    ) -> None:  # fmt: skip
        """A stream (``eviction``) is bounded by its window, not by the context: its output
        may run past it, and so may its prompt unless it is prefilled here for export."""
        if not prompt:
            raise InvalidRequestError("prompt", "the prompt is empty")
        vocab = self.spec.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError("token_ids", f"token id {bad} is outside [0, {vocab})")
        sampling.check_vocab(vocab)
        if eviction is not None and not prefill_only:
            return
        if len(prompt) + num_generated >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"the prompt has {len(prompt)} tokens; this model serves at most "
                f"{self.max_model_len} tokens of context, including the output",
            )
        if len(prompt) + sampling.max_tokens > self.max_model_len and eviction is None:
            raise InvalidRequestError(
                "sampling.max_tokens",
                f"prompt ({len(prompt)}) + max_tokens ({sampling.max_tokens}) exceeds the "
                f"context limit of {self.max_model_len} tokens",
            )

    def _check_import(self, kv_import: KvImport, num_tokens: int) -> None:
        num_blocks = -(-kv_import.num_tokens // self.block_size)
        kept = kv_import.kept_blocks
        if kept is not None:
            if not kept or kept != sorted(set(kept)) or kept[-1] != num_blocks - 1:
                raise InvalidRequestError(
                    "kv_handle.kept_block_indices",
                    f"must ascend, without repeats, to the last block ({num_blocks - 1})",
                )
            num_blocks = len(kept)
        expected = (num_blocks, *self.runner.kv_wire_shape)
        if tuple(kv_import.data.shape) != expected:
            raise InvalidRequestError(
                "kv", f"imported KV has shape {tuple(kv_import.data.shape)}, expected {expected}"
            )
        if not 0 < kv_import.num_tokens < num_tokens:
            raise InvalidRequestError(
                "kv", f"imported KV covers {kv_import.num_tokens} of {num_tokens} tokens"
            )

    def abort(self, request_id: str) -> bool:
        """Stops a request wherever it is and frees its blocks; False if unknown."""
        if request_id in self.held:
            self.release(request_id)
            return True
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.remove(req)
        self.kv.free(request_id)
        if self.proposer is not None:
            self.proposer.forget(request_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason = FinishReason.ABORT
        return True

    # -- the step ---------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        if self.proposer is not None:
            self._prepare_proposals()
        plan = self.scheduler.schedule()
        self.num_preemptions += len(plan.preempted)
        outputs = [self._finish(req) for req in plan.finished]
        if not plan.scheduled:
            return outputs
        now = time.monotonic()
        for item in plan.scheduled:
            if item.request.first_scheduled_time is None:
                item.request.first_scheduled_time = now
                # Imported blocks and prefix-cache hits are not written behind.
                num_known = item.request.num_computed_tokens // self.block_size
                item.request.num_written_blocks = num_known
        if plan.kv_ops is not None:
            self.runner.apply_kv_ops(plan.kv_ops)
        block_tables = {s.request.request_id: self.kv.block_ids(s.request) for s in plan.scheduled}
        # Structured output: the constrained rows' masks are computed while the forward
        # pass runs (llguidance drops the GIL), from the matchers' state before this step.
        pending_masks = self.grammar_masks.start(plan.scheduled)
        step = self.runner.execute(plan.scheduled, block_tables)
        decode_step = (
            self.proposer is not None
            and not self.proposer.cold
            and all(s.num_new_tokens == 1 or s.draft_token_ids for s in plan.scheduled)
        )
        logits, sampling = step.logits, step.sampling
        for item in plan.scheduled:
            rows = step.prompt_logprobs.get(item.request.request_id)
            if rows is not None:
                self._score_prompt(item, rows)
            if item.draft_token_ids:
                continue  # computed, but what stays is known once verified
            item.request.num_computed_tokens += item.num_new_tokens
            self._publish(item.request)
            snap = item.request.snap
            if (
                snap is not None
                and not snap.done
                and item.request.num_computed_tokens >= snap.prompt_len
            ):
                self._compress(item.request, snap)
        if not sampling:
            return outputs
        # One sampler row per logits row: a verify's row j sees its first j drafts.
        rows_of: list[Request | VerifyRow] = []
        for item in sampling:
            draft = item.draft_token_ids
            rows_of.append(item.request)
            rows_of.extend(VerifyRow(item.request, draft[:j]) for j in range(1, len(draft) + 1))
        masks = self.grammar_masks.finish(pending_masks, sampling, len(rows_of))
        # Unconstrained steps call the sampler as ever (tests wrap it with two arguments).
        result = (
            self.sampler(logits, rows_of) if masks is None else self.sampler(logits, rows_of, masks)
        )
        row = 0
        for item in sampling:
            req, draft = item.request, item.draft_token_ids
            picks = result.token_ids[row : row + len(draft) + 1]
            emitted = accepted(picks, draft) if draft else picks
            start = req.num_computed_tokens  # a verify's: the position of its last token
            out = RequestOutput(
                req.request_id,
                [],
                num_prompt_tokens=req.num_prompt_tokens,
                num_cached_tokens=req.num_cached_tokens,
                num_context_cached_tokens=req.num_context_cached_tokens,
                first_scheduled_time=req.first_scheduled_time,
            )
            finished = False
            for j, token_id in enumerate(emitted):
                out.new_token_ids.append(token_id)
                out.new_logprobs.append(result.logprobs[row + j])
                finished = req.append_token(token_id, self.max_model_len)
                if finished:
                    break
            row += len(draft) + 1
            if draft:
                self.spec_stats.record(len(draft), len(emitted) - 1)
                assert req.spec_acceptance is not None
                req.spec_acceptance.add(len(draft), len(emitted) - 1)
                req.num_spec_rounds += 1
                req.num_spec_proposed += len(draft)
                req.num_spec_accepted += len(emitted) - 1
                # What stays computed: the last token's KV and the accepted drafts' (up to a
                # stop among them); the rest is rolled back, its slots rewritten later.
                req.num_computed_tokens = min(start + len(emitted), req.num_tokens - 1)
                self._publish(req)
                if not finished:
                    self.kv.trim(req)
            out.spec = (req.num_spec_rounds, req.num_spec_proposed, req.num_spec_accepted)
            out.full_blocks = FullBlocks.join(req.pending_writes)
            req.pending_writes = []
            self._hand_out_prompt_logprobs(req, out)
            if finished:
                out.finish_reason = self._finish(req).finish_reason
            elif req.prefill_only:
                self._hold(req)
                out.finish_reason = FinishReason.PREFILLED
            outputs.append(out)
        if decode_step:  # what its rows cost, all of the step, for the speculative policy
            ms = (time.perf_counter() - started) * 1000
            self.step_cost.add(sum(s.num_new_tokens for s in plan.scheduled), ms)
        return outputs

    def _publish(self, req: Request) -> None:
        """After the request's computed tokens moved on: its newly full blocks become prefix
        hits, and copies of them go to write-behind."""
        self.kv.publish_full_blocks(req)
        if req.write_behind and not (req.stream is not None and req.stream.evicted):
            self._copy_full_blocks(req)  # a stream's blocks after an eviction are its own

    def _compress(self, req: Request, snap: SnapState) -> None:
        """SnapKV once the prompt (or ``compress_at``) is computed: its blocks scored by the
        window's queries, the rest freed (compression.py)."""
        num_blocks = -(-snap.prompt_len // self.block_size)
        block_ids = self.kv.block_ids(req)[:num_blocks]
        scores = self.runner.snap_scores(block_ids, snap)
        keep = select_blocks(scores, snap.policy, snap.prompt_len, self.block_size)
        snap.done, snap.queries = True, []
        if keep is None:
            return
        self.kv.compress(req, keep)
        snap.kept_blocks = keep
        self.num_compressed += 1
        self.num_compressed_kept_blocks += len(keep)
        self.num_compressed_dropped_blocks += num_blocks - len(keep)

    def _prepare_proposals(self) -> None:
        """Before the step is scheduled: guesses for every decoding request, each at most
        ``num_speculative_tokens``, what max_tokens and the context leave after the token
        the verify itself yields, and what is worth its rows at the request's kept rate
        and this machine's step cost (policy.py), all from the proposer at once."""
        assert self.proposer is not None and self.speculative is not None
        running = self.scheduler.running
        candidates: list[tuple[Request, int]] = []
        for req in running:
            if req.num_tokens - req.num_computed_tokens != 1 or req.prefill_only:
                continue
            if not req.sampling.speculative:
                continue
            if req.spec_acceptance is None:
                req.spec_acceptance = Acceptance()
            limit = min(
                self.speculative.num_speculative_tokens,
                req.sampling.max_tokens - req.num_output_tokens - 1,
                self.max_model_len - req.num_tokens - 1,
            )
            candidates.append((req, limit))
        if self.speculative.adaptive:
            rates = [(req.spec_acceptance.rate if req.spec_acceptance else 0.0, limit)
                     for req, limit in candidates]  # fmt: skip
            limits = allocate(rates, len(running), self.step_cost)
            candidates = [(req, k) for (req, _), k in zip(candidates, limits, strict=True)]
        asks = [(req, k) for req, k in candidates if k > 0]
        self._proposals = self.proposer.propose_batch(asks) if asks else {}
        for req, _ in candidates:
            if not self._proposals.get(req.request_id):
                assert req.spec_acceptance is not None
                req.spec_acceptance.idle()

    def _propose(self, req: Request, budget: int) -> list[int]:
        """The Scheduler's ``propose``: this step's guesses for ``req``, within ``budget``."""
        return self._proposals.get(req.request_id, [])[:budget]

    def _score_prompt(self, item: ScheduledRequest, rows: torch.Tensor) -> None:
        """Turns this chunk's log-softmax rows [m, V] into the request's prompt logprobs
        (before num_computed_tokens moves past the chunk)."""
        req = item.request
        positions = item.prompt_logprob_positions
        assert (
            req.prompt_logprobs is not None and len(req.prompt_logprobs) == positions.start + 1
        ), f"{req.request_id}: prompt position {positions.start} scored out of order"
        targets = req.token_ids[positions.start + 1 : positions.stop + 1]
        num_top = req.sampling.prompt_logprobs or 0
        req.prompt_logprobs.extend(prompt_logprob_entries(rows, targets, num_top))
        if req.prompt_logprob_rows is not None:
            req.prompt_logprob_rows.append(rows)

    def _hand_out_prompt_logprobs(self, req: Request, out: RequestOutput) -> None:
        """The first output of a request with prompt logprobs carries them, once."""
        if req.prompt_logprobs is None or req.prompt_logprobs_sent:
            return
        assert len(req.prompt_logprobs) == req.num_prompt_tokens, (
            f"{req.request_id}: {len(req.prompt_logprobs)} of {req.num_prompt_tokens} prompt "
            "tokens scored at its first output"
        )
        out.prompt_logprobs = req.prompt_logprobs
        if req.prompt_logprob_rows is not None:
            V = self.spec.vocab_size
            rows = req.prompt_logprob_rows
            out.prompt_logprob_rows = torch.cat(rows) if rows else torch.empty(0, V)
            req.prompt_logprob_rows = None
        req.prompt_logprobs_sent = True

    def _copy_full_blocks(self, req: Request) -> None:
        """Copies the request's newly full, computed blocks for write-behind (the blocks
        themselves stay in the pool; the copy outlives preemption and finish)."""
        req.update_block_hashes(self.block_size)
        num_full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes))
        if num_full <= req.num_written_blocks:
            return
        block_ids = self.kv.block_ids(req)[req.num_written_blocks : num_full]
        hashes = req.block_hashes[req.num_written_blocks : num_full]
        req.pending_writes.append(FullBlocks(hashes, self.runner.export_blocks(block_ids)))
        req.num_written_blocks = num_full

    def _finish(self, req: Request) -> RequestOutput:
        self.scheduler.remove(req)
        self.kv.free(req.request_id)
        if self.proposer is not None:
            self.proposer.forget(req.request_id)
        req.status = RequestStatus.FINISHED
        self.requests.pop(req.request_id, None)
        return RequestOutput(
            req.request_id,
            [],
            finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            num_context_cached_tokens=req.num_context_cached_tokens,
        )

    def _hold(self, req: Request) -> None:
        self.scheduler.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = FinishReason.PREFILLED
        self.requests.pop(req.request_id, None)
        self.held[req.request_id] = req

    # -- the split --------------------------------------------------------------------------

    def export_kv(self, request_id: str) -> KvExport:
        req = self.held.get(request_id)
        if req is None:
            raise NotFoundError(f"no prefilled KV held for request {request_id!r}")
        num_tokens = req.num_computed_tokens
        kept = req.snap.kept_blocks if req.snap is not None else None
        num_blocks = -(-num_tokens // self.block_size) if kept is None else len(kept)
        block_ids = self.kv.block_ids(req)[:num_blocks]
        req.update_block_hashes(self.block_size)
        hashes = req.block_hashes[: num_tokens // self.block_size]
        return KvExport(request_id, num_tokens, hashes, self.runner.export_blocks(block_ids), kept)

    def release(self, request_id: str) -> bool:
        """Frees a held prefill-only request's blocks; False if it was not held."""
        req = self.held.pop(request_id, None)
        if req is None:
            return False
        self.kv.free(request_id)
        return True

    # -- introspection ----------------------------------------------------------------------

    def num_cached_prefix_tokens(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        """Tokens of ``token_ids`` this engine's prefix cache would serve (full blocks)."""
        if not self.config.enable_prefix_caching:
            return 0
        hashes = hash_prompt_blocks(
            token_ids, self.block_size, cache_salt, seed=self.config.hash_seed,
            weights=self.weight_identity,
        )  # fmt: skip
        max_blocks = (len(token_ids) - 1) // self.block_size
        return len(self.kv.pool.longest_cached_prefix(hashes[:max_blocks])) * self.block_size

    def expert_counts(self) -> ExpertCounts | None:
        """Cumulative tokens routed per MoE layer, expert and phase (None for a dense
        model); the one device-to-host read of the counters, for publishing."""
        recorder = self.runner.model.expert_load
        return recorder.snapshot() if recorder is not None else None

    def stats(self) -> EngineStats:
        return EngineStats(
            num_kv_blocks_total=self.kv.pool.num_blocks,
            num_kv_blocks_free=self.kv.pool.num_free,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_held=len(self.held),
            prefix_cache_hit_rate=self.kv.prefix_hit_rate,
            num_preemptions=self.num_preemptions,
            num_pending_tokens=self.scheduler.pending_tokens,
            num_compressed=self.num_compressed,
            num_compressed_kept_blocks=self.num_compressed_kept_blocks,
            num_compressed_dropped_blocks=self.num_compressed_dropped_blocks,
        )
