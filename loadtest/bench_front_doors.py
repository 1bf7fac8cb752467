"""What each front door of the gateway costs: the gRPC API, the OpenAI-compatible HTTP API
(/v1/completions and /v1/chat/completions) and the KServe v2 / Triton gRPC port
(ModelStreamInfer, one stream per request), on one stack, one run.

One ``pdserve up`` stack (its defaults: 1 prefill + 1 decode worker, plus ``--up-args``);
then ``--rounds`` rounds, each running, at concurrency 1 and then ``--concurrency``, the same
``pdserve bench serve`` workload through each front door in turn (the order rotates per
round, so no door always runs first or last): random prompts of ``--input-len`` tokens,
``--output-len`` tokens out with ignore_eos, every request its own cache salt (no prefix
reuse between doors). gRPC and /v1/completions send the same token ids; chat sends their
text as one user message, so its prompt is the chat template's few tokens longer; KServe
sends the text alone, which the gateway tokenizes (random tokens decoded and encoded again
are often other tokens, and more of them), so it is compared with grpc-text, the gRPC API
with the same text as raw_prompt.

The table shows TTFT and ITL p50/p99 per door and concurrency, pooled over rounds, and
each other door's difference to its baseline (gRPC; grpc-text for KServe), the target
being at most +2 ms on p50 TTFT and nothing measurable on ITL, with the per-round
differences beside it as the run's own noise.

    .venv/bin/python -m loadtest.bench_front_doors                     # the full run
    .venv/bin/python -m loadtest.bench_front_doors --rounds 1 --num-prompts-c1 2 \\
        --num-prompts-c16 16 --output-len 8                             # a quick check

Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import shlex
import tempfile
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from loadtest.bench_llamacpp import (
    CLI,
    OtherWork,
    log,
    noise_note,
    pdserve_stack,
    run_bench_serve,
)

DOORS = ("grpc", "grpc-text", "http", "http-chat", "kserve")
# The door each other door is compared with: the same prompt sent the same way (KServe
# sends text, which the gateway tokenizes; so does grpc-text, through raw_prompt).
BASELINE = {"kserve": "grpc-text"}


def baseline(door: str) -> str:
    return BASELINE.get(door, "grpc")


def door_flags(door: str, target: str, http_url: str, kserve: str) -> list[str]:
    if door == "grpc":
        return ["--backend", "pdserve", "--base-url", target]
    if door == "grpc-text":
        return ["--backend", "pdserve", "--base-url", target, "--prompt-as-text"]
    if door == "kserve":
        return ["--backend", "kserve", "--base-url", kserve]
    base = http_url.removesuffix("/v1")
    return ["--backend", "openai-chat" if door == "http-chat" else "openai", "--base-url", base]


def bench(
    args: argparse.Namespace, flags: list[str], model_dir: str, name: str, concurrency: int,
    num: int, seed: int, output_len: int, out_dir: Path,
) -> dict[str, Any]:  # fmt: skip
    argv = [*CLI, "bench", "serve", *flags, "--tokenizer", model_dir,
            "--served-model-name", Path(model_dir).name,
            "--label", name, "--dataset-name", "random",
            "--random-input-len", str(args.input_len), "--random-output-len", str(output_len),
            "--num-prompts", str(num), "--request-rate", "inf",
            "--max-concurrency", str(concurrency), "--seed", str(seed), "--ignore-eos",
            "--temperature", "0", "--unique-cache-salt", "--metric-percentiles", "50,99",
            "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", str(out_dir),
            "--result-filename", f"{name}.json"]  # fmt: skip
    return run_bench_serve(argv, out_dir, name, args.bench_timeout_s)


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def pooled(results: list[dict[str, Any]]) -> dict[str, float | None]:
    """TTFT and ITL percentiles over every request of every round (ms)."""
    ttfts = [t * 1000 for r in results for t in r["ttfts"] if t]
    itls = [x * 1000 for r in results for per in r["itls"] for x in per]
    return {
        "ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99),
        "itl_p50_ms": percentile(itls, 50), "itl_p99_ms": percentile(itls, 99),
        "requests": sum(r["completed"] for r in results),
        "failed": sum(r["failed"] for r in results),
    }  # fmt: skip


def paired(results: list[dict[str, Any]], base: list[dict[str, Any]]) -> dict[str, Any]:
    """Per request, this door's TTFT less gRPC's on the same prompt in the same round (at
    concurrency 1 the requests run one by one in the same order), in ms; and how many
    outputs equal gRPC's text (greedy: all of them)."""
    deltas = [
        (b - a) * 1000
        for r, g in zip(results, base, strict=True)
        for a, b in zip(g["ttfts"], r["ttfts"], strict=True)
        if a and b
    ]
    same = sum(
        x == y
        for r, g in zip(results, base, strict=True)
        for x, y in zip(g["generated_texts"], r["generated_texts"], strict=True)
    )
    total = sum(len(g["generated_texts"]) for g in base)
    return {"ttft_delta_p50_ms": percentile(deltas, 50), "same_text": same, "requests": total}


