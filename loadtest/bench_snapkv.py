"""SnapKV's cost and saving on the default model (SmolLM2, the shipped GGUF), in one process.

Two tasks on real English (CPython's ``pydoc_data.topics``), each a ``--context`` of tokens
and a ``--continuation`` to score:

- ``continue``: the text goes on (language modelling; the recent text matters most);
- ``recall``: the context ends with the first ``--window-tokens`` of a passage from a
  quarter of the way in, and the continuation is the rest of that passage (a question
  about the document at the end of a prompt: what it needs lies far back).

Every arm computes the context, compresses it (or not), and then scores the continuation
against what it kept, token by token (the engine's own chunked prefill with prompt
logprobs; ``add_request(compress_at=...)`` compresses after the context). Against the
dense arm (every block kept) it reports:

- the continuation's perplexity and its ratio to dense;
- mean KL(dense || arm) of the next-token distributions and top-1 agreement with dense;
- blocks kept of the context's blocks, which is the bytes a decode worker pulls and the
  KV it holds and reads per step (a block is ``KvLayout.bytes_per_block`` either way).

Two selections at each budget: ``snapkv`` (compression.py: the first block, the window's,
and the blocks the window attends to most) and ``recent`` (the first block and the latest
blocks, as much KV; StreamingLLM's choice), so the table says what the scoring buys.
Last, decode TPOT after a compressed and a dense context, greedy, in the same process.

    .venv/bin/python -m loadtest.bench_snapkv
    .venv/bin/python -m loadtest.bench_snapkv --docs 1 --budgets 512   # quick

Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import common.openmp  # noqa: F401  (before torch, run as a script too: OpenMP's wait policy)

# isort: split
import torch

from loadtest.bench_disk_tier import documents
from loadtest.bench_llamacpp import OtherWork, log, noise_note


def recent_blocks(scores: torch.Tensor, policy: Any, prompt_len: int, block_size: int) -> Any:
    """The baseline selection: block 0 and the latest blocks, as many as SnapKV keeps."""
    num_blocks = -(-prompt_len // block_size)
    budget = policy.budget_blocks(block_size)
    if num_blocks <= budget:
        return None
    return [0, *range(num_blocks - budget + 1, num_blocks)]


def continuation_rows(engine: Any, ids: list[int], context: int, policy: Any) -> torch.Tensor:
    """[C - 1, V] log-softmax rows predicting continuation tokens 1.. (all computed after
    the compression), and the blocks the request held after it."""
    from common.contract.sampling import SamplingParams

    sampling = SamplingParams(max_tokens=1, prompt_logprobs=0, ignore_eos=True)
    rid = f"score-{time.monotonic_ns()}"
    engine.add_request(rid, ids, sampling, keep_prompt_rows=True, compression=policy,
                       compress_at=context if policy is not None else None)  # fmt: skip
    rows = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.prompt_logprob_rows is not None:
                rows = out.prompt_logprob_rows
    assert rows is not None, "the document did not fit the KV pool"
    return rows[context:].clone()  # row i predicts token i + 1


def decode_tpot(engine: Any, ids: list[int], policy: Any, tokens: int) -> float:
    from common.contract.sampling import SamplingParams

    engine.add_request("tpot", ids, SamplingParams(max_tokens=tokens, ignore_eos=True),
                       compression=policy)  # fmt: skip
    times = []
    done = 0
    while engine.has_unfinished():
        start = time.perf_counter()
        outputs = engine.step()
        ms = (time.perf_counter() - start) * 1000
        done += sum(len(o.new_token_ids) for o in outputs)
        if done > 1:
            times.append(ms)
    return statistics.median(times)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from common.engine.compression import KvCompression
    from common.engine.config import EngineConfig
    from common.engine.llm import LLM
    from common.models.default_model import resolve_model

    config = EngineConfig(model=resolve_model(None), num_threads=args.threads,
                          enable_prefix_caching=False)  # fmt: skip
    llm = LLM(config)
    engine = llm.engine
    total = args.context + args.continuation
    texts = [llm.encode(d)[:total] for d in documents(args.docs, int(total * 1.15))]
    assert all(len(d) == total for d in texts), "a document came out short"
    summary: dict[str, Any] = {"tasks": {}}
    for task in args.tasks:
        docs = texts if task == "continue" else [recall(t, args) for t in texts]
        summary["tasks"][task] = one_task(engine, docs, task, args)
    with OtherWork() as meter:
        ids = texts[0][: args.context]
        budget = args.budgets[0]
        tpot = {"dense": decode_tpot(engine, ids, None, args.decode_tokens),
                f"snapkv@{budget}": decode_tpot(engine, ids, KvCompression(budget,
                                                args.window_tokens), args.decode_tokens)}  # fmt: skip
    log(f"decode TPOT p50 after {args.context} tokens, {args.decode_tokens} tokens each:"
        f"{noise_note(meter.fraction)}")  # fmt: skip
    for key, ms in tpot.items():
        log(f"  {key:<14} {ms:7.2f} ms ({tpot['dense'] / ms:.2f}x dense)")
    summary["tpot_ms"] = tpot
    if args.json:
        print(json.dumps(summary))
    return summary


def recall(ids: list[int], args: argparse.Namespace) -> list[int]:
    """The context's text, ending with the start of a passage from a quarter of the way in;
    the continuation is the rest of that passage."""
    cue = args.window_tokens
    start = args.context // 4
    passage = ids[start : start + cue + args.continuation]
    return ids[: args.context - cue] + passage


def one_task(engine: Any, docs: list[list[int]], task: str, args: argparse.Namespace) -> Any:
    import common.engine.engine as engine_module
    from common.engine.compression import KvCompression

    S = engine.block_size
    snapkv_select = engine_module.select_blocks
    arms: list[tuple[str, int | None]] = [("dense", None)]
    for budget in args.budgets:
        arms += [("snapkv", budget), ("recent", budget)]
    results: dict[str, Any] = {}
    dense_rows: list[torch.Tensor] = []
    with OtherWork() as meter:
        for name, budget in arms:
            policy = None if budget is None else KvCompression(budget, args.window_tokens)
            engine_module.select_blocks = recent_blocks if name == "recent" else snapkv_select
            nll, kl, agree, count = 0.0, 0.0, 0, 0
            try:
                for d, ids in enumerate(docs):
                    rows = continuation_rows(engine, ids, args.context, policy)
                    targets = torch.tensor(ids[args.context + 1 :])
                    nll -= float(rows.gather(1, targets[:, None]).sum())
                    count += len(targets)
                    if budget is None:
                        dense_rows.append(rows)
                        continue
                    ref = dense_rows[d]
                    kl += float((ref.exp() * (ref - rows)).sum())
                    agree += int((ref.argmax(1) == rows.argmax(1)).sum())
            finally:
                engine_module.select_blocks = snapkv_select
            key = name if budget is None else f"{name}@{budget}"
            num_blocks = -(-args.context // S)
            kept = num_blocks if budget is None else min(num_blocks, -(-budget // S))
            results[key] = {"perplexity": math.exp(nll / count), "num_tokens": count,
                            "kl_divergence": kl / count if budget else 0.0,
                            "top1_agreement": agree / count if budget else 1.0,
                            "kept_blocks": kept, "context_blocks": num_blocks}  # fmt: skip
    dense_ppl = results["dense"]["perplexity"]
    log(f"task {task}: {len(docs)} documents, {args.context} tokens of context + "
        f"{args.continuation} scored; window {args.window_tokens}:{noise_note(meter.fraction)}")  # fmt: skip
    log(f"{'arm':<14} {'blocks kept':>12} {'ppl':>8} {'/dense':>7} {'KL':>9} {'top-1':>7}")
    for key, r in results.items():
        log(f"{key:<14} {r['kept_blocks']:>5} / {r['context_blocks']:<4} {r['perplexity']:8.3f} "
            f"{r['perplexity'] / dense_ppl:7.3f} {r['kl_divergence']:9.5f} "
            f"{r['top1_agreement']:7.3f}")  # fmt: skip
    return results


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--docs", type=int, default=3)
    parser.add_argument("--tasks", type=lambda s: s.split(","), default=["continue", "recall"])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--continuation", type=int, default=256)
    parser.add_argument("--budgets", type=lambda s: [int(b) for b in s.split(",")],
                        default=[256, 512, 1024])  # fmt: skip
    parser.add_argument("--window-tokens", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", action="store_true")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main()
