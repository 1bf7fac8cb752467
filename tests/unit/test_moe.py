"""MoE models beyond greedy parity (tests/unit/test_model_parity.py): configs, both weight
layouts, grouped vs per-token experts, and the expert-load counts against the router."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from common.contract.model_spec import ModelSpec, MoeSpec, RopeSpec, load_spec
from common.contract.sampling import SamplingParams
from common.engine.attention.torch_backend import TorchAttentionBackend
from common.experts.counts import DECODE, PREFILL
from common.models.loader import build_model
from common.models.moe import ExpertLoadRecorder, MoeForCausalLM, SparseMoeBlock
from tests.factories import (
    TINY_MOE,
    make_tiny_moe_checkpoint,
    random_prompts,
    run_to_completion,
    tiny_engine,
)


@pytest.fixture(scope="module", params=list(TINY_MOE))
def moe_ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    family = request.param
    return make_tiny_moe_checkpoint(tmp_path_factory.mktemp("moe") / family, family)


def _model(ckpt: Path) -> MoeForCausalLM:
    spec = load_spec(ckpt)
    model = build_model(spec, ckpt, TorchAttentionBackend(), torch.float32, torch.device("cpu"))
    assert isinstance(model, MoeForCausalLM)
    return model


def test_specs_follow_each_familys_config(tmp_path: Path) -> None:
    mixtral = load_spec(make_tiny_moe_checkpoint(tmp_path / "m", "mixtral"))
    assert mixtral.moe == MoeSpec(
        num_experts=8, top_k=2, expert_intermediate_size=112, norm_topk_prob=True,
        layers=(0, 1), float32_routing_weights=True,
    )  # fmt: skip
    qwen2 = load_spec(make_tiny_moe_checkpoint(tmp_path / "q2", "qwen2_moe"))
    assert qwen2.moe is not None and qwen2.qkv_bias and not qwen2.qk_norm
    assert (qwen2.moe.norm_topk_prob, qwen2.moe.shared_expert_intermediate_size) == (False, 48)
    qwen3 = load_spec(
        make_tiny_moe_checkpoint(
            tmp_path / "q3", "qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2,
            mlp_only_layers=[3],
        )
    )  # fmt: skip
    assert qwen3.qk_norm and qwen3.moe is not None and qwen3.moe.norm_topk_prob
    assert qwen3.moe.layers == (1,)  # (i + 1) % 2 == 0 picks 1 and 3; 3 is dense
    assert qwen3.moe.shared_expert_intermediate_size == 0


def test_grouped_experts_equal_the_per_token_loop(moe_ckpt: Path) -> None:
    model = _model(moe_ckpt)
    block = model.moe_blocks()[0]
    x = torch.randn(37, model.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    weights, ids = block.route(x)
    grouped = block.grouped_experts(x, weights, ids, method="loop")
    naive = block.per_token_experts(x, weights, ids)
    torch.testing.assert_close(grouped, naive, rtol=1e-5, atol=1e-5)
    # torch's grouped GEMM (what CUDA uses when it can: no host read of the run lengths).
    if hasattr(torch.nn.functional, "grouped_mm"):
        torch.testing.assert_close(
            block.grouped_experts(x, weights, ids, method="grouped_mm"),
            grouped,
            rtol=1e-5,
            atol=1e-5,
        )
    assert block(x).shape == x.shape and block._grouped_mm is False  # CPU: the loop


def test_fused_expert_layout_loads_the_same_weights(moe_ckpt: Path, tmp_path: Path) -> None:
    """transformers 5 holds experts fused (mlp.experts.gate_up_proj [E, 2I, H]); a
    checkpoint saved from that state dict as-is loads to the same parameters."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(moe_ckpt), dtype=torch.float32)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state), sorted(state)[:12]
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(moe_ckpt / "config.json", fused / "config.json")
    save_file(state, str(fused / "model.safetensors"))
    ours, from_fused = _model(moe_ckpt).state_dict(), _model(fused).state_dict()
    assert ours.keys() == from_fused.keys()
    for name, tensor in ours.items():
        torch.testing.assert_close(from_fused[name], tensor, rtol=0, atol=0, msg=name)


def test_a_missing_expert_is_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    ckpt = make_tiny_moe_checkpoint(tmp_path / "m", "mixtral")
    weights = load_file(str(ckpt / "model.safetensors"))
    del weights["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(weights, str(ckpt / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.gate_up_proj#up:5"):
        _model(ckpt)


def _block_with_known_router(top_k: int, norm: bool) -> SparseMoeBlock:
    """A 4-expert block whose router scores expert e by 10 * x[e]: the routing of a token is
    whatever its first 4 features say."""
    spec = _spec_around_block(hidden=8)
    moe = MoeSpec(num_experts=4, top_k=top_k, expert_intermediate_size=4, norm_topk_prob=norm,
                  layers=(0,))  # fmt: skip
    block = SparseMoeBlock(spec, moe, slot=0, dtype=torch.float32)
    with torch.no_grad():
        block.gate.weight.zero_()
        for e in range(4):
            block.gate.weight[e, e] = 10.0
        block.experts.gate_up_proj.normal_()
        block.experts.down_proj.normal_()
    return block


