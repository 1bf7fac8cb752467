"""Prefill time of one prompt through the engine in this process: random prompts of each
length, one output token, best of ``--repeats``, prompts fed in chunks of
``--max-num-batched-tokens`` as the scheduler feeds them. Run it on a quiet machine:

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python loadtest/bench_prefill.py \\
        --model ~/.cache/pdserve/bench-quant/SmolLM2-135M-Instruct.Q4_K_M.gguf --act-bits 8

``--prefill-attention kernel,sdpa`` builds an engine for each way the cpp backend attends
prompt tokens and alternates them prompt by prompt (the same prompts for each).
"""

from __future__ import annotations

import argparse
import time

import common.openmp  # noqa: F401  (before torch, run as a script too: OpenMP's wait policy)

# isort: split
import torch

from common.contract.sampling import SamplingParams
from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.models.default_model import resolve_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint or GGUF file (default model)")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--act-bits", type=int, default=16, help="--quant-act-bits")
    parser.add_argument("--kv-dtype", default="auto")
    parser.add_argument("--lengths", default="512,2048,4000", help="prompt tokens, comma-separated")
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefill-attention", default="auto",
                        help="EngineConfig.prefill_attention, or several comma-separated")  # fmt: skip
    args = parser.parse_args()
    engines = {}
    for mode in args.prefill_attention.split(","):
        config = EngineConfig(
            model=resolve_model(args.model), device="cpu", quantization=args.quantization,
            quant_act_bits=args.act_bits, kv_dtype=args.kv_dtype, kv_cache_memory="1GiB",
            max_num_batched_tokens=args.max_num_batched_tokens, prefill_attention=mode,
        )  # fmt: skip
        engines[mode] = Engine(config)
    first = next(iter(engines.values()))
    vocab = first.runner.model.spec.vocab_size
    params = SamplingParams(max_tokens=1, ignore_eos=True)

    def prefill(engine: Engine, prompt: list[int], request_id: str) -> float:
        engine.add_request(request_id, prompt, params)
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - start

    rng = torch.Generator().manual_seed(0)
    for mode, engine in engines.items():
        prefill(engine, torch.randint(100, vocab, (64,), generator=rng).tolist(), "warm-up")
        backend = engine.runner.backend
        print(f"[{mode}] {first.runner.weight_format.describe()}, KV {engine.runner.kv_dtype}, "
              f"chunks of {args.max_num_batched_tokens}, {type(backend).__name__}, prompt "
              f"attention {'sdpa' if getattr(backend, 'sdpa_prefill', False) else 'kernel'}")  # fmt: skip
    for length in (int(x) for x in args.lengths.split(",")):
        times: dict[str, list[float]] = {mode: [] for mode in engines}
        for i in range(args.repeats):
            # a fresh prompt each repeat (no prefix-cache hit), the same one for every mode
            prompt = torch.randint(100, vocab, (length,), generator=rng).tolist()
            for mode, engine in engines.items():
                times[mode].append(prefill(engine, prompt, f"p{length}-{i}"))
        line = f"prefill {length:>5} tokens:"
        for mode, t in times.items():
            best = min(t)
            line += f"  [{mode}] {best * 1e3:7.0f} ms ({length / best:6.0f} tok/s)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
