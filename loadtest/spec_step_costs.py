"""What a verify row costs on this machine, and what that leaves speculation at most.

Runs the copy-heavy prompts of ``bench_spec`` at one concurrency on an engine that always
verifies ``num_speculative_tokens`` guesses (``adaptive`` off), so that its decode steps
span many row counts at a full batch, and times every step that holds only decodes and
verifies (no prefill chunk). It fits ``ms = base + row_ms * rows`` by least squares over the
steps of the full batch (every request still running) and prints:

- the plain step's cost per token at that batch, ``(base + row_ms * B) / B``;
- what one more row costs, ``row_ms``;
- the most output tok/s speculation could gain there were every guess kept and k unbounded:
  each row then yields a token for ``row_ms`` against a token per ``(base + row_ms * B) / B``
  without speculation, so the gain is below their ratio.

The bound is loose: guess j yields a token only with probability alpha^j, so what a real
acceptance allows is far less. With c = row_ms / (a token's ms) and every request keeping its
guesses at rate alpha, k guesses give (1 - alpha^(k+1)) / (1 - alpha) / (1 + c k) times the
plain tok/s. On the 2-core test machine at concurrency 16, c was 0.68-0.72 (1.17-1.25 ms a
row against 1.71-1.74 a token; bounds 1.39x and 1.47x with 4 and 8 guesses): the best k
gives 1.08-1.10x at alpha 0.85 (what the copy workload keeps), and 1.3x would take alpha of
0.98 (c 0.68) to over 0.99 (c 0.72). On a GPU at small batch a row costs a small part of a
token (c near 0). Run it on a quiet machine:

    .venv/bin/python -m loadtest.spec_step_costs [--concurrency 16] [--guesses 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics

import common.openmp  # noqa: F401  (before torch, run as a script too: OpenMP's wait policy)

# isort: split
import torch

from common.contract.sampling import SamplingParams
from common.engine.config import EngineConfig
from common.engine.llm import LLM
from common.engine.speculative.policy import StepCost
from common.models.default_model import resolve_model
from loadtest.bench_spec import copy_prompts


class _Recording(StepCost):
    """The engine's step costs, keeping the latest (rows, ms) it was given."""

    last: tuple[int, float] | None = None

    def add(self, rows: int, ms: float) -> None:
        super().add(rows, ms)
        self.last = (rows, ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--guesses", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = {"method": "ngram", "num_speculative_tokens": args.guesses,
              "prompt_lookup_max": 8, "prompt_lookup_min": 2, "adaptive": False}  # fmt: skip
    llm = LLM(EngineConfig(model=resolve_model(None), num_threads=args.threads,
                           speculative_config=json.dumps(config)))  # fmt: skip
    engine = llm.engine
    chats = [chat for variant in range(3) for chat in copy_prompts(variant)]  # 12 prompts
    encoded = [llm.tokenizer.encode_chat(c) for c in chats]
    prompts = [encoded[i % len(encoded)] for i in range(args.concurrency)]
    sampling = SamplingParams(max_tokens=128, temperature=0.0)
    timed = _Recording()
    engine.step_cost = timed  # what the engine times of its decode-only steps, rows and all
    steps: list[tuple[int, float]] = []  # (rows, ms) of full-batch decode-only steps
    for r in range(args.rounds + 1):  # the first round warms up and is not counted
        for i, ids in enumerate(prompts):
            engine.add_request(f"s{r}-{i}", ids, sampling)
        while engine.has_unfinished():
            full = len(engine.scheduler.running) == args.concurrency
            timed.last = None
            engine.step()
            if r and full and timed.last is not None:
                steps.append(timed.last)
    if len({rows for rows, _ in steps}) < 2:
        raise SystemExit(f"the full batch's steps span one row count only ({len(steps)} steps)")
    mean_rows = statistics.fmean(rows for rows, _ in steps)
    mean_ms = statistics.fmean(ms for _, ms in steps)
    row_ms = sum((rows - mean_rows) * (ms - mean_ms) for rows, ms in steps) / sum(
        (rows - mean_rows) ** 2 for rows, _ in steps
    )
    base = mean_ms - row_ms * mean_rows
    batch = args.concurrency
    per_token = (base + row_ms * batch) / batch
    print(f"{len(steps)} full-batch decode steps at concurrency {batch}, "
          f"{min(r for r, _ in steps)}-{max(r for r, _ in steps)} rows: "
          f"ms = {base:.2f} + {row_ms:.3f} x rows")  # fmt: skip
    print(f"a token of a plain step: {per_token:.2f} ms; a verify row: {row_ms:.2f} ms; "
          f"speculation's output tok/s gain here is below {per_token / row_ms:.2f}x "
          f"even with every guess kept")  # fmt: skip


if __name__ == "__main__":
    main()
