"""The CPU step with fused C++ ops (kernels/cpu/ops.cpp): the fast CPU path.

Shapes: see base.py. Per layer, instead of a chain of torch ops each: RMS norm (with the
residual add, in place), rotary on q and k in place, the K/V write, and decode attention that
reads each sequence's own blocks through its table (no gather, no padding to the longest
sequence, no mask); SwiGLU's activation in one pass.

Prefill chunks take the same decode attention: each prompt token is one query row with its
sequence's table and its own length (as a speculative verify's rows are), so a token's
attention is computed as a decode step at its position would compute it, whatever chunk it
came in, whatever else shared the step, whether its prefix was a cache hit. With the rest
of the step per row as well (the packed matmuls, the norms), a sequence's logits are the
same bits however the scheduler batched and chunked it: speculation, which changes the
chunking of the prompts beside it, cannot flip a near-tie. The kernel serves a chunk's rows
in groups that read each key once (decode_attention_x16.cpp). Against torch's
``scaled_dot_product_attention`` on the 2-core test machine, a fresh causal prompt, per
layer: 2.5 against 3.9 ms at 512 tokens, 8.5 against 10.0 at 1024, 32 against 29 at 2000;
whole prefills of the default model (chunks of 1024): the same within 3 % up to 2000 tokens,
7.8 against 6.8 s at 4000 (the per-row softmax's two passes over a long context). Where a
step is only decodes and verifies, the fused decoder (common/models/quant/fused_decode.py)
calls the same kernel.

That holds where the kernel has its AVX-512 path (decode_attention_x16.cpp, which serves a
chunk's rows in groups). On a CPU without AVX-512, ops.cpp's AVX2 path computes row after
row, and torch's ``scaled_dot_product_attention`` is the faster one for prompts (see
``prefill_attention``); there the matmuls are not batch-invariant anyway (the x16 weight
layouts need AVX-512), so a sequence's bits already depend on its batching and nothing is
lost. ``prefill_attention`` (EngineConfig, ``--prefill-attention``): ``kernel`` keeps every
prompt token on the kernel, ``sdpa`` sends each prefill chunk through the torch backend's
path (a fresh chunk over its own K/V, a chunk after a cached prefix over the gathered
context) while decode and verify rows stay on the kernel, ``auto`` is ``sdpa`` where the
kernel has no AVX-512 path and ``kernel`` where it has.

The results differ from the torch backend's by float rounding (other summation orders, an
exp accurate to about 2e-7), which is why ``auto`` picks this backend only for quantized
weights, where transformers' exact numerics are not the reference anyway, and the torch
backend stays the bit-exact path for float weights. A float16 or bfloat16 KV cache
(``--kv-dtype float16``: half the bytes of float32, as llama.cpp keeps its cache) is written
rounded to nearest even, as torch's ``.to()`` rounds, and widened exactly as the C++
attention reads it (the AVX-512 path or ops.cpp's AVX2 one; ``ops.attention_takes`` says
which caches the build takes); for int8 / fp8 caches and activations other than float32,
the torch backend's ops serve.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from common.engine.attention.base import AttentionBatch, LayerKV
from common.engine.attention.torch_backend import (
    TorchAttentionBackend,
    TorchAttentionMetadata,
    prefill_chunk,
)


@dataclass
class CppAttentionMetadata(TorchAttentionMetadata):
    block_size: int
    # One attention query per row of the step: decode rows, then every prefill chunk's
    # tokens, each with its sequence's table [T, M] int32 and its length [T] int32 (the
    # context up to and including its own token).
    row_tables: torch.Tensor
    row_lens: torch.Tensor
    # The torch backend's metadata, built by the first layer that falls back to it.
    torch_metadata: TorchAttentionMetadata | None = None
    # With SDPA for prompts: the chunks short enough to stay on the kernel, by index, with
    # their rows' tables [q, M] and lengths [q].
    kernel_chunks: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def _query_rows(batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's block table and length, prompt tokens included: token j of a chunk of
    q tokens ending at length L attends to L - q + j + 1 positions."""
    q_lens = batch.prefill_query_lens_host
    prefill_tables = torch.repeat_interleave(
        batch.prefill_block_tables, torch.tensor(q_lens, dtype=torch.long), dim=0
    )
    prefill_lens = torch.cat([
        torch.arange(seq_len - q_len + 1, seq_len + 1, dtype=torch.int32)
        for q_len, seq_len in zip(q_lens, batch.prefill_seq_lens_host, strict=True)
    ])  # fmt: skip
    decode_tables = batch.decode_block_tables
    width = max(decode_tables.shape[1], prefill_tables.shape[1])
    tables = torch.cat([
        F.pad(decode_tables, (0, width - decode_tables.shape[1])),
        F.pad(prefill_tables, (0, width - prefill_tables.shape[1])),
    ])  # fmt: skip
    return tables, torch.cat([batch.decode_seq_lens, prefill_lens])


