"""The fused decode step (kernels/cpu/decode_model.cpp via common/models/quant/fused_decode.py)
against the Python path it replaces: the same kernels in the same order, so every decode
step's logits are bit for bit equal (torch.equal), for each dense family it serves; and it
stays off where it does not apply."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from common.contract.sampling import SamplingParams
from common.engine.engine import Engine
from kernels.cpu import available
from kernels.cpu.kquant import kq_available
from tests.factories import make_tiny_checkpoint, random_prompts, tiny_engine

pytestmark = [
    pytest.mark.skipif(not available(), reason="the C++ CPU kernels do not build here"),
    pytest.mark.usefixtures("one_thread"),
]

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-tied": ("llama", dict(intermediate_size=128, tie_word_embeddings=True)),
    "qwen2-bias": ("qwen2", dict(intermediate_size=128)),
    "qwen3-qknorm": ("qwen3", dict(intermediate_size=128, head_dim=32)),
    "mistral-window": ("mistral", dict(intermediate_size=128, sliding_window=24)),
}
QUANTIZATIONS = [("int4", 16), ("int8", 16), ("int4", 8)]  # (format, activation bits)


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_type, overrides = FAMILIES[request.param]
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fused") / request.param, model_type,
                                **overrides)  # fmt: skip


def _engine(ckpt: Path, quantization: str, act_bits: int, fused: bool) -> Engine:
    return tiny_engine(ckpt, quantization=quantization, quant_act_bits=act_bits,
                       fused_decode=fused)  # fmt: skip


def _decode_logits(engine: Engine) -> tuple[dict[str, list[int]], list[torch.Tensor]]:
    """Greedy tokens of 3 concurrent requests (prompts longer than the sliding window, so it
    bites), and the logits of every step that sampled only decode rows."""
    recorded: list[torch.Tensor] = []
    sampler = engine.sampler

    def recording(logits: torch.Tensor, requests: list) -> object:
        if all(r.num_computed_tokens >= r.num_prompt_tokens for r in requests):
            recorded.append(logits.clone())
        return sampler(logits, requests)

    engine.sampler = recording  # type: ignore[assignment]
    prompts = random_prompts(384, [5, 30, 47], seed=3)
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=12 + 4 * i, ignore_eos=True))
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens, recorded


def _assert_same_decode_steps(python: Engine, fused: Engine) -> None:
    """The same greedy tokens, and every decode step's logits bit for bit."""
    python_tokens, python_logits = _decode_logits(python)
    fused_tokens, fused_logits = _decode_logits(fused)
    assert fused_tokens == python_tokens
    assert len(fused_logits) == len(python_logits) >= 10
    for step, (a, b) in enumerate(zip(fused_logits, python_logits, strict=True)):
        assert torch.equal(a, b), f"step {step}: max |diff| {(a - b).abs().max().item()}"


@pytest.mark.parametrize(("quantization", "act_bits"), QUANTIZATIONS)
def test_fused_decode_steps_equal_the_python_path_bit_for_bit(
    checkpoint: Path, quantization: str, act_bits: int
) -> None:
    python = _engine(checkpoint, quantization, act_bits, fused=False)
    fused = _engine(checkpoint, quantization, act_bits, fused=True)
    assert python.runner.model.fused_decoder is None
    assert fused.runner.model.fused_decoder is not None
    assert fused.runner.backend.name == "cpp"
    _assert_same_decode_steps(python, fused)
    assert fused.kv.pool.num_free == fused.kv.pool.num_blocks


@pytest.mark.skipif(not available(), reason="the C++ kernels are not built here")
@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_fused_decode_takes_a_half_kv_cache_bit_for_bit(checkpoint: Path, kv_dtype: str) -> None:
    """--kv-dtype float16 / bfloat16 on float32 activations: both paths write and read the
    cache through the C++ kernels, the fused step bit for bit the Python one."""
    python = tiny_engine(checkpoint, quantization="int4", quant_act_bits=16, fused_decode=False,
                         kv_dtype=kv_dtype)  # fmt: skip
    fused = tiny_engine(checkpoint, quantization="int4", quant_act_bits=16, fused_decode=True,
                        kv_dtype=kv_dtype)  # fmt: skip
    assert fused.runner.kv_dtype == getattr(torch, kv_dtype)
    assert fused.runner.model.fused_decoder is not None
    assert all(python.runner.backend.takes(kv) for kv in python.runner.layer_kv)  # type: ignore[attr-defined]
    _assert_same_decode_steps(python, fused)


