"""Quantized KV (int8 / fp8) in the engine on the torch backend, and the engine's KV/backend config.

Agreement with float KV is measured two ways on a tiny random llama (float32 model):
free-running greedy (a random model is chaotic, so one flipped near-tie changes everything after
it), and teacher-forced, where both engines are fed the float run's tokens and every step's
argmax and logits are compared at the same context. Measured (8 prompts x 32 tokens):

    kv      free-running (until 1st divergence / overall)   forced top-1   max |dlogit|   rms
    int8    0.31 / 0.32                                     0.914          0.59           0.066
    fp8     0.25 / 0.28                                     0.883          1.68           0.171

Logits of this model reach |7.4|. The floors below leave a margin under those figures.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from common.contract.model_spec import load_spec
from common.contract.sampling import SamplingParams
from common.engine.attention import resolve_backend_name
from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.model_runner import kv_bytes_per_block
from common.engine.request import FinishReason, KvImport
from common.engine.sampler import SampleResult
from common.kv.layout import KvLayout
from pdserve.cli.engine_args import add_engine_args, engine_config_from_args
from tests.factories import make_tiny_checkpoint, random_prompts, run_to_completion, tiny_engine

PROMPT_LENGTHS = [1, 7, 16, 33, 70, 5, 40, 100]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", "llama")


def greedy_run(
    engine: Engine, prompts: list[list[int]], forced: list[list[int]] | None = None
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens and per-step logits [steps, V] per prompt. With ``forced``, each step
    continues with the forced token instead of its own argmax (teacher forcing)."""
    recorded: dict[str, list[torch.Tensor]] = {}
    sampler = engine.sampler

    def recording_sampler(logits: torch.Tensor, requests: list) -> SampleResult:
        for row, req in zip(logits, requests, strict=True):
            recorded.setdefault(req.request_id, []).append(row.clone())
        result = sampler(logits, requests)
        if forced is not None:
            result.token_ids = [forced[int(r.request_id)][r.num_output_tokens] for r in requests]
        return result

    engine.sampler = recording_sampler  # type: ignore[assignment]
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
    ids = [str(i) for i in range(len(prompts))]
    return [outputs[i] for i in ids], [torch.stack(recorded[i]) for i in ids]


def agreement(want: list[list[int]], got: list[list[int]]) -> tuple[float, float]:
    """(fraction of positions before each sequence's first divergence, fraction equal)."""
    total = sum(len(w) for w in want)
    before_divergence = sum(
        next((i for i, (a, b) in enumerate(zip(w, g, strict=True)) if a != b), len(w))
        for w, g in zip(want, got, strict=True)
    )
    equal = sum(a == b for w, g in zip(want, got, strict=True) for a, b in zip(w, g, strict=True))
    return before_divergence / total, equal / total


@pytest.fixture(scope="module")
def float_run(ckpt: Path) -> tuple[list[list[int]], list[torch.Tensor]]:
    prompts = random_prompts(384, PROMPT_LENGTHS, seed=1)
    return greedy_run(tiny_engine(ckpt, max_num_batched_tokens=40), prompts)


@pytest.mark.parametrize(
    ("kv_dtype", "min_forced_top1", "max_abs", "max_rms"),
    [("int8", 0.85, 1.0, 0.1), ("fp8", 0.80, 2.5, 0.25)],
)
def test_quantized_kv_stays_close_to_float_kv(
    ckpt: Path,
    float_run: tuple[list[list[int]], list[torch.Tensor]],
    kv_dtype: str,
    min_forced_top1: float,
    max_abs: float,
    max_rms: float,
) -> None:
    prompts = random_prompts(384, PROMPT_LENGTHS, seed=1)
    want_tokens, want_logits = float_run

    # A small token budget mixes chunked prefill with decodes.
    engine = tiny_engine(ckpt, max_num_batched_tokens=40, kv_dtype=kv_dtype)
    expected_dtype = torch.int8 if kv_dtype == "int8" else torch.float8_e4m3fn
    assert engine.runner.kv_cache.dtype == expected_dtype
    free_tokens, _ = greedy_run(engine, prompts)
    prefix, overall = agreement(want_tokens, free_tokens)
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks

    forced = tiny_engine(ckpt, max_num_batched_tokens=40, kv_dtype=kv_dtype)
    _, got_logits = greedy_run(forced, prompts, forced=want_tokens)
    want_all, got_all = torch.cat(want_logits), torch.cat(got_logits)  # [steps, V]
    top1 = (want_all.argmax(-1) == got_all.argmax(-1)).float().mean().item()
    diff = got_all - want_all
    max_diff, rms_diff = diff.abs().max().item(), diff.pow(2).mean().sqrt().item()
    print(
        f"{kv_dtype} KV vs float KV: free-running agreement {prefix:.3f} until divergence, "
        f"{overall:.3f} overall; teacher-forced top-1 {top1:.3f}, max |dlogit| {max_diff:.3f}, "
        f"rms {rms_diff:.4f}"
    )
    assert top1 >= min_forced_top1
    assert max_diff < max_abs and rms_diff < max_rms
    # The first token of each prompt depends on quantized prefill attention only.
    assert sum(w[0] == g[0] for w, g in zip(want_tokens, free_tokens, strict=True)) >= 6


