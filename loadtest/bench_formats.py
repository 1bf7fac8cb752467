"""Decode speed of one model in several weight formats, same run: the float checkpoint
(``--quantization none``) as the baseline, then each quantized checkpoint given, and where
a GGUF file is given and llama.cpp's ``llama-bench`` is built, llama.cpp on the same file.

For each: weight bytes as held, single-stream decode tokens/s (a ``--prompt``-token prompt,
32 by default, then ``--tokens`` greedy tokens, one sequence; the time from its first token
to its last), and 16-stream decode tokens/s (16 such sequences at once, all tokens after
each sequence's first over the wall time from the last prefill). llama-bench's ``tg``
figure is its single-stream decode after a context of the same length (``-p 0 -n TOKENS
-d PROMPT``, same thread count), run alone just before the file's engine in every round;
``x llama`` is the median over rounds of the engine's single stream over the llama-bench
run beside it. A long ``--prompt`` (1000) shows what attention over the
context costs each format; ``--kv-dtype float16`` keeps the KV cache in half the bytes (as
llama.cpp keeps its own).

    .venv/bin/python loadtest/bench_formats.py --float ~/.cache/pdserve/models/SmolLM2-135M-Instruct \\
        --format w4a16=~/.cache/pdserve/bench-quant/SmolLM2-135M-Instruct-bf16-w4a16-g64 \\
        --format Q4_K_M=path/to/file.gguf [--llama-bench ~/.cache/pdserve/llama.cpp/bin/llama-bench]

A format's spec is ``LABEL=PATH[@QUANTIZATION][+a8]``: ``+a8`` runs it with 8-bit activation
codes (``--quant-act-bits 8``).

Run it on a quiet machine; it prints a table and, with ``--json``, the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import common.openmp  # noqa: F401  (before torch, run as a script too: OpenMP's wait policy)

# isort: split
import torch

from common.contract.sampling import SamplingParams
from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.models.default_model import resolve_model
from common.models.quant.load import weight_bytes

PROMPT = 32  # prompt tokens per stream by default (--prompt)
STREAMS = 16


def run(engine: Engine, streams: int, tokens: int, seed: int, prompt_len: int = PROMPT) -> float:
    """Decode tokens/s of ``streams`` sequences of ``tokens`` each: the tokens of the steps
    after every sequence has its first token, over those steps' time."""
    rng = torch.Generator().manual_seed(seed)
    vocab = engine.runner.model.spec.vocab_size
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    for i in range(streams):
        prompt = torch.randint(100, vocab, (prompt_len,), generator=rng).tolist()
        engine.add_request(f"s{seed}-{i}", prompt, params)
    started: set[str] = set()
    start, decoded, end = 0.0, 0, 0.0
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        if len(started) == streams:
            decoded += sum(len(out.new_token_ids) for out in outputs)
            end = now
        else:
            started.update(out.request_id for out in outputs if out.new_token_ids)
            start = now
    return decoded / max(1e-9, end - start)


