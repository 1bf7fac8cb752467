"""ModelRunner: owns the model and the KV cache tensors; turns a schedule into logits.

Shapes: T = tokens in the step, n = sequences sampled, m = prompt positions scored for one
request (prompt_logprobs), V = vocab, L/N/S/Hkv/D as in the KV cache
``[L, 2, N, S, Hkv, D]``. Token order: single-token queries first, then prefill chunks.

Quantized weights have two paths that round differently (common/models/quant/linear.py):
a row takes the dense one (dequantize + float GEMM) if it is a prompt token of a prompt of
``DENSE_MIN_ROWS`` tokens or more, in an engine whose chunks can be that long; every other
row, generated tokens included when a migrated request recomputes them, takes the packed
kernel a decode step uses. The choice depends on the token alone, so a token's path is
the same in any batch, chunking, cache hit or migration (and in a llama its logits the
same bits: tests/unit/test_quant_row_paths.py).
An int8 / fp8 cache (``kv_dtype``) also has ``kv_scales [L, 2, N, Hkv]`` float32, one scale
per (layer, K or V, block, kv head); see kernels/kv_quant.py for the format.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field

import psutil
import torch

from common.contract.model_spec import ModelSpec
from common.engine.attention import AttentionBatch, LayerKV, select_backend
from common.engine.attention.base import QUANTIZED_KV_DTYPES
from common.engine.attention.torch_kv import gather_blocks, new_kv_scales
from common.engine.compression import QueryTap, SnapState, block_scores
from common.engine.config import EngineConfig, parse_memory_budget
from common.engine.eviction import KvOps
from common.engine.scheduler import ScheduledRequest
from common.models.loader import CausalLM, build_model
from common.models.quant.formats import resolve_weight_format
from common.models.quant.fused_decode import FusedDecoder
from common.models.quant.linear import DENSE_MIN_ROWS, dense_rows
from common.models.quant.load import matmul_layouts, weight_bytes
from common.models.rope import apply_rotary, rotation_rows

log = logging.getLogger(__name__)

# Prompt positions whose logits are computed at once for prompt logprobs: bounds the float32
# logits held besides the output rows to this many vocab-wide rows.
PROMPT_LOGITS_SLICE = 128


def _zeroed(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, prefault: bool = False
) -> torch.Tensor:
    """A zeroed tensor. On a CPU its memory is an anonymous mapping, whose fresh zero pages
    the kernel supplies on first touch: the KV pool occupies memory as blocks are written,
    not all of it at start (torch.zeros writes every byte). It asks for transparent huge
    pages, so that a first touch maps 2 MiB at once rather than 4 KiB: on this machine's VM
    a 69 MB prompt's KV costs about 100 ms of page faults in 4 KiB pages, 40 ms in 2 MiB.
    ``prefault`` writes the whole pool at start instead (its memory held from then on), so
    that no request pays a fault."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import mmap

    nbytes = math.prod(shape) * dtype.itemsize
    region = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):  # a kernel without THP keeps 4 KiB pages
            region.madvise(advice)
    raw = torch.frombuffer(region, dtype=torch.uint8)[:nbytes]  # holds the mapping alive
    if prefault:
        raw.zero_()
    return raw.view(dtype).view(shape)


@dataclass
class StepLogits:
    """What one step's forward pass hands the engine."""

    # [n', V'] float32, the sampling requests' last positions, in order; a speculative
    # verify has 1 + len(draft_token_ids) rows, one per position it computed.
    logits: torch.Tensor
    sampling: list[ScheduledRequest]
    # Requests with prompt logprobs to score in this step, by request id: float32
    # log-softmax over the vocab at ``item.prompt_logprob_positions``, [m, V].
    prompt_logprobs: dict[str, torch.Tensor] = field(default_factory=dict)


