"""StreamingLLM as a stream grows: KV blocks held and TPOT per stretch of generated tokens,
for one greedy stream under eviction and the same stream without it, in one process.

The engine is the default model's (SmolLM2, the shipped GGUF); each arm generates
``--tokens`` tokens from one short prompt (ignore_eos), one at a time, and the table gives,
per ``--stretch`` tokens, the median decode step time and the most KV blocks the stream
held. Under eviction both stay flat; without it the blocks grow with the stream and so
does each step's attention. The dense arm stops at the context.

    .venv/bin/python -m loadtest.bench_streaming
    .venv/bin/python -m loadtest.bench_streaming --tokens 600 --stretch 200   # quick

Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

from loadtest.bench_llamacpp import OtherWork, log, noise_note

PROMPT = "Tell a very long story about a city by the sea, its people, and their years."


def one_arm(llm: Any, eviction: Any, tokens: int, stretch: int) -> list[dict[str, float]]:
    from common.contract.sampling import SamplingParams

    engine = llm.engine
    ids = llm.encode(PROMPT)
    sampling = SamplingParams(max_tokens=tokens, ignore_eos=True)
    engine.add_request("stream", ids, sampling, eviction=eviction)
    steps: list[tuple[int, float, int]] = []  # tokens so far, step ms, blocks held
    done = 0
    while engine.has_unfinished():
        start = time.perf_counter()
        outputs = engine.step()
        ms = (time.perf_counter() - start) * 1000
        req = engine.requests.get("stream")
        held = len(engine.kv.block_ids(req)) if req is not None else 0
        for out in outputs:
            done += len(out.new_token_ids)
        if done > 1:  # decode steps only
            steps.append((done, ms, held))
    rows = []
    for first in range(0, done, stretch):
        part = [s for s in steps if first < s[0] <= first + stretch]
        if part:
            rows.append({"from": first, "to": first + stretch,
                         "tpot_ms": statistics.median(s[1] for s in part),
                         "max_blocks": max(s[2] for s in part)})  # fmt: skip
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    from common.engine.config import EngineConfig
    from common.engine.eviction import KvEviction
    from common.engine.llm import LLM
    from common.models.default_model import resolve_model

    config = EngineConfig(model=resolve_model(None), num_threads=args.threads)
    llm = LLM(config)
    limit = llm.engine.max_model_len - len(llm.encode(PROMPT)) - 1
    eviction = KvEviction(args.sink_tokens, args.window_tokens)
    summary: dict[str, Any] = {}
    for name, policy, tokens in (("streaming", eviction, args.tokens),
                                 ("dense", None, min(args.tokens, limit))):  # fmt: skip
        with OtherWork() as meter:
            rows = one_arm(llm, policy, tokens, args.stretch)
        summary[name] = {"rows": rows, "other_work": meter.fraction}
        log(f"{name} ({eviction.describe() if policy else 'every token kept'}):"
            f"{noise_note(meter.fraction)}")  # fmt: skip
        for row in rows:
            log(f"  tokens {row['from']:>6}-{row['to']:<6} TPOT p50 {row['tpot_ms']:7.2f} ms,"
                f" blocks {row['max_blocks']}")  # fmt: skip
    if args.json:
        print(json.dumps(summary))
    return summary


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--tokens", type=int, default=6000)
    parser.add_argument("--stretch", type=int, default=1000)
    parser.add_argument("--sink-tokens", type=int, default=16)
    parser.add_argument("--window-tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", action="store_true")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main()
