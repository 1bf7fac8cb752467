"""The cases of loadtest/bench_openvino.py, measured the same way for any engine that can add a
request and step: this module is the one copy of the timing code, imported by pdserve's side
(the repo's venv) and by OpenVINO's (its own venv, loadtest/baselines/openvino_engine.py), so
it uses the standard library only.

A case is one of:
  ``batch``: ``concurrency`` requests kept in flight (closed loop: a finished one is replaced
      at once) until ``num_requests`` are done, each a prompt of token ids and exactly
      ``output_len`` tokens (EOS ignored). Output tok/s = every generated token over the wall
      time from the first add to the last token, prefill included, as a server's client
      counts it; TTFT and TPOT per request besides.
  ``prefill``: one request at a time, a ``prompt_len``-token prompt and one output token;
      prefill tok/s = prompt_len / (add to first token), one figure per repetition.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class SteppedEngine(Protocol):
    def add(self, request_id: int, prompt: Sequence[int], max_tokens: int) -> None: ...

    def step(self) -> list[tuple[int, int, bool]]:
        """Runs one engine step; for each request that produced tokens in it: (request id,
        tokens produced, finished)."""
        ...


@dataclass
class Timeline:
    added: float
    tokens: list[float]  # arrival time of each token
    finished: bool = False


def run_requests(
    engine: SteppedEngine, prompts: Sequence[Sequence[int]], max_tokens: int, concurrency: int
) -> tuple[float, dict[int, Timeline]]:
    """Closed loop over ``prompts`` (ids 0..n-1) with at most ``concurrency`` in flight;
    returns the start time and each request's timeline."""
    clock = time.perf_counter
    lines: dict[int, Timeline] = {}
    next_id = 0
    running = 0
    start = clock()

    def admit() -> None:
        nonlocal next_id, running
        while running < concurrency and next_id < len(prompts):
            lines[next_id] = Timeline(clock(), [])
            engine.add(next_id, prompts[next_id], max_tokens)
            next_id += 1
            running += 1

    admit()
    while running:
        events = engine.step()
        now = clock()
        for request_id, produced, finished in events:
            line = lines[request_id]
            line.tokens += [now] * produced
            if finished and not line.finished:
                line.finished = True
                running -= 1
        admit()
    return start, lines


def batch_case(
    engine: SteppedEngine, prompts: Sequence[Sequence[int]], output_len: int, concurrency: int
) -> dict[str, Any]:
    start, lines = run_requests(engine, prompts, output_len, concurrency)
    short = [i for i, line in lines.items() if len(line.tokens) != output_len]
    if short:
        raise RuntimeError(
            f"{len(short)} requests did not produce exactly {output_len} tokens "
            f"(request {short[0]}: {len(lines[short[0]].tokens)})"
        )
    end = max(line.tokens[-1] for line in lines.values())
    tokens = sum(len(line.tokens) for line in lines.values())
    ttft = [line.tokens[0] - line.added for line in lines.values()]
    tpot = [
        (line.tokens[-1] - line.tokens[0]) / (len(line.tokens) - 1)
        for line in lines.values()
        if len(line.tokens) > 1
    ]
    return {
        "requests": len(lines), "output_tokens": tokens, "wall_s": end - start,
        "output_tok_s": tokens / (end - start),
        "ttft_ms_p50": 1000 * statistics.median(ttft), "ttft_ms_max": 1000 * max(ttft),
        "tpot_ms_p50": 1000 * statistics.median(tpot) if tpot else None,
    }  # fmt: skip


def prefill_case(engine: SteppedEngine, prompts: Sequence[Sequence[int]]) -> dict[str, Any]:
    rates = []
    for prompt in prompts:
        _, lines = run_requests(engine, [prompt], 1, 1)
        (line,) = lines.values()
        rates.append(len(prompt) / (line.tokens[0] - line.added))
    return {"prompt_len": len(prompts[0]), "prefill_tok_s": statistics.median(rates),
            "prefill_tok_s_all": rates}  # fmt: skip


def run_cases(
    engine: SteppedEngine, workload: dict[str, Any], log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Every case of ``workload`` (as bench_openvino.make_workload writes it), after a
    warm-up of each shape; returns the figures by case name."""
    warm = workload["warmup"]
    batch_case(engine, warm["batch"], 8, len(warm["batch"]))
    prefill_case(engine, warm["prefill"])
    results: dict[str, Any] = {}
    for case in workload["cases"]:
        if case["kind"] == "batch":
            figures = batch_case(engine, case["prompts"], case["output_len"], case["concurrency"])
            log(f"  {case['name']}: {figures['output_tok_s']:.1f} output tok/s, TTFT p50 "
                f"{figures['ttft_ms_p50']:.0f} ms, TPOT p50 {figures['tpot_ms_p50']:.1f} ms")  # fmt: skip
        else:
            figures = prefill_case(engine, case["prompts"])
            log(f"  {case['name']}: {figures['prefill_tok_s']:.0f} prefill tok/s")
        results[case["name"]] = figures
    return results
