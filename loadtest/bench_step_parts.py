"""Where a decode step's time goes, in process: the fused C++ decoder (the layers), the output
head, and the rest (the engine's Python: scheduling, sampling, bookkeeping).

Loads one model as the engine serves it, runs ``--streams`` greedy requests of a
``--prompt``-token random prompt to ``--tokens`` tokens each, ``--runs`` times after a
warm-up run, and times every decode step and, within it, the fused decoder's call and the
head's (``compute_logits``). Prints per run: ms per step, each part's ms per step, and the
layers' weight bytes over the decoder's time (how fast the step streams its weights). Run it
on a quiet machine:

    .venv/bin/python loadtest/bench_step_parts.py --model ~/.cache/pdserve/bench-quant/SmolLM2-135M-Instruct.Q3_K_M.gguf \
        [--streams 1] [--quant-act-bits 8] [--kv-dtype float16]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import common.openmp  # noqa: F401  (before torch, run as a script too: OpenMP's wait policy)

# isort: split
from common.contract.sampling import SamplingParams
from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.heap import freeze_startup_heap
from common.models.default_model import resolve_model
from common.models.quant.linear import QuantLinear
from kernels.cpu import quant as cpu_quant

# Kernel switches --ab alternates (each gives the same bits on and off).
SWITCHES: dict[str, Callable[[bool], None]] = {
    "amx": cpu_quant.set_amx,
    "row-streams": cpu_quant.set_row_streams,
}


class Timed:
    """A callable that sums the seconds spent in it until reset; other attributes are the
    wrapped object's."""

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner = inner
        self.seconds = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a checkpoint folder or GGUF file")
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=104, help="prompt tokens per request")
    parser.add_argument("--tokens", type=int, default=256, help="output tokens per request")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quant-act-bits", type=int, default=8)
    parser.add_argument("--kv-dtype", default="float16")
    parser.add_argument(
        "--ab", choices=sorted(SWITCHES), default=None,
        help="alternate a kernel switch run by run (on, off, on, ...; the same bits either "
        "way) and give each arm's median step",
    )  # fmt: skip
    args = parser.parse_args()

    engine = Engine(
        EngineConfig(
            model=resolve_model(os.path.expanduser(args.model)), device="cpu",
            kv_cache_memory="512MiB", quant_act_bits=args.quant_act_bits, kv_dtype=args.kv_dtype,
        )
    )  # fmt: skip
    freeze_startup_heap()
    model: Any = engine.runner.model  # its decoder and head are wrapped below
    fused = getattr(model, "fused_decoder", None)
    if fused is None:
        raise SystemExit("this model's decode steps do not run fused (see the engine's log)")
    layers = model.fused_decoder = Timed(fused)
    head = model.compute_logits = Timed(model.compute_logits)
    layer_bytes = sum(m.num_weight_bytes for m in model.layers.modules() if isinstance(m, QuantLinear))
    sampling = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    rng = random.Random(0)
    print(f"{args.model}: {args.streams} stream(s), {args.prompt}-token prompts, {args.tokens} tokens")
    steps: list[float] = []
    arms: dict[bool, list[float]] = {True: [], False: []}
    for run in range(args.runs + 1):
        arm = run % 2 == 1  # the warm-up (run 0) runs off
        if args.ab:
            SWITCHES[args.ab](arm)
        for i in range(args.streams):
            prompt = [rng.randrange(100, 40000) for _ in range(args.prompt)]
            engine.add_request(f"r{run}-{i}", prompt, sampling)
        while engine.scheduler.waiting or not all(
            r.output_token_ids for r in engine.scheduler.running
        ):  # prompts in: every stream has its first token
            engine.step()
        layers.seconds = head.seconds = 0.0
        num_steps, start = 0, time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            num_steps += 1
        if run == 0:
            continue  # warm-up
        step = (time.perf_counter() - start) / num_steps
        steps.append(step)
        arms[arm].append(step)
        fwd, out = layers.seconds / num_steps, head.seconds / num_steps
        label = f" ({args.ab} {'on' if arm else 'off'})" if args.ab else ""
        print(
            f"run {run}{label}: step {step * 1e3:.3f} ms = layers {fwd * 1e3:.3f} + head "
            f"{out * 1e3:.3f} + rest {(step - fwd - out) * 1e3:.3f}; layers' weights at "
            f"{layer_bytes / fwd / 1e9:.1f} GB/s, {args.streams / step:.1f} tok/s"
        )
    print(f"median step {statistics.median(steps) * 1e3:.3f} ms")
    if args.ab:
        for arm, done in arms.items():
            if done:
                median = statistics.median(done) * 1e3
                print(f"{args.ab} {'on' if arm else 'off'}: median step {median:.3f} ms")


if __name__ == "__main__":
    main()
