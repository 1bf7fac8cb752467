"""The engine on a CUDA machine, in one short run (scripts/gpu_check.sh calls it after the
kernel tests): greedy parity with transformers on the GPU, then decode and prefill figures.

1. Parity: two random float32 checkpoints built here (a tiny Llama, and one of the default
   model's shape), the engine's greedy tokens against transformers' on the same device, four
   prompts run concurrently through the engine.
2. Speed: the engine in its CUDA defaults (bfloat16, the Triton attention backend) on the
   default model's shape, random weights (the model itself is too large to carry to a GPU
   machine and needs no download there): output tok/s with 1, 16 and 64 requests of 104 prompt
   tokens and 128 output tokens in flight, and prefill tok/s at 512 and 2000 tokens, measured
   by loadtest/baselines/engine_cases.py as bench_openvino.py measures the CPU.

    python3 -m loadtest.gpu_check --out DIR             # on the GPU machine
    .venv/bin/python -m loadtest.gpu_check --device cpu --quick --out DIR   # the same code here

Writes DIR/gpu_check.json and DIR/gpu_check.txt; exits 1 if parity fails.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from common.contract.sampling import SamplingParams
from common.engine.config import EngineConfig
from common.engine.engine import Engine
from loadtest.baselines.engine_cases import run_cases
from tests.factories import TINY_BASE, make_tiny_checkpoint, random_prompts

# The default model's shape (SmolLM2-135M-Instruct's config.json), weights random.
SMOLLM2_SHAPE: dict[str, Any] = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1,
    initializer_range=0.02,  # transformers' default (tests.factories sets 0.2 for tiny ones)
    eos_token_id=2,
)  # fmt: skip


class SteppedPdserve:
    """pdserve's Engine behind engine_cases.SteppedEngine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def add(self, request_id: int, prompt: Any, max_tokens: int) -> None:
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.engine.add_request(str(request_id), list(prompt), sampling)

    def step(self) -> list[tuple[int, int, bool]]:
        return [(int(o.request_id), len(o.new_token_ids), o.finished) for o in self.engine.step()]


def parity(model_dir: Path, device: str, vocab: int, max_new: int) -> dict[str, Any]:
    """Greedy tokens, engine (float32, concurrent) against transformers (float32, one at a
    time), on ``device``."""
    from transformers import AutoModelForCausalLM

    prompts = random_prompts(vocab, [5, 17, 33, 70], seed=1)
    hf: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    hf = hf.to(device).eval()
    hf.generation_config.eos_token_id = None
    expected = []
    with torch.inference_mode():
        for prompt in prompts:
            out = hf.generate(torch.tensor([prompt], device=device),
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
                              max_new_tokens=max_new, do_sample=False, pad_token_id=0)  # fmt: skip
            expected.append(out[0, len(prompt) :].tolist())
    del hf
    engine = Engine(EngineConfig(model=str(model_dir), device=device, dtype="float32",
                                 kv_cache_memory="256MiB", max_num_seqs=8))  # fmt: skip
    sampling = SamplingParams(max_tokens=max_new, ignore_eos=True)
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, sampling)
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    rows = []
    for i, want in enumerate(expected):
        have = got[str(i)]
        first = next((k for k, (a, b) in enumerate(zip(want, have, strict=True)) if a != b), None)
        rows.append({"prompt_len": len(prompts[i]), "equal": have == want,
                     "first_difference": first})  # fmt: skip
    return {"backend": type(engine.runner.backend).__name__, "max_new_tokens": max_new,
            "prompts": rows, "equal": all(r["equal"] for r in rows)}  # fmt: skip


