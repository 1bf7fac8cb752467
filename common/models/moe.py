"""Mixture-of-experts models: Mixtral, Qwen2-MoE (shared expert), Qwen3-MoE (q/k norm).

Attention, norms, rope and the dense layers are the llama family's (common/models/llama.py);
what differs is the MLP of the sparse layers, ``SparseMoeBlock``:

    router logits [T, E] -> softmax (float32) -> top-k experts and weights [T, k]
    (renormalised to sum 1 if norm_topk_prob) -> every expert runs on the tokens routed to it
    -> outputs scaled by the weights and summed per token (+ the gated shared expert)

Grouped computation: the T*k (token, expert) pairs are sorted by expert, so each active
expert is one gathered matmul over its contiguous run of tokens (gate and up fused in one
matmul, then down), never a loop over tokens. The per-expert counts that split the runs are
also what ``ExpertLoadRecorder`` accumulates, on the device, per layer and phase.

Weights load by their Hugging Face names, in both layouts transformers uses:
per-expert tensors (``block_sparse_moe.experts.{e}.w1|w2|w3`` for Mixtral,
``mlp.experts.{e}.gate_proj|up_proj|down_proj`` for Qwen; what ``save_pretrained`` writes)
and fused ones (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``,
transformers 5's in-memory layout).

Shapes: T tokens, H hidden, E experts, k experts per token, I expert intermediate size.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from common.contract.model_spec import ModelSpec, MoeSpec
from common.engine.attention import AttentionBackend
from common.experts.counts import DECODE, PREFILL, ExpertCounts
from common.models.llama import MLP, DecoderLayer, LlamaForCausalLM
from common.models.quant.linear import row_subset


class ExpertLoadRecorder:
    """Tokens routed to each expert, per MoE layer and phase, accumulated on the model's
    device: recording is a few tensor adds inside the forward step and never reads anything
    back to the host; ``snapshot`` (when publishing) is the only device-to-host copy.

    The model runner puts a step's decode tokens first and sets ``num_decode_tokens``
    before the forward; the rest of the step's tokens count as prefill.
    """

    def __init__(
        self, layers: tuple[int, ...], num_experts: int, device: torch.device | str
    ) -> None:
        self.layers = layers
        self.num_experts = num_experts
        self.counts = torch.zeros(  # [phase, MoE layer, expert]
            2, len(layers), num_experts, dtype=torch.int64, device=device
        )
        self.num_decode_tokens = 0

    def record(self, slot: int, topk_ids: torch.Tensor, per_expert: torch.Tensor) -> None:
        """``slot``: the MoE layer's index in ``layers``; ``topk_ids`` [T, k] the experts
        each token was routed to; ``per_expert`` [E] their counts (int64, same device)."""
        num_tokens, n = topk_ids.shape[0], self.num_decode_tokens
        if n <= 0:
            self.counts[PREFILL, slot] += per_expert
        elif n >= num_tokens:
            self.counts[DECODE, slot] += per_expert
        else:
            decode = torch.zeros_like(per_expert)
            ids = topk_ids[:n].reshape(-1)
            decode.scatter_add_(0, ids, torch.ones_like(ids))
            self.counts[DECODE, slot] += decode
            self.counts[PREFILL, slot] += per_expert - decode

    def snapshot(self) -> ExpertCounts:
        host = self.counts.cpu().tolist()
        return ExpertCounts(
            self.layers,
            self.num_experts,
            tuple(tuple(tuple(row) for row in phase) for phase in host),
        )

    def reset(self) -> None:
        self.counts.zero_()
        self.num_decode_tokens = 0


class Experts(nn.Module):
    """E SwiGLU experts stored fused: ``gate_up_proj [E, 2I, H]`` (gate rows, then up) and
    ``down_proj [E, H, I]``, transformers 5's layout."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype):
        super().__init__()
        self.num_experts = num_experts
        self.intermediate = intermediate
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate, hidden, dtype=dtype), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden, intermediate, dtype=dtype), requires_grad=False
        )

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on x: [n, H] -> [n, H]."""
        gate_up = F.linear(x, self.gate_up_proj[e])  # [n, 2I]
        gate, up = gate_up[:, : self.intermediate], gate_up[:, self.intermediate :]
        return F.linear(F.silu(gate) * up, self.down_proj[e])

    def grouped_mm(self, xs: torch.Tensor, per_expert: torch.Tensor) -> torch.Tensor:
        """Every expert on its run of ``xs`` [n, H] (runs in expert order, lengths
        ``per_expert`` [E]) with torch's grouped GEMM: two kernels, offsets on the device."""
        offsets = per_expert.cumsum(0).to(torch.int32)
        gate_up = F.grouped_mm(xs, self.gate_up_proj.transpose(1, 2), offs=offsets)
        size = self.intermediate
        act = F.silu(gate_up[:, :size]) * gate_up[:, size:]
        return F.grouped_mm(act, self.down_proj.transpose(1, 2), offs=offsets)

    # -- loading: shards are "gate:{e}", "up:{e}", "down:{e}", or all experts at once ----------

    def expected_shards(self, attr: str) -> list[str]:
        kinds = ("gate", "up") if attr == "gate_up_proj" else ("down",)
        return [f"{kind}:{e}" for e in range(self.num_experts) for kind in kinds]

    def load_shard(
        self, shard: str, param_name: str, tensor: torch.Tensor
    ) -> list[tuple[str, str]]:
        num_experts, size = self.num_experts, self.intermediate
        if shard in ("gate_up", "down"):  # fused: every expert in one tensor
            attr = "gate_up_proj" if shard == "gate_up" else "down_proj"
            _copy(getattr(self, attr).data, tensor, f"experts.{attr}")
            return [(attr, s) for s in self.expected_shards(attr)]
        kind, _, index = shard.partition(":")
        e = int(index)
        if not 0 <= e < num_experts:
            raise ValueError(f"expert {e} is outside the config's {num_experts} experts")
        if kind == "down":
            _copy(self.down_proj.data[e], tensor, f"experts.{e}.down")
            return [("down_proj", shard)]
        rows = slice(0, size) if kind == "gate" else slice(size, 2 * size)
        _copy(self.gate_up_proj.data[e, rows], tensor, f"experts.{e}.{kind}")
        return [("gate_up_proj", shard)]