def test_fused_decoder_stays_off_where_it_does_not_apply(tmp_path: Path) -> None:
    llama = make_tiny_checkpoint(tmp_path / "llama", "llama", intermediate_size=128)
    moe = make_tiny_checkpoint(
        tmp_path / "moe", "qwen3_moe", intermediate_size=128, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=64, head_dim=32,
    )  # fmt: skip
    off = {
        "float weights": tiny_engine(llama, quantization="none"),
        "torch kernels": tiny_engine(llama, quantization="int8", quant_kernel="torch"),
        "torch attention": tiny_engine(llama, quantization="int8", attention_backend="torch"),
        "int8 KV": tiny_engine(llama, quantization="int8", kv_dtype="int8"),
        "mixture of experts": tiny_engine(moe, quantization="int8"),
    }
    for why, engine in off.items():
        assert engine.runner.model.fused_decoder is None, why


DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.mark.skipif(not available() or not kq_available(), reason="no KQx16 kernels here")
@pytest.mark.parametrize(
    ("model", "act_bits"),
    [
        ("gptq/llama-gptq-w4-g64-asym-actorder", 16),  # integer codes: zero points, act order
        ("gptq/qwen2-gptq-w4-g128-actorder", 16),  # act order, biases
        ("kquants/tiny-llama-Q4_K_M.gguf", 16),  # K-quants mixed with Q8_0 / Q6_K tensors
        ("kquants/tiny-llama-Q3_K_M.gguf", 16),
        ("kquants/tiny-llama-Q4_K_M.gguf", 8),  # int8 activation codes (--quant-act-bits 8)
        ("kquants/tiny-llama-Q5_K_M.gguf", 8),
    ],
)
def test_fused_decode_takes_kqx16_layers_bit_for_bit(model: str, act_bits: int) -> None:
    """KQx16 projections (K-quants, GPTQ / AWQ / compressed-tensors integer codes) in the
    fused step: the same kernel as the Python path's, so the same logits bit for bit, with
    16- or 8-bit activation codes."""
    from common.models.default_model import resolve_model
    from common.models.quant.linear import QuantLinear
    from kernels.cpu.kquant import KQx16

    path = resolve_model(str(DATA / model))
    python = tiny_engine(path, quantization="auto", fused_decode=False, quant_act_bits=act_bits)
    fused = tiny_engine(path, quantization="auto", fused_decode=True, quant_act_bits=act_bits)
    assert fused.runner.model.fused_decoder is not None
    kq = [
        m for m in fused.runner.model.modules()
        if isinstance(m, QuantLinear) and isinstance(m.parts[0].weight, KQx16)
    ]  # fmt: skip
    assert kq, "the model should have KQx16 layers"
    _assert_same_decode_steps(python, fused)


@pytest.mark.parametrize("name", ["llama-fp8", "llama-fp8-dynamic", "qwen3-fp8-dynamic", "llama-w8a8"])
def test_fused_decode_takes_fp8_and_w8a8_layers_bit_for_bit(ct_checkpoints: Path, name: str) -> None:
    """llm-compressor's FP8 (static and dynamic activations) and W8A8 checkpoints in the fused
    step: each layer's input quantized as the Python path quantizes it (fp8.py's operations,
    the KQx16 kernel's int8 tokens), the same kernels, so the same logits bit for bit."""
    from common.models.quant.fp8 import Fp8Weight
    from common.models.quant.linear import QuantLinear

    python = tiny_engine(ct_checkpoints / name, quantization="auto", fused_decode=False)
    fused = tiny_engine(ct_checkpoints / name, quantization="auto", fused_decode=True)
    assert fused.runner.model.fused_decoder is not None
    fp8 = [
        m for m in fused.runner.model.modules()
        if isinstance(m, QuantLinear) and isinstance(m.parts[0].weight, Fp8Weight)
    ]  # fmt: skip
    assert bool(fp8) == ("fp8" in name)
    _assert_same_decode_steps(python, fused)