def kv_bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block costs across all layers: K and V elements, plus their float32 scales
    (one per layer, K/V and kv head) when the cache is quantized."""
    element = torch.empty(0, dtype=dtype).element_size()
    num_bytes = spec.num_layers * 2 * block_size * spec.num_kv_heads * spec.head_dim * element
    if dtype in QUANTIZED_KV_DTYPES:
        num_bytes += spec.num_layers * 2 * spec.num_kv_heads * 4
    return num_bytes


def num_blocks_for_budget(config: EngineConfig, spec: ModelSpec, dtype: torch.dtype) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    device = config.torch_device
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        total = psutil.virtual_memory().total
    budget = parse_memory_budget(config.kv_cache_memory, total)
    num_blocks = budget // kv_bytes_per_block(spec, config.block_size, dtype)
    if num_blocks < 1:
        raise ValueError(
            f"KV budget {config.kv_cache_memory} holds no block of "
            f"{kv_bytes_per_block(spec, config.block_size, dtype)} bytes"
        )
    return int(num_blocks)


class ModelRunner:
    def __init__(self, config: EngineConfig, spec: ModelSpec) -> None:
        self.config = config
        self.spec = spec
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        self.weight_format = resolve_weight_format(
            config.quantization, config.quant_group_size, config.quant_kernel, config.model,
            config.quant_act_bits, self.device.type,
        )  # fmt: skip
        self.backend = select_backend(
            config.attention_backend, self.device, spec.sliding_window,
            self.weight_format.quantized, config.prefill_attention,
        )  # fmt: skip
        self.model: CausalLM = build_model(
            spec, config.model, self.backend, self.dtype, self.device, self.weight_format
        )
        self.weight_bytes = weight_bytes(self.model)
        self.kv_dtype = config.torch_kv_dtype
        self.num_blocks = num_blocks_for_budget(config, spec, self.kv_dtype)
        L, N, Hkv = spec.num_layers, self.num_blocks, spec.num_kv_heads
        shape = (L, 2, N, self.block_size, Hkv, spec.head_dim)
        self.kv_cache = _zeroed(shape, self.kv_dtype, self.device, config.kv_prefault)
        self.kv_scales: torch.Tensor | None = None  # [L, 2, N, Hkv] float32
        if self.kv_quantized:
            self.kv_scales = new_kv_scales((L, 2, N, Hkv), self.device)
        scales = self.kv_scales
        self.layer_kv = [
            LayerKV(
                self.kv_cache[i, 0],
                self.kv_cache[i, 1],
                scales[i, 0] if scales is not None else None,
                scales[i, 1] if scales is not None else None,
            )
            for i in range(L)
        ]
        if config.fused_decode and self.weight_format.quantized:
            self.model.fused_decoder = FusedDecoder.build(self.model, self.layer_kv)
        self.num_forward_tokens = 0  # tokens that went through the model (tests count them)
        layouts = ", ".join(f"{n} {name}" for name, n in sorted(matmul_layouts(self.model).items()))
        log.info(
            "weights: %s, %.1f MiB%s", self.weight_format.describe(), self.weight_bytes / 2**20,
            f" (packed matmuls: {layouts})" if layouts else "",
        )  # fmt: skip
        log.info(
            "KV cache: %d blocks x %d tokens (%.1f MiB, %s, backend %s)",
            self.num_blocks,
            self.block_size,
            self.num_blocks * kv_bytes_per_block(spec, self.block_size, self.kv_dtype) / 2**20,
            str(self.kv_dtype).removeprefix("torch."),
            self.backend.name,
        )

    @property
    def kv_quantized(self) -> bool:
        return self.kv_dtype in QUANTIZED_KV_DTYPES

    @property
    def kv_block_shape(self) -> tuple[int, int, int, int, int]:
        spec = self.spec
        return (spec.num_layers, 2, self.block_size, spec.num_kv_heads, spec.head_dim)

    @property
    def kv_wire_shape(self) -> tuple[int, ...]:
        """One block as export_blocks hands it out (common/kv/layout.py's wire_shape):
        [L, 2, S, Hkv, D], or for a quantized cache its bytes, codes then scales."""
        if self.kv_scales is None:
            return self.kv_block_shape
        codes = math.prod(self.kv_block_shape) * self.kv_dtype.itemsize
        return (codes + self.spec.num_layers * 2 * self.spec.num_kv_heads * 4,)

    @torch.inference_mode()
    def execute(
        self, scheduled: list[ScheduledRequest], block_tables: dict[str, list[int]]
    ) -> StepLogits:
        """Runs one step; returns logits [n, V] for the requests that sample, in order, and
        log-softmax rows for the prompt positions requests with prompt logprobs score."""
        for item in scheduled:
            if item.import_block_ids:
                self._import(item)
        # Single-token queries first: generated tokens, speculative verifies, one-token
        # prompt chunks; then prefill chunks. A verify (the last token and its drafts) is
        # one query per row to attention, row j with the sequence's blocks and length
        # start + j + 1 (its K/V are written before any query reads them), so each row
        # computes as a plain decode step at that position would. The expert-load
        # recorder counts the leading generated and verified rows as decode.
        singles = [s for s in scheduled if s.num_new_tokens == 1]
        decodes = [s for s in singles if not _is_prompt_token(s)]
        decodes += [s for s in scheduled if s.draft_token_ids]
        num_generated_rows = sum(s.num_new_tokens for s in decodes)
        decodes += [s for s in singles if _is_prompt_token(s)]
        prefills = [s for s in scheduled if s.num_new_tokens > 1 and not s.draft_token_ids]
        ordered = decodes + prefills
        if self.model.expert_load is not None:
            self.model.expert_load.num_decode_tokens = num_generated_rows

        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        S = self.block_size
        for item in ordered:
            req = item.request
            table = block_tables[req.request_id]
            start = req.num_computed_tokens
            # A stream's kept blocks skip what it evicted; its positions are rebased.
            skip, base = req.num_evicted_tokens, req.position_base
            for pos in range(start - skip, start - skip + item.num_new_tokens):
                slots.append(table[pos // S] * S + pos % S)
            num_known = item.num_new_tokens - len(item.draft_token_ids)
            input_ids.extend(req.token_ids[start : start + num_known])
            input_ids.extend(item.draft_token_ids)
            positions.extend(range(start - base, start - base + item.num_new_tokens))

        def tables(items: list[ScheduledRequest], per_token: bool = False) -> torch.Tensor:
            rows = [
                block_tables[s.request.request_id]
                for s in items
                for _ in range(s.num_new_tokens if per_token else 1)
            ]
            width = max((len(r) for r in rows), default=0)
            return torch.tensor(
                [r + [0] * (width - len(r)) for r in rows], dtype=torch.int32
            ).reshape(len(rows), width)

        decode_lens = [
            s.request.num_computed_tokens - s.request.num_evicted_tokens + j + 1
            for s in decodes
            for j in range(s.num_new_tokens)
        ]
        prefill_q_lens = [s.num_new_tokens for s in prefills]
        prefill_lens = [
            s.request.num_computed_tokens - s.request.num_evicted_tokens + s.num_new_tokens
            for s in prefills
        ]
        q_starts = [0]
        for q_len in prefill_q_lens:
            q_starts.append(q_starts[-1] + q_len)
        batch = AttentionBatch(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            num_decode_tokens=len(decode_lens),
            decode_block_tables=tables(decodes, per_token=True),
            decode_seq_lens=torch.tensor(decode_lens, dtype=torch.int32),
            prefill_block_tables=tables(prefills),
            prefill_query_start_loc=torch.tensor(q_starts, dtype=torch.int32),
            prefill_seq_lens=torch.tensor(prefill_lens, dtype=torch.int32),
            max_decode_seq_len=max(decode_lens, default=0),
            prefill_query_lens_host=prefill_q_lens,
            prefill_seq_lens_host=prefill_lens,
        )
        batch = _to_device(batch, self.device)
        metadata = self.backend.prepare(batch, S)
        dense = self._dense_rows(ordered)
        tap, tapped = self._query_tap(ordered)
        if tap is not None:
            self.model.set_query_tap(tap)
        try:
            with dense_rows(dense) if dense is not None else contextlib.nullcontext():
                hidden = self.model(
                    torch.tensor(input_ids, dtype=torch.long, device=self.device),
                    torch.tensor(positions, dtype=torch.long, device=self.device),
                    self.layer_kv,
                    metadata,
                )
        finally:
            if tap is not None:
                self.model.set_query_tap(None)
        if tap is not None:
            self._keep_queries(tap, tapped)
        self.num_forward_tokens += len(input_ids)

        sampling = [s for s in ordered if s.samples]
        last_index: list[int] = []
        prompt_logprobs: dict[str, torch.Tensor] = {}
        offset = 0
        for item in ordered:
            scored = item.prompt_logprob_positions  # empty unless prompt_logprobs
            if scored:
                first = offset + scored.start - item.request.num_computed_tokens
                rows = hidden[first : first + len(scored)]
                prompt_logprobs[item.request.request_id] = self._log_softmax(rows)
            offset += item.num_new_tokens
            if item.samples:  # the last row; a verify's every row
                num_rows = 1 + len(item.draft_token_ids)
                last_index.extend(range(offset - num_rows, offset))
        index = torch.tensor(last_index, dtype=torch.long, device=self.device)
        # The sampled rows: the packed head, in any batch.
        with dense_rows(dense) if dense is not None else contextlib.nullcontext():
            logits = self.model.compute_logits(hidden[index])
        return StepLogits(logits, sampling, prompt_logprobs)

    @torch.inference_mode()
    def apply_kv_ops(self, ops: KvOps) -> None:
        """StreamingLLM's cache edits (eviction.py): block copies, then keys rotated by a
        whole number of positions (RoPE rotations compose: R(a + d) = R(d) R(a))."""
        if ops.copies:
            src = torch.tensor([a for a, _ in ops.copies], dtype=torch.long, device=self.device)
            dst = torch.tensor([b for _, b in ops.copies], dtype=torch.long, device=self.device)
            self.kv_cache.index_copy_(2, dst, self.kv_cache.index_select(2, src))
        by_delta: dict[int, list[int]] = {}
        for block_id, delta in ops.rotations.items():
            if delta:
                by_delta.setdefault(delta, []).append(block_id)
        keys = self.kv_cache[:, 0]  # [L, N, S, Hkv, D]
        for delta, block_ids in by_delta.items():
            index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
            rows = rotation_rows(self.spec.rope, self.spec.head_dim, delta).to(self.device)
            picked = keys.index_select(1, index)  # [L, n, S, Hkv, D]
            shape = picked.shape
            rotated = apply_rotary(picked.reshape(-1, shape[-2], shape[-1]), rows.expand(
                math.prod(shape[:-2]), -1))  # fmt: skip
            keys.index_copy_(1, index, rotated.reshape(shape).to(keys.dtype))

    def _query_tap(
        self, ordered: list[ScheduledRequest]
    ) -> tuple[QueryTap | None, list[tuple[SnapState, range]]]:
        """SnapKV: the step's rows inside a compressing prompt's window (compression.py),
        and for each such request its state and the positions of its rows."""
        rows: list[int] = []
        tapped: list[tuple[SnapState, range]] = []
        offset = 0
        for item in ordered:
            snap, start = item.request.snap, item.request.num_computed_tokens
            if snap is not None and not snap.done:
                lo = max(start, snap.window_start)
                hi = min(start + item.num_new_tokens, snap.prompt_len)
                if lo < hi:
                    rows.extend(range(offset + lo - start, offset + hi - start))
                    tapped.append((snap, range(lo, hi)))
            offset += item.num_new_tokens
        if not rows:
            return None, []
        return QueryTap(torch.tensor(rows, dtype=torch.long, device=self.device)), tapped

    @staticmethod
    def _keep_queries(tap: QueryTap, tapped: list[tuple[SnapState, range]]) -> None:
        first = 0
        for snap, positions in tapped:
            n = len(positions)
            if not snap.queries:
                snap.queries = [[] for _ in tap.per_layer]
            for layer, q in zip(snap.queries, tap.per_layer, strict=True):
                layer.append(q[first : first + n].cpu())
            snap.positions.extend(positions)
            first += n

    @torch.inference_mode()
    def snap_scores(self, block_ids: list[int], snap: SnapState) -> torch.Tensor:
        """SnapKV: each of the request's prompt blocks' score from its captured window
        queries against the prompt's keys in the cache (compression.block_scores)."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        keys = []
        for layer_kv in self.layer_kv:
            blocks = gather_blocks(layer_kv.k_cache, layer_kv.k_scale, index, torch.float32)
            keys.append(blocks.reshape(-1, *blocks.shape[2:])[: snap.prompt_len].cpu())
        queries = [torch.cat(chunks) for chunks in snap.queries]
        positions = torch.tensor(snap.positions, dtype=torch.long)
        return block_scores(queries, positions, keys, self.block_size, self.spec.head_dim**-0.5)

    def _dense_rows(self, ordered: list[ScheduledRequest]) -> torch.Tensor | None:
        """bool [T]: the step's rows that take quantized weights' dense path (module
        docstring); None for weights with one path."""
        if not self.weight_format.quantized or self.weight_format.kernel != "cpp":
            return None
        dense: list[bool] = []
        chunks_can_be_dense = self.config.max_num_batched_tokens >= DENSE_MIN_ROWS
        for item in ordered:
            req = item.request
            n = item.num_new_tokens
            num_dense = 0
            if chunks_can_be_dense and req.num_prompt_tokens >= DENSE_MIN_ROWS:
                num_dense = min(n, max(0, req.num_prompt_tokens - req.num_computed_tokens))
            dense.extend([True] * num_dense + [False] * (n - num_dense))
        if len(dense) < DENSE_MIN_ROWS and not any(dense):
            return None  # every layer takes the packed kernel either way (decode steps)
        return torch.tensor(dense, dtype=torch.bool)

    def _log_softmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """[m, H] hidden states -> [m, V] float32 log-softmax of their logits over the vocab
        (padded vocab columns dropped), PROMPT_LOGITS_SLICE rows at a time."""
        V = self.spec.vocab_size
        out = torch.empty((hidden.shape[0], V), dtype=torch.float32, device=self.device)
        for i in range(0, hidden.shape[0], PROMPT_LOGITS_SLICE):
            logits = self.model.compute_logits(hidden[i : i + PROMPT_LOGITS_SLICE])[:, :V]
            torch.log_softmax(logits.float(), dim=-1, out=out[i : i + PROMPT_LOGITS_SLICE])
        return out

    def _import(self, item: ScheduledRequest) -> None:
        kv_import = item.request.kv_import
        assert kv_import is not None, item.request.request_id
        block_ids = torch.tensor(item.import_block_ids, dtype=torch.long, device=self.device)
        if self.kv_scales is not None:  # [n, bytes_per_block] uint8: codes, then scales
            codes, scales = self._split_quantized(kv_import.data.to(self.device))
            # As bytes: CPU torch has no index_copy for float8.
            self.kv_cache.view(torch.uint8).index_copy_(
                2, block_ids, codes.view(torch.uint8).permute(1, 2, 0, 3, 4, 5)
            )
            self.kv_scales.index_copy_(2, block_ids, scales.permute(1, 2, 0, 3))
        else:
            data = kv_import.data.to(device=self.device, dtype=self.kv_dtype)  # [n, L, 2, S, ..]
            self.kv_cache.index_copy_(2, block_ids, data.permute(1, 2, 0, 3, 4, 5))
        item.request.kv_import = None

    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Contiguous copies of the blocks in the KV wire layout: [n, L, 2, S, Hkv, D] of a
        float cache, [n, bytes_per_block] uint8 (codes, then float32 scales [L, 2, Hkv]) of
        an int8 / fp8 one."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        codes = self.kv_cache.index_select(2, index).permute(2, 0, 1, 3, 4, 5).contiguous()
        if self.kv_scales is None:
            return codes
        scales = self.kv_scales.index_select(2, index).permute(2, 0, 1, 3).contiguous()
        n = len(block_ids)
        return torch.cat([codes.view(torch.uint8).reshape(n, -1),
                          scales.view(torch.uint8).reshape(n, -1)], dim=1)  # fmt: skip

    def _split_quantized(self, data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, bytes_per_block] uint8 -> codes [n, L, 2, S, Hkv, D], scales [n, L, 2, Hkv]."""
        shape = self.kv_block_shape
        n, offset = data.shape[0], math.prod(shape) * self.kv_dtype.itemsize
        codes = data[:, :offset].contiguous().view(self.kv_dtype).view(n, *shape)
        scales = data[:, offset:].contiguous().view(torch.float32)
        return codes, scales.view(n, self.spec.num_layers, 2, self.spec.num_kv_heads)


def _is_prompt_token(item: ScheduledRequest) -> bool:
    """Whether a one-token step of this request computes a prompt token (prefill)."""
    return item.request.num_computed_tokens < item.request.num_prompt_tokens


def _to_device(batch: AttentionBatch, device: torch.device) -> AttentionBatch:
    if device.type == "cpu":
        return batch
    for name in (
        "slot_mapping",
        "decode_block_tables",
        "decode_seq_lens",
        "prefill_block_tables",
        "prefill_query_start_loc",
        "prefill_seq_lens",
    ):
        setattr(batch, name, getattr(batch, name).to(device, non_blocking=True))
    return batch