def _copy(target: torch.Tensor, tensor: torch.Tensor, what: str) -> None:
    if target.shape != tensor.shape:
        raise ValueError(
            f"{what}: checkpoint shape {tuple(tensor.shape)} does not match the config's "
            f"{tuple(target.shape)}"
        )
    target.copy_(tensor)


class SparseMoeBlock(nn.Module):
    def __init__(self, spec: ModelSpec, moe: MoeSpec, slot: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.moe = moe
        self.slot = slot  # this layer's index among the MoE layers (the recorder's row)
        self.top_k = moe.top_k
        self.num_experts = moe.num_experts
        self.gate = nn.Linear(spec.hidden_size, moe.num_experts, bias=False, dtype=dtype)
        self.gate.weight.requires_grad_(False)
        self.experts = Experts(
            moe.num_experts, spec.hidden_size, moe.expert_intermediate_size, dtype
        )
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = MLP(spec, dtype, moe.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(spec.hidden_size, 1, bias=False, dtype=dtype)
            self.shared_expert_gate.weight.requires_grad_(False)
        self.recorder: ExpertLoadRecorder | None = None
        self._grouped_mm: bool | None = None  # decided at the first forward

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) for x: [T, H], each family's normalisation.

        Mixtral's softmax over the top-k logits equals softmax, top-k, renormalise; Qwen
        MoE renormalises only with norm_topk_prob. Weights are float32 for Mixtral, the model
        dtype for Qwen, as transformers computes them.
        """
        logits = self.gate(x)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.moe.float32_routing_weights:
            weights = weights.to(x.dtype)
        return weights, ids

    def forward(  # [T, H] -> [T, H]
        self, x: torch.Tensor, ops: AttentionBackend | None = None
    ) -> torch.Tensor:
        weights, ids = self.route(x)
        out = self.grouped_experts(x, weights, ids)
        return self._add_shared(x, out, ops)

    def grouped_experts(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        method: str | None = None,
    ) -> torch.Tensor:
        """Sum over each token's k experts of weight * expert(x), tokens sorted by expert.

        ``method``: ``loop``, one gate_up and one down matmul per active expert on its run
        of tokens (the run lengths are read on the host, once per layer); ``grouped_mm``,
        torch's grouped GEMM over all runs at once, offsets on the device (no host read);
        None picks grouped_mm on CUDA when torch has it and it runs on these weights.
        """
        k = ids.shape[1]
        flat = ids.reshape(-1)  # [T*k] expert of each (token, choice)
        per_expert = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        per_expert.scatter_add_(0, flat, torch.ones_like(flat))
        if self.recorder is not None:
            self.recorder.record(self.slot, ids, per_expert)
        order = torch.argsort(flat, stable=True)  # (token, choice) pairs grouped by expert
        token_of = order // k  # [T*k] the token of each sorted pair
        xs = x.index_select(0, token_of)  # [T*k, H]
        if method is None:
            method = "grouped_mm" if self._grouped_mm_works(xs) else "loop"
        if method == "grouped_mm":
            ys = self.experts.grouped_mm(xs, per_expert)
        elif method == "loop":
            ys = torch.empty_like(xs)
            start = 0
            for e, n in enumerate(per_expert.tolist()):
                if n:
                    with row_subset(token_of[start : start + n]):
                        ys[start : start + n] = self.experts.expert(e, xs[start : start + n])
                    start += n
        else:
            raise ValueError(f"unknown experts method {method!r}")
        scaled = (ys * weights.reshape(-1)[order].unsqueeze(1)).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, scaled)

    def _grouped_mm_works(self, xs: torch.Tensor) -> bool:
        """Once per block: CUDA, a torch with F.grouped_mm, and a trial that runs (its dtype
        and alignment rules vary by torch version and GPU)."""
        if self._grouped_mm is None:
            self._grouped_mm = False
            if xs.device.type == "cuda" and hasattr(F, "grouped_mm") and xs.shape[0]:
                one_token = torch.zeros(self.num_experts, dtype=torch.int64, device=xs.device)
                one_token[0] = 1
                try:
                    self.experts.grouped_mm(xs[:1], one_token)
                    self._grouped_mm = True
                except (RuntimeError, ValueError, TypeError):
                    self._grouped_mm = False
        return self._grouped_mm

    def per_token_experts(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """Reference: the naive loop over tokens and their k experts (tests, benchmarks)."""
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(ids.shape[1]):
                y = self.experts.expert(int(ids[t, j]), x[t : t + 1])
                out[t] += (y[0] * weights[t, j]).to(x.dtype)
        return out

    def _add_shared(
        self, x: torch.Tensor, out: torch.Tensor, ops: AttentionBackend | None = None
    ) -> torch.Tensor:
        if self.shared_expert is None or self.shared_expert_gate is None:
            return out
        shared = self.shared_expert(x, ops)
        return out + torch.sigmoid(self.shared_expert_gate(x)) * shared


# HF names of the sparse MLP. Mixtral's per-expert w1 = gate, w3 = up, w2 = down.
_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
    r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight"
)
_FUSED_EXPERTS = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)"
)
_ROUTER = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.gate\.weight")
_SHARED = re.compile(r"model\.layers\.(\d+)\.mlp\.shared_expert\.(gate|up|down)_proj\.weight")
_KIND = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up",
         "down_proj": "down"}  # fmt: skip


class MoeForCausalLM(LlamaForCausalLM):
    """Mixtral, Qwen2-MoE and Qwen3-MoE: the llama decoder with sparse MLP layers."""

    def __init__(self, spec: ModelSpec, backend: AttentionBackend, dtype: torch.dtype) -> None:
        assert spec.moe is not None, "MoeForCausalLM needs a MoE spec"
        self.moe_spec: MoeSpec = spec.moe
        super().__init__(spec, backend, dtype)
        self.expert_load = ExpertLoadRecorder(spec.moe.layers, spec.moe.num_experts, "cpu")

    def make_layer(self, index: int, dtype: torch.dtype) -> DecoderLayer:
        moe = self.moe_spec
        if index not in moe.layers:
            return DecoderLayer(self.spec, dtype)
        return DecoderLayer(
            self.spec, dtype, SparseMoeBlock(self.spec, moe, moe.layers.index(index), dtype)
        )

    def moe_blocks(self) -> list[SparseMoeBlock]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoeBlock)]

    def init_buffers(self, device: torch.device) -> None:
        super().init_buffers(device)
        self.expert_load = ExpertLoadRecorder(
            self.moe_spec.layers, self.moe_spec.num_experts, device
        )
        for block in self.moe_blocks():
            block.recorder = self.expert_load

    def _target(self, name: str) -> tuple[str, str | None, str] | None:
        match = _EXPERT.fullmatch(name)
        if match:
            layer, expert, proj = match.groups()
            return f"layers.{layer}.mlp.experts", f"{_KIND[proj]}:{expert}", "weight"
        match = _FUSED_EXPERTS.fullmatch(name)
        if match:
            layer, param = match.groups()
            shard = "gate_up" if param == "gate_up_proj" else "down"
            return f"layers.{layer}.mlp.experts", shard, param
        match = _ROUTER.fullmatch(name)
        if match:
            return f"layers.{match.group(1)}.mlp.gate", None, "weight"
        match = _SHARED.fullmatch(name)
        if match:
            layer, proj = match.groups()
            if proj == "down":
                return f"layers.{layer}.mlp.shared_expert.down_proj", None, "weight"
            return f"layers.{layer}.mlp.shared_expert.gate_up_proj", proj, "weight"
        return super()._target(name)