def _spec_around_block(hidden: int) -> ModelSpec:
    return ModelSpec(
        model_type="mixtral", architecture="MixtralForCausalLM", vocab_size=16,
        hidden_size=hidden, intermediate_size=4, num_layers=1, num_heads=2, num_kv_heads=2,
        head_dim=4, rms_norm_eps=1e-6, max_position_embeddings=64, rope=RopeSpec(theta=1e4),
        tie_word_embeddings=False,
    )  # fmt: skip


def test_counts_for_a_known_routing_are_the_top_k_choices() -> None:
    block = _block_with_known_router(top_k=2, norm=True)
    recorder = ExpertLoadRecorder((5,), 4, "cpu")
    block.recorder = recorder
    # Each token names its two experts (largest features first); 3 decode tokens lead.
    choices = [(0, 1), (0, 2), (0, 1), (3, 2), (3, 0), (1, 2), (2, 3)]
    x = torch.zeros(len(choices), 8)
    for t, (first, second) in enumerate(choices):
        x[t, first], x[t, second] = 2.0, 1.0
    weights, ids = block.route(x)
    assert [tuple(row) for row in ids.tolist()] == choices
    torch.testing.assert_close(weights.sum(-1), torch.ones(len(choices)))  # renormalised
    recorder.num_decode_tokens = 3
    block(x)
    snapshot = recorder.snapshot()
    assert snapshot.layers == (5,)
    assert snapshot.counts[DECODE][0] == (3, 2, 1, 0)  # (0,1) (0,2) (0,1)
    assert snapshot.counts[PREFILL][0] == (1, 1, 3, 3)  # (3,2) (3,0) (1,2) (2,3)
    block(x)  # accumulates
    assert recorder.snapshot().counts[DECODE][0] == (6, 4, 2, 0)


def test_qwen_routing_without_renormalisation_keeps_softmax_weights() -> None:
    block = _block_with_known_router(top_k=2, norm=False)
    x = torch.zeros(1, 8)
    x[0, 1], x[0, 3] = 1.0, 0.5
    weights, ids = block.route(x)
    probs = torch.softmax(torch.tensor([0.0, 10.0, 0.0, 5.0]), -1)
    assert ids.tolist() == [[1, 3]]
    torch.testing.assert_close(weights[0], probs[[1, 3]])


def test_engine_counts_equal_transformers_router_choices(moe_ckpt: Path) -> None:
    """Prefill and decode counts per layer and expert equal the top-k of transformers'
    router logits over the same tokens (teacher-forced on what the engine generated)."""
    from transformers import AutoModelForCausalLM

    prompts = random_prompts(384, [23, 9], seed=3)
    engine = tiny_engine(moe_ckpt, max_num_batched_tokens=16)  # chunked prefill + decodes
    new_tokens = 6
    out = run_to_completion(
        engine,
        {f"r{i}": p for i, p in enumerate(prompts)},
        SamplingParams(max_tokens=new_tokens, ignore_eos=True),
    )
    counts = engine.expert_counts()
    assert counts is not None
    moe = engine.spec.moe
    assert moe is not None and counts.layers == moe.layers

    hf = AutoModelForCausalLM.from_pretrained(str(moe_ckpt), dtype=torch.float32).eval()
    expected = torch.zeros(2, len(moe.layers), moe.num_experts, dtype=torch.long)
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            fed = prompt + out[f"r{i}"][:-1]  # the last token is sampled, never fed back
            result = hf(torch.tensor([fed]), output_router_logits=True)
            assert len(result.router_logits) == len(moe.layers)
            for slot, logits in enumerate(result.router_logits):
                top = torch.topk(logits.float(), moe.top_k, dim=-1).indices  # [T, k]
                for phase, rows in ((PREFILL, top[: len(prompt)]), (DECODE, top[len(prompt) :])):
                    expected[phase, slot] += torch.bincount(
                        rows.reshape(-1), minlength=moe.num_experts
                    )
    assert expected[DECODE].sum() == len(prompts) * (new_tokens - 1) * moe.top_k * len(moe.layers)
    assert torch.tensor(counts.counts).tolist() == expected.tolist()


def test_dense_models_have_no_expert_counts(tmp_path: Path) -> None:
    from tests.factories import make_tiny_checkpoint

    engine = tiny_engine(make_tiny_checkpoint(tmp_path / "llama", "llama"))
    assert engine.expert_counts() is None


def test_unsupported_moe_options_are_refused(tmp_path: Path) -> None:
    from common.contract.model_spec import UnsupportedModelError

    ckpt = make_tiny_moe_checkpoint(tmp_path / "m", "mixtral")
    config = json.loads((ckpt / "config.json").read_text())
    config["hidden_act"] = "gelu"
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="gelu"):
        load_spec(ckpt)