def test_reused_block_starts_with_a_fresh_scale(ckpt: Path) -> None:
    """A block freed by one request and reused by the next must not keep the old scale: the
    second request computes exactly what it computes on a fresh engine."""
    long_prompt, short_prompt = random_prompts(384, [100, 20], seed=2)
    params = SamplingParams(max_tokens=8, ignore_eos=True)

    def run(engine: Engine, prompt: list[int], request_id: str) -> list[torch.Tensor]:
        engine.add_request(request_id, prompt, params)
        logits: list[torch.Tensor] = []
        sampler = engine.sampler

        def recording(rows: torch.Tensor, requests: list) -> SampleResult:
            logits.extend(row.clone() for row in rows)
            return sampler(rows, requests)

        engine.sampler = recording  # type: ignore[assignment]
        while engine.has_unfinished():
            engine.step()
        engine.sampler = sampler
        return logits

    for kv_dtype in ("int8", "fp8"):
        # 8 blocks: the long request uses 7, so the short one reuses at least one of them.
        used = tiny_engine(ckpt, kv_dtype=kv_dtype, num_kv_blocks=8, enable_prefix_caching=False)
        run(used, long_prompt, "long")
        again = run(used, short_prompt, "short")
        fresh = run(
            tiny_engine(ckpt, kv_dtype=kv_dtype, num_kv_blocks=8, enable_prefix_caching=False),
            short_prompt,
            "short",
        )
        assert all(torch.equal(a, b) for a, b in zip(again, fresh, strict=True)), kv_dtype


def test_kv_budget_counts_codes_and_scales(ckpt: Path) -> None:
    spec = load_spec(ckpt)  # 2 layers, 2 kv heads, head dim 16
    assert kv_bytes_per_block(spec, 16, torch.float32) == 2 * 2 * 16 * 2 * 16 * 4
    # int8 / fp8: one byte per element plus a float32 scale per (layer, K/V, kv head).
    quant_bytes = 2 * 2 * 16 * 2 * 16 + 2 * 2 * 2 * 4
    assert kv_bytes_per_block(spec, 16, torch.int8) == quant_bytes
    assert kv_bytes_per_block(spec, 16, torch.float8_e4m3fn) == quant_bytes

    budget = dict(num_kv_blocks=None, kv_cache_memory="1MiB")
    assert tiny_engine(ckpt, **budget).runner.num_blocks == 2**20 // 8192
    engine = tiny_engine(ckpt, kv_dtype="int8", **budget)
    runner = engine.runner
    assert runner.num_blocks == 2**20 // quant_bytes
    assert runner.kv_scales is not None
    assert tuple(runner.kv_scales.shape) == (2, 2, runner.num_blocks, 2)
    assert runner.kv_scales.dtype == torch.float32
    layer = runner.layer_kv[1]
    assert layer.k_scale is not None and layer.v_scale is not None
    # Per-layer views share the runner's storage (what the backend writes, the runner holds).
    assert layer.k_cache.data_ptr() == runner.kv_cache[1, 0].data_ptr()
    assert layer.v_scale.data_ptr() == runner.kv_scales[1, 1].data_ptr()
    assert layer.k_scale.is_contiguous() and layer.k_cache.is_contiguous()

    half = tiny_engine(ckpt, kv_dtype="float16")
    assert half.runner.kv_cache.dtype == torch.float16 and half.runner.kv_scales is None


