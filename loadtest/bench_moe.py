"""One MoE layer on CPU: our grouped experts against the naive per-token loop and against
transformers' own sparse MoE block, same weights, same inputs, same run.

Implementations timed (all float32, routing included):
- ``grouped``: common/models/moe.py as the engine runs it: tokens sorted by expert, one
  fused gate_up matmul and one down matmul per active expert;
- ``grouped_mm``: the same sort, the experts through torch's grouped GEMM (what CUDA uses);
- ``per-token``: the naive loop, every (token, expert) pair its own two matmuls;
- ``hf eager`` / ``hf grouped_mm``: transformers' MixtralSparseMoeBlock or
  Qwen3MoeSparseMoeBlock with ``experts_implementation`` eager (a loop over experts with a
  one-hot mask) or grouped_mm (its default when available).

Each figure is the median of repeated calls, the implementations called in turn, one call
each per round in a rotating order (at least ``--min-repeats`` rounds, at least
``--min-seconds`` per implementation); the ratios divide figures measured in the same
rounds, so a busy machine shifts them less than the absolute times. Outputs are checked against ours (max |diff|).

    .venv/bin/python loadtest/bench_moe.py [--tokens 8,64,512] [--shapes mixtral,qwen3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import common.openmp  # noqa: F401  (before torch, run as a script too: OpenMP's wait policy)

# isort: split
import torch

from common.contract.model_spec import ModelSpec, MoeSpec, RopeSpec
from common.models.moe import SparseMoeBlock


@dataclass(frozen=True)
class Shape:
    name: str
    model_type: str
    hidden: int
    experts: int
    top_k: int
    intermediate: int
    norm_topk_prob: bool


# Scaled-down Mixtral-8x7B (H 4096, I 14336, 8 experts, top-2) and Qwen3-30B-A3B (H 2048,
# I 768, 128 experts, top-8): same expert counts and top-k, a CPU-sized hidden size.
SHAPES = {
    "mixtral": Shape("mixtral", "mixtral", 512, 8, 2, 1792, True),
    "qwen3": Shape("qwen3", "qwen3_moe", 512, 64, 8, 192, True),
}


def our_block(shape: Shape, seed: int) -> SparseMoeBlock:
    spec = ModelSpec(
        model_type=shape.model_type, architecture="bench", vocab_size=16,
        hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_layers=1,
        num_heads=4, num_kv_heads=4, head_dim=shape.hidden // 4, rms_norm_eps=1e-6,
        max_position_embeddings=64, rope=RopeSpec(theta=1e4), tie_word_embeddings=False,
    )  # fmt: skip
    moe = MoeSpec(
        num_experts=shape.experts, top_k=shape.top_k, expert_intermediate_size=shape.intermediate,
        norm_topk_prob=shape.norm_topk_prob, layers=(0,),
        float32_routing_weights=shape.model_type == "mixtral",
    )  # fmt: skip
    block = SparseMoeBlock(spec, moe, slot=0, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * param.shape[-1] ** -0.5)
    return block.eval()


def hf_block(shape: Shape, ours: SparseMoeBlock, implementation: str) -> Any:
    """transformers' sparse MoE block for the shape, carrying our block's weights."""
    from transformers import AutoConfig

    block_class: Any
    if shape.model_type == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        block_class = MixtralSparseMoeBlock
        config = AutoConfig.for_model(
            "mixtral", hidden_size=shape.hidden, intermediate_size=shape.intermediate,
            num_local_experts=shape.experts, num_experts_per_tok=shape.top_k,
        )  # fmt: skip
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        block_class = Qwen3MoeSparseMoeBlock
        config = AutoConfig.for_model(
            "qwen3_moe", hidden_size=shape.hidden, moe_intermediate_size=shape.intermediate,
            num_experts=shape.experts, num_experts_per_tok=shape.top_k,
            norm_topk_prob=shape.norm_topk_prob,
        )  # fmt: skip
    config._experts_implementation = implementation
    block = block_class(config).eval()
    with torch.no_grad():
        block.gate.weight.copy_(ours.gate.weight)
        block.experts.gate_up_proj.copy_(ours.experts.gate_up_proj)
        block.experts.down_proj.copy_(ours.experts.down_proj)
    return block


def median_ms(
    candidates: dict[str, Callable[[], torch.Tensor]], min_repeats: int, min_seconds: float
) -> dict[str, float]:
    """Median ms per call of each candidate, called round-robin (one call each per round,
    the order rotated every round) so that a load change on the machine, or what the
    previous call left in the caches, hits them all alike."""
    for fn in candidates.values():
        fn()  # warm-up
    names = list(candidates)
    times: dict[str, list[float]] = {name: [] for name in names}
    start = time.perf_counter()
    rounds = 0
    while rounds < min_repeats or time.perf_counter() - start < min_seconds * len(names):
        shift = rounds % len(names)
        for name in names[shift:] + names[:shift]:
            t0 = time.perf_counter()
            candidates[name]()
            times[name].append(time.perf_counter() - t0)
        rounds += 1
        if rounds >= 1000:
            break
    return {name: statistics.median(ts) * 1000 for name, ts in times.items()}


def _hf_call(block: Any, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    def call() -> torch.Tensor:
        return block(x.unsqueeze(0))[0]

    return call


@torch.inference_mode()
def bench_shape(
    shape: Shape, tokens: int, args: argparse.Namespace, with_hf: bool
) -> dict[str, Any]:
    ours = our_block(shape, args.seed)
    x = torch.randn(tokens, shape.hidden, generator=torch.Generator().manual_seed(args.seed + 1))
    weights, ids = ours.route(x)
    candidates: dict[str, Callable[[], torch.Tensor]] = {
        "grouped": lambda: ours.grouped_experts(x, *ours.route(x), method="loop"),
    }
    if hasattr(torch.nn.functional, "grouped_mm"):
        candidates["grouped_mm"] = lambda: ours.grouped_experts(
            x, *ours.route(x), method="grouped_mm"
        )
    if tokens * shape.top_k <= args.max_naive_pairs:
        candidates["per-token"] = lambda: ours.per_token_experts(x, *ours.route(x))
    if with_hf:
        for implementation in ("eager", "grouped_mm"):
            try:
                block = hf_block(shape, ours, implementation)
                block(x.unsqueeze(0))
            except Exception as exc:  # an implementation this transformers lacks
                print(f"  (transformers {implementation}: {type(exc).__name__}: {exc})")
                continue
            candidates[f"hf {implementation}"] = _hf_call(block, x)

    reference = ours.grouped_experts(x, weights, ids, method="loop")
    result: dict[str, Any] = {
        "shape": shape.name, "tokens": tokens, "experts": shape.experts, "top_k": shape.top_k,
        "hidden": shape.hidden, "intermediate": shape.intermediate,
        "active_experts": int(torch.unique(ids).numel()), "ms": {}, "max_abs_diff": {},
    }  # fmt: skip
    for name, fn in candidates.items():
        out = fn()
        result["max_abs_diff"][name] = float((out.reshape(reference.shape) - reference).abs().max())
    result["ms"] = median_ms(candidates, args.min_repeats, args.min_seconds)
    base = result["ms"]["grouped"]
    result["ratio_vs_grouped"] = {name: ms / base for name, ms in result["ms"].items()}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="mixtral,qwen3", help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--tokens", default="8,64,512", help="tokens per call (comma list)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument("--min-repeats", type=int, default=5)
    parser.add_argument("--min-seconds", type=float, default=1.0)
    parser.add_argument("--max-naive-pairs", type=int, default=4096,
                        help="skip the per-token loop above this many (token, expert) pairs")  # fmt: skip
    parser.add_argument("--no-hf", action="store_true", help="skip transformers' blocks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, CPU")
    results = []
    for shape_name in args.shapes.split(","):
        shape = SHAPES[shape_name]
        print(
            f"\n{shape.name}: hidden {shape.hidden}, {shape.experts} experts, top-{shape.top_k}, "
            f"expert intermediate {shape.intermediate}"
        )
        for tokens in (int(t) for t in args.tokens.split(",")):
            result = bench_shape(shape, tokens, args, with_hf=not args.no_hf)
            results.append(result)
            print(f"  {tokens} tokens ({result['active_experts']} experts active):")
            for name, ms in result["ms"].items():
                ratio = result["ratio_vs_grouped"][name]
                print(
                    f"    {name:<14} {ms:9.2f} ms  {tokens / ms * 1000:10.0f} tok/s  "
                    f"x{ratio:6.2f} vs grouped   max|diff| {result['max_abs_diff'][name]:.1e}"
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