def speed(model_dir: Path, device: str, quick: bool, seed: int) -> dict[str, Any]:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    if quick:  # the same code on small shapes (a CPU check of this script)
        batch = [(1, 2, 16), (4, 4, 16)]
        prefill = [64]
        input_len = 32
    else:
        batch = [(1, 4, 128), (16, 32, 128), (64, 128, 128)]
        prefill = [512, 2000]
        input_len = 104
    engine = Engine(EngineConfig(model=str(model_dir), device=device, kv_cache_memory="4GiB",
                                 max_num_seqs=max(c for c, _, _ in batch),
                                 max_num_batched_tokens=max(2048, *prefill),
                                 enable_prefix_caching=False))  # fmt: skip
    rng_seed = seed
    cases: list[dict[str, Any]] = []
    for concurrency, num, output_len in batch:
        rng_seed += 1
        cases.append({"name": f"c{concurrency}", "kind": "batch", "concurrency": concurrency,
                      "output_len": output_len,
                      "prompts": random_prompts(vocab, [input_len] * num, rng_seed)})  # fmt: skip
    for length in prefill:
        rng_seed += 1
        cases.append({"name": f"prefill{length}", "kind": "prefill",
                      "prompts": random_prompts(vocab, [length] * 3, rng_seed)})  # fmt: skip
    workload = {"cases": cases,
                "warmup": {"batch": random_prompts(vocab, [input_len] * 2, seed - 1),
                           "prefill": random_prompts(vocab, [max(prefill)], seed - 2)}}  # fmt: skip
    figures = run_cases(SteppedPdserve(engine), workload)
    return {"dtype": str(engine.config.torch_dtype), "backend": type(engine.runner.backend).__name__,
            "input_len": input_len, "cases": figures}  # fmt: skip


def environment(device: str) -> dict[str, Any]:
    env: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                           "machine": platform.machine(), "device": device}  # fmt: skip
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def report(result: dict[str, Any]) -> str:
    env = result["environment"]
    lines = [f"gpu_check on {env.get('gpu', env['device'])}: torch {env['torch']}, "
             f"triton {env['triton']}, {result['wall_s']:.0f} s"]  # fmt: skip
    for name, check in result["parity"].items():
        verdict = "equal" if check["equal"] else "DIFFERENT"
        firsts = [r["first_difference"] for r in check["prompts"] if not r["equal"]]
        lines.append(f"parity {name} ({check['backend']}, {check['max_new_tokens']} tokens, "
                     f"{len(check['prompts'])} prompts): {verdict}"
                     + (f" (first differences at {firsts})" if firsts else ""))  # fmt: skip
    s = result["speed"]
    lines.append(f"speed ({s['dtype']}, {s['backend']}, prompts of {s['input_len']} tokens):")
    for name, f in s["cases"].items():
        if "output_tok_s" in f:
            lines.append(f"  {name:<12} {f['output_tok_s']:9.1f} output tok/s  TTFT p50 "
                         f"{f['ttft_ms_p50']:7.1f} ms  TPOT p50 {f['tpot_ms_p50']:6.2f} ms")  # fmt: skip
        else:
            lines.append(f"  {name:<12} {f['prefill_tok_s']:9.0f} prefill tok/s")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="gpu-check")
    parser.add_argument("--quick", action="store_true", help="small shapes (a CPU check)")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    tiny = make_tiny_checkpoint(out / "ckpt-tiny", "llama", seed=args.seed)
    shape = dict(SMOLLM2_SHAPE, num_hidden_layers=2) if args.quick else SMOLLM2_SHAPE
    full = make_tiny_checkpoint(out / "ckpt-smollm2-shape", "llama", seed=args.seed, **shape)
    result: dict[str, Any] = {"environment": environment(args.device), "parity": {}}
    result["parity"]["tiny llama"] = parity(tiny, args.device, TINY_BASE["vocab_size"], 32)
    print(f"parity tiny: {result['parity']['tiny llama']['equal']}", flush=True)
    result["parity"]["smollm2 shape"] = parity(full, args.device, shape["vocab_size"],
                                               8 if args.quick else 32)  # fmt: skip
    print(f"parity smollm2 shape: {result['parity']['smollm2 shape']['equal']}", flush=True)
    result["speed"] = speed(full, args.device, args.quick, args.seed)
    result["wall_s"] = time.perf_counter() - start
    for ckpt in (tiny, full):  # weights are not results; keep $OUT small
        for f in ckpt.iterdir():
            f.unlink()
        ckpt.rmdir()
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    text = report(result)
    (out / "gpu_check.txt").write_text(text)
    print(text, end="")
    return 0 if all(check["equal"] for check in result["parity"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