def test_float16_kv_with_float32_model_runs(ckpt: Path) -> None:
    prompts = random_prompts(384, [9, 40], seed=3)
    tokens, _ = greedy_run(tiny_engine(ckpt, kv_dtype="float16"), prompts)
    want, _ = greedy_run(tiny_engine(ckpt), prompts)
    prefix, _ = agreement(want, tokens)
    assert prefix >= 0.5, prefix


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_a_quantized_cache_moves_with_its_scales_and_decodes_the_same(
    ckpt: Path, kv_dtype: str
) -> None:
    """Prefill on one int8 / fp8 engine, export (codes, then scales), import into another:
    the decode continues exactly as a single engine's, and a block is a quarter (int8) of
    float32's bytes plus its scales."""
    (prompt,) = random_prompts(384, [45], seed=5)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    whole = run_to_completion(tiny_engine(ckpt, kv_dtype=kv_dtype), {"r": prompt}, params)["r"]

    producer = tiny_engine(ckpt, kv_dtype=kv_dtype)
    producer.add_request("r", prompt, params, prefill_only=True)
    (out,) = producer.step()
    assert out.finish_reason is FinishReason.PREFILLED
    export = producer.export_kv("r")
    layout = layout_of(producer)
    assert layout.quantized and export.data.dtype == torch.uint8
    assert tuple(export.data.shape) == (3, layout.bytes_per_block)  # 45 tokens: 3 blocks
    float_layout = layout_of(tiny_engine(ckpt))
    scales = layout.num_layers * 2 * layout.num_kv_heads * 4
    assert layout.bytes_per_block == float_layout.bytes_per_block // 4 + scales
    assert KvLayout.from_pb(layout.to_pb()) == layout
    consumer = tiny_engine(ckpt, kv_dtype=kv_dtype)
    consumer.add_request("r", prompt, params, output_token_ids=out.new_token_ids,
                         kv_import=KvImport(export.num_tokens, export.data))  # fmt: skip
    rest: list[int] = []
    while consumer.has_unfinished():
        for step in consumer.step():
            rest += step.new_token_ids
    assert consumer.runner.num_forward_tokens == 12 - 1  # nothing recomputed
    assert out.new_token_ids + rest == whole
    assert producer.release("r")


def test_kv_dtype_and_backend_config(monkeypatch: pytest.MonkeyPatch) -> None:
    assert EngineConfig(model="m", dtype="float16").torch_kv_dtype == torch.float16
    assert EngineConfig(model="m", kv_dtype="fp8").torch_kv_dtype == torch.float8_e4m3fn
    assert EngineConfig(model="m", kv_dtype="int8").torch_kv_dtype == torch.int8
    with pytest.raises(ValueError, match="kv_dtype must be auto or one of"):
        EngineConfig(model="m", kv_dtype="int4")

    monkeypatch.setenv("PDSERVE_KV_DTYPE", "int8")
    monkeypatch.setenv("PDSERVE_ATTENTION_BACKEND", "triton")
    assert EngineConfig.from_env("m").kv_dtype == "int8"
    assert EngineConfig.from_env("m").attention_backend == "triton"
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--kv-dtype", "fp8", "--attention-backend", "torch"])
    config = engine_config_from_args(args, "m")  # flags win over the environment
    assert (config.kv_dtype, config.attention_backend) == ("fp8", "torch")
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-dtype", "int4"])

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_backend_name("auto", cpu) == "torch"
    assert resolve_backend_name("auto", cuda) == "triton"
    assert resolve_backend_name("torch", cuda) == "torch"
    assert resolve_backend_name("triton", cpu) == "triton"
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_backend_name("flash", cpu)


def test_torch_path_never_uses_the_triton_kernels(ckpt: Path) -> None:
    """A CPU engine (auto or torch backend, float or quantized KV) never loads kernels/'
    Triton modules, which cannot run on a CPU outside the interpreter (kernels.cpu, the C++
    CPU kernels, may load; torch itself may import the triton package; both are harmless)."""
    script = textwrap.dedent(
        f"""
        import sys
        from common.contract.sampling import SamplingParams
        from tests.factories import run_to_completion, tiny_engine
        for backend, kv_dtype in (("auto", "auto"), ("torch", "int8"), ("auto", "fp8")):
            engine = tiny_engine({str(ckpt)!r}, attention_backend=backend, kv_dtype=kv_dtype)
            assert engine.runner.backend.name == "torch", engine.runner.backend.name
            run_to_completion(engine, {{"r": [5, 6, 7]}}, SamplingParams(max_tokens=3))
        triton_kernels = ("kernels.kv_", "kernels.paged_", "kernels.rms_norm", "kernels.rotary")
        loaded = [m for m in sys.modules
                  if m.startswith(triton_kernels) or m.endswith("triton_backend")]
        assert not loaded, loaded
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]


def layout_of(engine: Engine) -> KvLayout:
    """The engine's blocks on the wire, as a worker describes them."""
    spec = engine.spec
    return KvLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, engine.block_size,
                    engine.runner.kv_dtype)  # fmt: skip