def measure(
    label: str, model: str, quantization: str, tokens: int, prompt_len: int, kv_dtype: str
) -> dict[str, Any]:
    quantization, _, act = quantization.partition("+a")
    config = EngineConfig(model=resolve_model(model), device="cpu", quantization=quantization,
                          kv_cache_memory="2GiB", max_num_seqs=STREAMS, kv_dtype=kv_dtype,
                          quant_act_bits=int(act or 16))  # fmt: skip
    start = time.perf_counter()
    engine = Engine(config)
    load_s = time.perf_counter() - start
    run(engine, 1, 8, seed=99)  # warm-up
    single = max(run(engine, 1, tokens, seed=s, prompt_len=prompt_len) for s in range(3))
    multi = run(engine, STREAMS, tokens // 2, seed=7, prompt_len=prompt_len)
    return {
        "label": label, "model": model, "format": engine.runner.weight_format.describe(),
        "weight_mb": round(weight_bytes(engine.runner.model) / 2**20, 1),
        "load_s": round(load_s, 1), "single_tok_s": round(single, 1),
        f"c{STREAMS}_tok_s": round(multi, 1),
    }  # fmt: skip


def progress(round_number: int, result: dict[str, Any], llama_figure: float | None) -> str:
    """One measurement's line as it ends: the engine's figures and the llama-bench run
    beside it, if one ran and worked."""
    beside = "" if llama_figure is None else f", llama-bench {llama_figure:.1f} tok/s"
    return (f"round {round_number}: {result['label']} 1 stream {result['single_tok_s']} tok/s, "
            f"{STREAMS} streams {result[f'c{STREAMS}_tok_s']} tok/s{beside}")  # fmt: skip


def llama_bench(
    binary: Path, gguf: str, tokens: int, threads: int, prompt_len: int
) -> float | None:
    """llama-bench's ``tg`` on the file, as built (its weight repacking on). Where that run
    dies (llama.cpp's AMX repacking crashed with a context, ``-d``, on an Intel Xeon), the
    better of the two runs that work: repacking off at the same context, and repacking on
    with no context; the fallback is printed."""
    figure = _llama_bench_run(binary, gguf, tokens, threads, ["-d", str(prompt_len)])
    if figure is not None or not prompt_len:
        return figure
    tries = {
        "--repack 0": _llama_bench_run(
            binary, gguf, tokens, threads, ["-d", str(prompt_len), "--repack", "0"]
        ),
        "-d 0": _llama_bench_run(binary, gguf, tokens, threads, ["-d", "0"]),
    }
    done = {k: v for k, v in tries.items() if v is not None}
    if not done:
        return None
    best = max(done, key=lambda k: done[k])
    print(f"llama-bench failed with -d {prompt_len}; the best of {tries}: {best}")
    return done[best]


def _llama_bench_run(
    binary: Path, gguf: str, tokens: int, threads: int, extra: list[str]
) -> float | None:
    # llama.cpp's OpenMP threads wait actively between its barriers; the passive policy the
    # engine asks for (common/openmp.py) cost it 3-4x here, so it runs without it.
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    done = subprocess.run(
        [str(binary), "-m", gguf, "-p", "0", "-n", str(tokens), "-t", str(threads),
         "-o", "json", *extra],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    if done.returncode:
        print(f"llama-bench {' '.join(extra)}: exit {done.returncode} {done.stderr[-2000:]}")
        return None
    rows = json.loads(done.stdout)
    return float(rows[0]["avg_ts"]) if rows else None


def summarize(done_rounds: list[dict[str, Any]], tg_rounds: list[float]) -> dict[str, Any]:
    """A format's row: its first round's fields, each speed the best of its rounds (every
    round kept), and where llama-bench ran beside it, llama.cpp's best round and the single
    stream's ratio to it per round (each engine round over the llama-bench run just before
    it) with their median: the figure a drifting machine moves least."""
    row = dict(done_rounds[0])
    for key in ("single_tok_s", f"c{STREAMS}_tok_s"):
        row[key] = max(r[key] for r in done_rounds)
        row[f"{key}_rounds"] = [r[key] for r in done_rounds]
    if tg_rounds:
        row["llama_bench_tg"] = max(tg_rounds)
        row["llama_bench_tg_rounds"] = tg_rounds
        if len(tg_rounds) == len(done_rounds):
            ratios = [r["single_tok_s"] / tg for r, tg in zip(done_rounds, tg_rounds, strict=True)]
            row["single_x_llama_bench_rounds"] = [round(x, 3) for x in ratios]
            row["single_x_llama_bench_median"] = round(statistics.median(ratios), 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--float", required=True, help="the float checkpoint (the baseline)")
    parser.add_argument("--format", action="append", default=[], help="LABEL=PATH[@quantization]")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=PROMPT, help="prompt tokens per stream")
    parser.add_argument("--kv-dtype", default="auto", help="every engine's KV cache dtype")
    parser.add_argument("--llama-bench", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="measure every format this many times, in turn (this VM's figures move 10-20 %% "
        "between runs); each figure is a format's best round, every round in --json",
    )  # fmt: skip
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # one format, in a child process
    args = parser.parse_args()
    if args.measure:
        label, path, quantization = json.loads(args.measure)
        print("RESULT " + json.dumps(measure(label, path, quantization, args.tokens, args.prompt,
                                               args.kv_dtype)))
        return
    specs = [("float32", args.float, "none")]
    for spec in args.format:
        label, _, rest = spec.partition("=")
        rest, _, act = os.path.expanduser(rest).partition("+a")
        path, _, quantization = rest.partition("@")
        specs.append((label, path, (quantization or "auto") + (f"+a{act}" if act else "")))
    # Each round: every format in a process of its own (an engine's kernel threads must not
    # share the cores with the next measurement), a GGUF file's llama-bench run alone just
    # before it, so that each engine round has a llama.cpp figure taken minutes apart at most.
    rounds: list[list[dict[str, Any]]] = [[] for _ in specs]
    tg_rounds: list[list[float]] = [[] for _ in specs]
    for round_number in range(1, args.rounds + 1):
        for (label, path, quantization), done_rounds, tg in zip(specs, rounds, tg_rounds, strict=True):
            figure = None
            if args.llama_bench and path.endswith(".gguf"):
                figure = llama_bench(args.llama_bench, path, args.tokens, args.threads, args.prompt)
                if figure is not None:
                    tg.append(figure)
            done = subprocess.run(
                [sys.executable, __file__, "--float", args.float, "--tokens", str(args.tokens),
                 "--prompt", str(args.prompt), "--kv-dtype", args.kv_dtype,
                 "--measure", json.dumps([label, path, quantization])],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
            done_rounds.append(json.loads(line.removeprefix("RESULT ")))
            # Progress as each measurement ends (a round of many formats takes minutes).
            print(progress(round_number, done_rounds[-1], figure), file=sys.stderr, flush=True)
    rows = [summarize(done, tg) for done, tg in zip(rounds, tg_rounds, strict=True)]
    base = rows[0]
    cpu = next(
        (re.sub(r"\s+", " ", line.split(":", 1)[1]).strip()
         for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
        "?",
    )  # fmt: skip
    print(f"CPU: {cpu}, {args.threads} threads; {args.prompt}-token prompts, "
          f"{args.tokens} tokens per stream, KV cache {args.kv_dtype}")  # fmt: skip
    print(f"{'format':<12} {'MB':>7} {'1 stream':>9} {'x float':>8} {f'{STREAMS} streams':>11} "
          f"{'x float':>8} {'llama-bench':>12} {'x llama':>9}  layout")  # fmt: skip
    for r in rows:
        lb = r.get("llama_bench_tg")
        ratio = r.get("single_x_llama_bench_median")
        print(
            f"{r['label']:<12} {r['weight_mb']:>7} {r['single_tok_s']:>9} "
            f"{r['single_tok_s'] / base['single_tok_s']:>8.2f} {r[f'c{STREAMS}_tok_s']:>11} "
            f"{r[f'c{STREAMS}_tok_s'] / base[f'c{STREAMS}_tok_s']:>8.2f} "
            f"{'' if lb is None else f'{lb:.1f}':>12} {'' if ratio is None else f'{ratio:.2f}':>9}"
            f"  {r['format']}"
        )
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu, "threads": args.threads, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
