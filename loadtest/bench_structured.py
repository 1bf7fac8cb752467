"""What structured output costs: TPOT and output tok/s of JSON-schema-constrained requests
against the same requests unconstrained, through one ``pdserve up`` stack (its defaults:
1 prefill + 1 decode worker), at concurrency 1 and 16, in one run.

Each round sends, per arm and concurrency, ``--num-prompts`` chat requests asking for a JSON
list of items; the constrained arm adds a JSON schema (an object with an array of bounded
objects), the unconstrained arm sends the same prompts with ``min_tokens`` set to the
constrained arm's output lengths of that round, so both arms decode comparable lengths. The
arms alternate within each round (the order rotates per round). TPOT per request is
(last token time - first token time) / (tokens - 1), from the client's clock; the table
pools the rounds and prints the constrained arm's ratio to the unconstrained one, with the
per-round ratios beside it as the run's own noise. The target: constraints cost at most
10 % TPOT.

    .venv/bin/python -m loadtest.bench_structured                   # the full run
    .venv/bin/python -m loadtest.bench_structured --rounds 1 --num-prompts 4   # a quick check

Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.bench_llamacpp import OtherWork, log, noise_note, pdserve_stack

SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "count": {"type": "integer", "minimum": 0, "maximum": 999},
                    "fresh": {"type": "boolean"},
                },
                "required": ["name", "count", "fresh"],
                "additionalProperties": False,
            },
            "minItems": 4,
            "maxItems": 8,
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}
TOPICS = ["a grocery list", "a toolbox", "a library shelf", "a garden", "a fridge",
          "a school bag", "a kitchen drawer", "a camping trip"]  # fmt: skip


@dataclass
class Timed:
    num_tokens: int
    ttft_s: float
    decode_s: float  # first token to last
    text: str
    finish_reason: str | None


async def one(client: Any, prompt: str, sampling: Any) -> Timed:
    start = time.perf_counter()
    first = last = None
    tokens, text, finish = 0, "", None
    async for message in client.stream(prompt=prompt, sampling=sampling):
        now = time.perf_counter()
        if message.token_ids:
            first = first or now
            last = now
            tokens += len(message.token_ids)
        text += message.text
        if message.finish_reason:
            finish = str(message.finish_reason)
    assert first is not None and last is not None, "a request ended without a token"
    return Timed(tokens, first - start, last - first, text, finish)


async def arm(target: str, prompts: list[str], samplings: list[Any], concurrency: int
              ) -> tuple[list[Timed], float]:  # fmt: skip
    from pdserve.client import GatewayClient

    client = GatewayClient(target)
    gate = asyncio.Semaphore(concurrency)

    async def gated(prompt: str, sampling: Any) -> Timed:
        async with gate:
            return await one(client, prompt, sampling)

    try:
        started = time.perf_counter()
        results = await asyncio.gather(*[gated(p, s) for p, s in zip(prompts, samplings,
                                                                    strict=True)])  # fmt: skip
        return list(results), time.perf_counter() - started
    finally:
        await client.close()


def tpot_ms(results: Sequence[Timed]) -> list[float]:
    return [r.decode_s / (r.num_tokens - 1) * 1000 for r in results if r.num_tokens > 1]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from common.contract.sampling import SamplingParams
    from common.contract.structured import ConstraintKind, StructuredOutput
    from pdserve.cli.launcher import StackState

    out = Path(args.result_dir or tempfile.mkdtemp(prefix="structured-"))
    out.mkdir(parents=True, exist_ok=True)
    constraint = StructuredOutput(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA))
    concurrencies = (1, args.concurrency)
    summary: dict[str, Any] = {"rounds": []}
    pooled: dict[str, list[float]] = {}
    rates: dict[str, list[float]] = {}
    valid = total = 0
    with pdserve_stack(out / "stack", shlex.split(args.up_args)) as (target, _env):
        state = StackState.load(out / "stack" / "stack.json")
        assert state is not None
        pids = [c.pid for c in state.children if c.pid]  # the stack's work is not "other"
        warm = [SamplingParams(max_tokens=16, structured_output=constraint)] * 4
        asyncio.run(arm(target, ["Warm up."] * 4, warm, 4))
        for i in range(args.rounds):
            for c in concurrencies:
                n = args.num_prompts if c == 1 else max(args.num_prompts, 2 * c)
                prompts = [
                    f"List what is in {TOPICS[(i * 7 + k) % len(TOPICS)]} as JSON, item "
                    f"{k}: each item's name, count and whether it is fresh."
                    for k in range(n)
                ]
                seeds = [1000 * i + k for k in range(n)]
                tight = [SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=s,
                                        structured_output=constraint) for s in seeds]  # fmt: skip
                with OtherWork(pids) as meter:
                    constrained, wall_c = asyncio.run(arm(target, prompts, tight, c))
                lengths = [r.num_tokens for r in constrained]
                loose = [SamplingParams(max_tokens=m, min_tokens=m, temperature=1.0, seed=s)
                         for m, s in zip(lengths, seeds, strict=True)]  # fmt: skip
                plain, wall_p = asyncio.run(arm(target, prompts, loose, c))
                for r in constrained:
                    total += 1
                    try:
                        json.loads(r.text)
                        valid += r.finish_reason is not None
                    except json.JSONDecodeError:
                        pass
                tp_c, tp_p = tpot_ms(constrained), tpot_ms(plain)
                ratio = statistics.median(tp_c) / statistics.median(tp_p)
                pooled.setdefault(f"constrained-c{c}", []).extend(tp_c)
                pooled.setdefault(f"plain-c{c}", []).extend(tp_p)
                tokens = sum(lengths)
                rates.setdefault(f"constrained-c{c}", []).append(tokens / wall_c)
                rates.setdefault(f"plain-c{c}", []).append(
                    sum(r.num_tokens for r in plain) / wall_p
                )
                summary["rounds"].append({"round": i, "concurrency": c, "tpot_ratio": ratio})
                log(f"  round {i + 1} c{c:<3} TPOT p50 constrained {statistics.median(tp_c):.2f}"
                    f" ms, plain {statistics.median(tp_p):.2f} ms, ratio {ratio:.3f}; "
                    f"{tokens} tokens{noise_note(meter.fraction)}")  # fmt: skip
    lines = [f"{'conc':>4} {'TPOT p50 plain':>15} {'constrained':>12} {'ratio':>6} "
             f"{'tok/s plain':>12} {'constrained':>12}  per-round TPOT ratio"]  # fmt: skip
    for c in concurrencies:
        p50_p = statistics.median(pooled[f"plain-c{c}"])
        p50_c = statistics.median(pooled[f"constrained-c{c}"])
        per_round = ", ".join(f"{r['tpot_ratio']:.3f}" for r in summary["rounds"]
                              if r["concurrency"] == c)  # fmt: skip
        rate_p = statistics.mean(rates[f"plain-c{c}"])
        rate_c = statistics.mean(rates[f"constrained-c{c}"])
        summary[f"c{c}"] = {"tpot_p50_plain_ms": p50_p, "tpot_p50_constrained_ms": p50_c,
                            "tok_s_plain": rate_p, "tok_s_constrained": rate_c}  # fmt: skip
        lines.append(f"{c:>4} {p50_p:>15.2f} {p50_c:>12.2f} {p50_c / p50_p:>6.3f} "
                     f"{rate_p:>12.1f} {rate_c:>12.1f}  {per_round}")  # fmt: skip
    lines.append(f"constrained outputs that parse as JSON: {valid}/{total}")
    summary["valid"], summary["total"] = valid, total
    table = "\n".join(lines)
    log("\n" + table)
    (out / "structured.json").write_text(json.dumps(summary, indent=2))
    (out / "structured.txt").write_text(table + "\n")
    return summary


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--up-args", default="--kv-cache-memory 512MiB",
                        help="more pdserve up flags, one string")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=320)
    parser.add_argument("--result-dir", default=None)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    summary = run(parse_args(argv))
    return 0 if summary["valid"] == summary["total"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