def cell(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def delta(value: float | None, base: float | None) -> str:
    return "-" if value is None or base is None else f"{value - base:+.2f}"


def format_table(summary: dict[str, Any], concurrencies: Sequence[int]) -> str:
    lines = [
        f"{'door':<10} {'conc':>4} {'n':>4} {'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} "
        f"{'p99':>7}  {'dTTFT p50':>9} {'dITL p50':>8}  per-round dTTFT p50 (ms)"
    ]
    for c in concurrencies:
        for door in DOORS:
            base = summary[f"{baseline(door)}-c{c}"]
            row = summary[f"{door}-c{c}"]
            rounds = summary["rounds"][f"{door}-c{c}"]
            base_rounds = summary["rounds"][f"{baseline(door)}-c{c}"]
            per_round = ", ".join(
                delta(a["ttft_p50_ms"], b["ttft_p50_ms"])
                for a, b in zip(rounds, base_rounds, strict=True)
            )
            lines.append(
                f"{door:<10} {c:>4} {row['requests']:>4} {cell(row['ttft_p50_ms']):>9} "
                f"{cell(row['ttft_p99_ms']):>8} {cell(row['itl_p50_ms']):>8} "
                f"{cell(row['itl_p99_ms']):>7}  "
                f"{'' if door == 'grpc' else delta(row['ttft_p50_ms'], base['ttft_p50_ms']):>9} "
                f"{'' if door == 'grpc' else delta(row['itl_p50_ms'], base['itl_p50_ms']):>8}  "
                f"{'' if door == 'grpc' else per_round}"
            )
    lines.append("")
    for door in DOORS[1:]:
        for c in concurrencies:
            p = summary["paired"][f"{door}-c{c}"]
            order = "paired by prompt" if c == 1 else "not paired (scheduling order differs)"
            same = {
                "http-chat": "n/a (its prompt has the chat template around it)",
            }.get(door, f"{p['same_text']}/{p['requests']}")
            lines.append(
                f"{door} c{c}: TTFT - {baseline(door)}'s per request, p50 "
                f"{cell(p['ttft_delta_p50_ms'])} ms ({order}); output text equal to "
                f"{baseline(door)}'s: {same}"
            )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from common.models.default_model import resolve_model
    from pdserve.cli.launcher import StackState

    model_dir = resolve_model(args.model)
    out = Path(args.result_dir or tempfile.mkdtemp(prefix="front-doors-"))
    out.mkdir(parents=True, exist_ok=True)
    concurrencies = (1, args.concurrency)
    nums = {1: args.num_prompts_c1, args.concurrency: args.num_prompts_c16}
    runs: dict[str, list[dict[str, Any]]] = {f"{d}-c{c}": [] for d in DOORS for c in concurrencies}
    others: list[float] = []
    run_dir = out / "stack"
    with pdserve_stack(run_dir, shlex.split(args.up_args)) as (target, _env):
        state = StackState.load(run_dir / "stack.json")
        assert state is not None and state.http and state.kserve, "a front door is off"
        doors = {d: door_flags(d, target, state.http, state.kserve) for d in DOORS}
        pids = [c.pid for c in state.children if c.pid]  # the stack's work is not "other"
        log(f"stack: gRPC {target}, HTTP {state.http}")
        for door in DOORS:  # first-call costs before anything is measured
            bench(args, doors[door], model_dir, f"warmup-{door}", args.concurrency,
                  args.warmup_prompts, args.seed + 999, 8, out)  # fmt: skip
        for i in range(args.rounds):
            order = DOORS[i % len(DOORS):] + DOORS[: i % len(DOORS)]
            for c in concurrencies:
                seed = args.seed + 10 * i + c
                for door in order:
                    with OtherWork(pids) as meter:
                        result = bench(args, doors[door], model_dir, f"{door}-c{c}-r{i}", c,
                                       nums[c], seed, args.output_len, out)  # fmt: skip
                    others.append(meter.fraction)
                    runs[f"{door}-c{c}"].append(result)
                    figures = pooled([result])
                    log(f"  round {i + 1} {door:<9} c{c:<3} TTFT p50 "
                        f"{cell(figures['ttft_p50_ms'])} ms, ITL p50 "
                        f"{cell(figures['itl_p50_ms'])} ms{noise_note(meter.fraction)}")
    summary: dict[str, Any] = {key: pooled(results) for key, results in runs.items()}
    summary["rounds"] = {key: [pooled([r]) for r in results] for key, results in runs.items()}
    summary["paired"] = {
        f"{d}-c{c}": paired(runs[f"{d}-c{c}"], runs[f"{baseline(d)}-c{c}"])
        for d in DOORS[1:] for c in concurrencies
    }  # fmt: skip
    summary["other_cpu_max"] = max(others, default=0.0)
    summary["date"] = datetime.now().isoformat(timespec="seconds")
    summary["args"] = vars(args)
    (out / "front_doors.json").write_text(json.dumps(summary, indent=2))
    table = format_table(summary, concurrencies)
    log("\n" + table)
    log(f"\nother work on the CPUs, worst run: {summary['other_cpu_max']:.0%}; results {out}")
    (out / "front_doors.txt").write_text(table + "\n")
    return summary


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--model", default=None, help="checkpoint directory (default model)")
    parser.add_argument("--up-args", default="--kv-cache-memory 512MiB",
                        help="more pdserve up flags, one string")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-prompts-c1", type=int, default=48)
    parser.add_argument("--num-prompts-c16", type=int, default=48)
    # Short prompts: a long prefill's own spread (tens of ms here) would hide a front
    # door's cost of a millisecond or two.
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--warmup-prompts", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bench-timeout-s", type=float, default=1800)
    parser.add_argument("--result-dir", default=None)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    summary = run(args)
    failed = sum(summary[f"{d}-c{c}"]["failed"] for d in DOORS for c in (1, args.concurrency))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
