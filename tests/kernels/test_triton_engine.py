"""The engine on the Triton backend against the torch backend: same greedy tokens.

Runs through Triton's interpreter on CPU (conftest.py sets TRITON_INTERPRET=1), so the models
are one layer deep and the runs short. Each run mixes chunked prefill with decodes in one step
(token budget 16) and ends with a prefix-cache hit. Also here, because they need Triton: the
torch backend's quantized KV write against kernels.write_kv_ref, bit for bit.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import common.engine.attention.triton_backend as triton_backend
from common.contract.sampling import SamplingParams
from common.engine.attention import LayerKV
from common.engine.attention.torch_kv import write_kv_torch
from common.engine.engine import Engine
from common.engine.sampler import SampleResult
from kernels import new_kv_scales, write_kv_ref
from tests.factories import make_tiny_checkpoint, random_prompts, tiny_engine

MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-mha": ("llama", dict(num_key_value_heads=4)),
    "llama-gqa": ("llama", {}),
    "mistral-window": ("mistral", dict(sliding_window=24, head_dim=16)),
}
NEW_TOKENS = 6
KERNELS = ("write_kv", "paged_decode_attention", "paged_prefill_attention", "rms_norm",
           "apply_rotary")  # fmt: skip


def _checkpoint(tmp_path: Path, name: str) -> Path:
    model_type, overrides = MODELS[name]
    return make_tiny_checkpoint(tmp_path / name, model_type, num_hidden_layers=1, **overrides)


def _run(engine: Engine) -> tuple[dict[str, list[int]], list[torch.Tensor], int]:
    """Two waves of requests; the second shares 2 full blocks with the first wave's longest
    prompt. Returns tokens per request, every sampled logits row, and the cached tokens."""
    short, medium, long, tail = random_prompts(384, [1, 7, 40, 5], seed=4)
    logits: list[torch.Tensor] = []
    sampler = engine.sampler

    def recording(rows: torch.Tensor, requests: list) -> SampleResult:
        logits.extend(row.clone() for row in rows)
        return sampler(rows, requests)

    engine.sampler = recording  # type: ignore[assignment]
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    num_cached = 0
    for wave in ({"short": short, "medium": medium, "long": long}, {"hit": long[:32] + tail}):
        for request_id, prompt in wave.items():
            engine.add_request(request_id, prompt, params)
            outputs[request_id] = []
        while engine.has_unfinished():
            for out in engine.step():
                outputs[out.request_id] += out.new_token_ids
                num_cached = max(num_cached, out.num_cached_tokens)
    return outputs, logits, num_cached


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts the Triton backend's kernel launches (by wrapper name)."""
    calls: Counter[str] = Counter()
    for name in KERNELS:
        kernel = getattr(triton_backend, name)

        def counted(*args: Any, _kernel: Any = kernel, _name: str = name, **kwargs: Any) -> Any:
            calls[_name] += 1
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(triton_backend, name, counted)
    return calls


@pytest.mark.parametrize("model", list(MODELS))
def test_triton_backend_matches_torch_backend(
    model: str, tmp_path: Path, kernel_calls: Counter[str]
) -> None:
    ckpt = _checkpoint(tmp_path, model)
    want, want_logits, _ = _run(tiny_engine(ckpt, max_num_batched_tokens=16))
    assert not kernel_calls, "the torch backend launched Triton kernels"

    engine = tiny_engine(ckpt, max_num_batched_tokens=16, attention_backend="triton")
    assert isinstance(engine.runner.backend, triton_backend.TritonAttentionBackend)
    got, got_logits, num_cached = _run(engine)
    assert num_cached == 32  # the second wave hit the prefix cache
    assert got == want
    max_diff = max((a - b).abs().max().item() for a, b in zip(got_logits, want_logits, strict=True))
    print(f"{model}: triton vs torch backend max |logit diff| {max_diff:.2e}")
    assert max_diff < 1e-3
    assert set(kernel_calls) == set(KERNELS), kernel_calls  # every op went through a kernel
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_triton_int8_kv_matches_torch_int8_kv(tmp_path: Path, kernel_calls: Counter[str]) -> None:
    """Both backends store the same codes and scales and dequantize the same way, so they
    agree as closely as on float KV (measured max |logit diff| ~1e-5)."""
    ckpt = _checkpoint(tmp_path, "llama-gqa")
    want, want_logits, _ = _run(tiny_engine(ckpt, max_num_batched_tokens=16, kv_dtype="int8"))
    engine = tiny_engine(
        ckpt, max_num_batched_tokens=16, kv_dtype="int8", attention_backend="triton"
    )
    got, got_logits, num_cached = _run(engine)
    assert num_cached == 32
    assert got == want
    max_diff = max((a - b).abs().max().item() for a, b in zip(got_logits, want_logits, strict=True))
    print(f"int8 KV: triton vs torch backend max |logit diff| {max_diff:.2e}")
    assert max_diff < 1e-3
    assert kernel_calls["write_kv"] > 0 and kernel_calls["paged_decode_attention"] > 0
    assert engine.runner.kv_scales is not None


def test_triton_backend_refuses_cpu_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_backend.triton.knobs.runtime, "interpret", False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        triton_backend.TritonAttentionBackend(torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_torch_quantized_write_matches_kernel_reference(dtype: torch.dtype) -> None:
    """The engine's vectorised torch write (common/engine/attention/torch_kv.py) stores the
    same codes and scales as kernels.write_kv_ref: prefill of two sequences out of order,
    growing decodes (re-encoding), a reused block restarting at offset 0."""
    num_blocks, block_size, num_kv_heads, head_dim = 8, 4, 2, 8
    generator = torch.Generator().manual_seed(1)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    stale = [torch.randn(shape, generator=generator).to(dtype) for _ in range(2)]
    scales = [new_kv_scales(num_blocks, num_kv_heads, "cpu") for _ in range(4)]
    ours = LayerKV(stale[0].clone(), stale[1].clone(), scales[0], scales[1])
    ref = LayerKV(stale[0].clone(), stale[1].clone(), scales[2], scales[3])
    steps = [
        ([9, 8, 20, 21, 10, 22, 4, 5, 6, 7], 1.0),
        ([11, 23], 10.0),
        ([12, 24], 100.0),
        ([13, 25, 14], 0.5),
        ([8, 9], 0.01),  # block 2 restarts
        ([28, 29, 31], 1.0),
        ([30], 50.0),  # grows block 7 after offset 3 was written
    ]
    for slots, magnitude in steps:
        k = magnitude * torch.randn(len(slots), num_kv_heads, head_dim, generator=generator)
        v = magnitude * torch.randn(len(slots), num_kv_heads, head_dim, generator=generator)
        slot_mapping = torch.tensor(slots)
        write_kv_torch(k, v, ours, slot_mapping)
        write_kv_ref(k, v, ref.k_cache, ref.v_cache, slot_mapping, ref.k_scale, ref.v_scale)
        for got, want in ((ours.k_cache, ref.k_cache), (ours.v_cache, ref.v_cache)):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(scales[0], scales[2]) and torch.equal(scales[1], scales[3])