class CppAttentionBackend(TorchAttentionBackend):
    name = "cpp"
    # With SDPA for prompts, only chunks of at least sdpa_min_query tokens whose context
    # (cached prefix and chunk) reaches sdpa_min_context take it; the rest stay on the
    # kernel. Per layer of the default model's heads on a 2-core Zen 3 (AVX2;
    # loadtest/bench_attention.py --prefill), kernel / SDPA: fresh prompts of 16-512 tokens
    # 0.11-0.71, of 1024 1.10, of 2000 1.72; after a cached prefix, 64 tokens after 512 0.84,
    # after 1000 1.09, 256 after 1000 1.47, 1000 after 1000 1.68. SDPA's fixed costs (the
    # K/V copied per query head, the context gathered) pay off from about 1000 positions.
    sdpa_min_context = 1024
    sdpa_min_query = 64

    def __init__(self, sliding_window: int | None = None, prefill_attention: str = "auto") -> None:
        from kernels.cpu import load

        super().__init__(sliding_window)
        self.ops = load()
        self.window = sliding_window or 0
        self._takes: dict[tuple[torch.dtype, int], bool] = {}  # (cache dtype, head dim)
        if prefill_attention == "auto":
            prefill_attention = "kernel" if self.ops.has_x16() else "sdpa"
        if prefill_attention not in ("kernel", "sdpa"):
            raise ValueError(
                f"prefill_attention must be auto, kernel or sdpa, got {prefill_attention!r}"
            )
        self.sdpa_prefill = prefill_attention == "sdpa"

    def takes(self, kv: LayerKV) -> bool:
        """Whether the C++ kernels write and attend over this layer's cache."""
        if kv.quantized:
            return False
        key = (kv.k_cache.dtype, kv.k_cache.shape[-1])
        if key not in self._takes:
            self._takes[key] = bool(self.ops.attention_takes(kv.k_cache))
        return self._takes[key]

    def prepare(self, batch: AttentionBatch, block_size: int) -> CppAttentionMetadata:
        # Decode attention reads the tables directly; gather ids and masks are built only
        # where a layer falls back to the torch backend (_torch_forward).
        no_ids = torch.empty(0, 0, dtype=torch.long)
        no_mask = torch.empty(0, 1, 1, 0, dtype=torch.bool)
        row_tables, row_lens = batch.decode_block_tables, batch.decode_seq_lens
        prefill_ids: list[torch.Tensor] = []
        prefill_masks: list[torch.Tensor | None] = []
        kernel_chunks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if batch.num_prefills and self.sdpa_prefill:
            # The kernel takes the decode rows alone (and the chunks too short for SDPA to
            # pay); the other chunks go through SDPA.
            prefill_ids, prefill_masks = self._prepare_prefills(batch, block_size)
            for i, (q_len, seq_len) in enumerate(
                zip(batch.prefill_query_lens_host, batch.prefill_seq_lens_host, strict=True)
            ):
                if seq_len < self.sdpa_min_context or q_len < self.sdpa_min_query:
                    tables = batch.prefill_block_tables[i : i + 1].expand(q_len, -1).contiguous()
                    lens = torch.arange(seq_len - q_len + 1, seq_len + 1, dtype=torch.int32)
                    kernel_chunks[i] = (tables, lens)
        elif batch.num_prefills:
            row_tables, row_lens = _query_rows(batch)
        return CppAttentionMetadata(
            batch, no_ids, no_mask, prefill_ids, prefill_masks, block_size, row_tables,
            row_lens, kernel_chunks=kernel_chunks,
        )  # fmt: skip

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKV,
        metadata: TorchAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        assert isinstance(metadata, CppAttentionMetadata)
        if q.dtype != torch.float32 or not self.takes(kv):
            return self._torch_forward(q, k, v, kv, metadata, scale)
        self.ops.write_kv(k, v, kv.k_cache, kv.v_cache, metadata.batch.slot_mapping)
        batch = metadata.batch
        if batch.num_prefills and self.sdpa_prefill:
            out = torch.empty_like(q)
            decodes = batch.num_decode_tokens
            if decodes:
                out[:decodes] = self.ops.paged_decode_attention(
                    q[:decodes], kv.k_cache, kv.v_cache, metadata.row_tables,
                    metadata.row_lens, scale, self.window,
                )  # fmt: skip
            start = decodes
            for i, q_len in enumerate(batch.prefill_query_lens_host):
                end = start + q_len
                chunk = metadata.kernel_chunks.get(i)
                if chunk is None:
                    out[start:end] = prefill_chunk(q, k, v, kv, metadata, scale, i, start)
                else:
                    out[start:end] = self.ops.paged_decode_attention(
                        q[start:end], kv.k_cache, kv.v_cache, chunk[0], chunk[1], scale,
                        self.window,
                    )  # fmt: skip
                start = end
            return out
        # Every row, decode or prompt token, after every K/V of the step is written.
        result: torch.Tensor = self.ops.paged_decode_attention(
            q, kv.k_cache, kv.v_cache, metadata.row_tables, metadata.row_lens, scale,
            self.window,
        )  # fmt: skip
        return result

    def _torch_forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKV,
        metadata: CppAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """The torch backend's path (quantized caches), its gather ids and masks built once a
        step, by the first layer that needs them."""
        if metadata.torch_metadata is None:
            metadata.torch_metadata = TorchAttentionBackend.prepare(
                self, metadata.batch, metadata.block_size
            )
        return super().forward(q, k, v, kv, metadata.torch_metadata, scale)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype != torch.float32:
            return super().rms_norm(x, weight, eps)
        out: torch.Tensor = self.ops.rms_norm(x, weight, eps)
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Adds x into ``residual`` in place (the residual stream is the model's own)."""
        if x.dtype != torch.float32 or not residual.is_contiguous():
            return super().add_rms_norm(x, residual, weight, eps)
        out: torch.Tensor = self.ops.add_rms_norm_(x, residual, weight, eps)
        return out, residual

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates q and k in place (they are views into this step's projection output)."""
        if q.dtype != torch.float32:
            return super().rotary(q, k, positions, cos_sin)
        self.ops.rotary_(q, positions, cos_sin)
        self.ops.rotary_(k, positions, cos_sin)
        return q, k

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dtype != torch.float32 or not gate_up.is_contiguous():
            return super().silu_and_mul(gate_up)
        out: torch.Tensor = self.ops.silu_and_mul(gate_up)
        return out
