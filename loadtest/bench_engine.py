"""Engine throughput against transformers ``generate`` on the same weights, same run.

Workload (seeded): 32 requests, prompt lengths 32-512, output lengths 16-256, ignore_eos,
greedy. pdserve runs them with continuous batching, at most 16 running at once;
transformers runs them in static batches of 16 (left-padded, each batch runs until its
longest output is done). Also single-stream decode speed for both.

    .venv/bin/python loadtest/bench_engine.py [--model PATH] [--num-requests 32]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import common.openmp  # noqa: F401  (before torch, run as a script too: OpenMP's wait policy)

# isort: split
import torch

from common.contract.sampling import SamplingParams
from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.models.default_model import resolve_model


def make_workload(num: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    work = []
    for _ in range(num):
        prompt_len = rng.randint(32, 512)
        output_len = rng.randint(16, 256)
        work.append(([rng.randrange(100, vocab) for _ in range(prompt_len)], output_len))
    return work


def run_pdserve(engine: Engine, work: list[tuple[list[int], int]]) -> tuple[float, int]:
    start = time.perf_counter()
    for i, (prompt, output_len) in enumerate(work):
        engine.add_request(
            f"b{i}-{start}", prompt, SamplingParams(max_tokens=output_len, ignore_eos=True)
        )
    produced = 0
    while engine.has_unfinished():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    return time.perf_counter() - start, produced


def run_hf(model: Any, work: list[tuple[list[int], int]], batch_size: int) -> tuple[float, int]:
    start = time.perf_counter()
    useful = 0
    for b in range(0, len(work), batch_size):
        batch = work[b : b + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, (prompt, _) in enumerate(batch):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        longest = max(n for _, n in batch)
        with torch.inference_mode():
            model.generate(
                ids, attention_mask=mask, max_new_tokens=longest, do_sample=False, pad_token_id=0
            )
        useful += sum(n for _, n in batch)
    return time.perf_counter() - start, useful


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-running", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--single-stream-tokens", type=int, default=128)
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    parser.add_argument(
        "--single-stream-only", action="store_true", help="skip the 32-request batch comparison"
    )
    args = parser.parse_args()

    model_dir = resolve_model(args.model)
    engine = Engine(
        EngineConfig(model=model_dir, dtype="float32", device="cpu", max_num_seqs=args.max_running,
                     max_num_batched_tokens=1024, kv_cache_memory="2GiB")
    )  # fmt: skip
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # ignore_eos, like the engine requests
    work = make_workload(args.num_requests, engine.spec.vocab_size, args.seed)
    print(f"threads: {torch.get_num_threads()}; workload: {len(work)} requests, "
          f"prompts {min(len(p) for p, _ in work)}-{max(len(p) for p, _ in work)} tokens, "
          f"outputs {min(n for _, n in work)}-{max(n for _, n in work)} tokens, "
          f"{sum(n for _, n in work)} output tokens in all", flush=True)  # fmt: skip

    # Warm both up on a small request so first-call costs are not measured.
    run_pdserve(engine, work[:1])
    run_hf(hf, [(work[0][0][:32], 4)], 1)

    figures: dict[str, float] = {}
    if not args.single_stream_only:
        figures.update(compare_batches(engine, hf, work, args.max_running))

    n = args.single_stream_tokens
    prompt = work[0][0][:128]
    pd_single, _ = run_pdserve(engine, [(prompt, n)])
    hf_single, _ = run_hf(hf, [(prompt, n)], 1)
    print(f"single stream ({len(prompt)}-token prompt, {n} tokens): pdserve {n / pd_single:.1f} tok/s, "
          f"transformers {n / hf_single:.1f} tok/s, ratio {hf_single / pd_single:.2f}x", flush=True)  # fmt: skip
    figures.update({"pdserve_single_tok_s": n / pd_single, "transformers_single_tok_s": n / hf_single,
                    "single_ratio": hf_single / pd_single})  # fmt: skip
    if args.json:
        print(json.dumps(figures))


def compare_batches(
    engine: Engine, hf: Any, work: list[tuple[list[int], int]], max_running: int
) -> dict[str, float]:
    pd_time, pd_tokens = run_pdserve(engine, work)
    print(
        f"pdserve  continuous batching: {pd_tokens} tokens in {pd_time:.1f}s = {pd_tokens / pd_time:.1f} tok/s",
        flush=True,
    )
    hf_time, hf_tokens = run_hf(hf, work, max_running)
    print(
        f"transformers static batches:  {hf_tokens} tokens in {hf_time:.1f}s = {hf_tokens / hf_time:.1f} tok/s",
        flush=True,
    )
    ratio = (pd_tokens / pd_time) / (hf_tokens / hf_time)
    print(f"throughput ratio pdserve / transformers: {ratio:.2f}x", flush=True)
    return {"pdserve_tok_s": pd_tokens / pd_time, "transformers_tok_s": hf_tokens / hf_time,
            "throughput_ratio": ratio}  # fmt: skip


if __name__ == "__main__":
    main()
