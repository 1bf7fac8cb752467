"""Two checkouts of pdserve, the same stack and workload, alternated in one sitting.

A VM's speed moves between minutes (memory bandwidth here: 28-48 GB/s within a session), so
a before / after measured an hour apart says little. This starts ``pdserve up`` from each
checkout in turn (``python -m pdserve`` with the checkout as working directory, so its code
and its C++ kernels are the ones that run), ``--rounds`` times, each round a fresh stack, a
short warm-up and then ``pdserve bench serve`` on fresh random prompts (a new seed every run,
so no run hits another's prefix cache); and prints output tok/s, TTFT and ITL of every run,
each arm's median, and the CPU-seconds each process of the stack used during the measured
run (from /proc), which shows where a change moved work.

    git worktree add /tmp/before HEAD~1
    .venv/bin/python -m loadtest.stack_ab --b /tmp/before --rounds 3 \\
        --up-args "--model ~/.cache/pdserve/bench-quant/SmolLM2-135M-Instruct.Q4_K_M.gguf \\
                   --quant-act-bits 8 --kv-dtype float16"

Run it on a quiet machine; ``--a`` is this checkout by default.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from pdserve.cli.launcher import free_port

REPO = Path(__file__).resolve().parents[1]


def cpu_seconds() -> dict[int, tuple[float, str]]:
    """CPU seconds (user + system) of every process, with its command line."""
    seen: dict[int, tuple[float, str]] = {}
    for proc in psutil.process_iter(["cmdline", "cpu_times"]):
        times, command = proc.info["cpu_times"], proc.info["cmdline"]
        if times is not None and command is not None:
            seen[proc.pid] = (times.user + times.system, " ".join(command))
    return seen


def role_of(command: str) -> str | None:
    words = command.split()
    for role in ("gateway", "decode", "prefill", "blockstore", "redis-server"):
        if role in words or any(w.endswith(role) for w in words[:2]):
            return role
    return None


def one_run(checkout: Path, args: argparse.Namespace, seed: int, out: Path) -> dict[str, Any]:
    python = [sys.executable, "-m", "pdserve", "--log-level", "WARNING"]
    env = {**os.environ, "PDSERVE_RUN_DIR": str(out / f"stack-{seed}")}
    port = free_port()
    up = [*python, "up", "--detach", "--port", str(port), "--http-port", "0",
          "--kserve-port", "0", *shlex.split(os.path.expanduser(args.up_args))]  # fmt: skip
    subprocess.run(up, cwd=checkout, env=env, check=True, capture_output=True, timeout=1200)
    try:
        bench = [*python, "bench", "serve", "--backend", "pdserve", "--base-url",
                 f"127.0.0.1:{port}", "--dataset-name", "random", "--random-input-len",
                 str(args.input_len), "--request-rate", "inf", "--max-concurrency",
                 str(args.concurrency), "--ignore-eos", "--temperature", "0", "--disable-tqdm"]  # fmt: skip
        if args.tokenizer:
            bench += ["--tokenizer", os.path.expanduser(args.tokenizer)]
        subprocess.run([*bench, "--num-prompts", str(args.concurrency), "--seed",
                        str(seed + 100_000), "--random-output-len", "16"],
                       cwd=checkout, env=env, check=True, capture_output=True)  # fmt: skip
        before = cpu_seconds()
        subprocess.run([*bench, "--num-prompts", str(args.num_prompts), "--seed", str(seed),
                        "--random-output-len", str(args.output_len), "--save-result",
                        "--result-dir", str(out), "--result-filename", f"run-{seed}.json"],
                       cwd=checkout, env=env, check=True, capture_output=True)  # fmt: skip
        after = cpu_seconds()
    finally:
        subprocess.run([*python, "down"], cwd=checkout, env=env, capture_output=True, timeout=300)
    result = json.loads((out / f"run-{seed}.json").read_text())
    cpu: dict[str, float] = {}
    for pid, (seconds, command) in after.items():
        role = role_of(command) if pid in before and "bench serve" not in command else None
        if role is not None:
            cpu[role] = cpu.get(role, 0.0) + seconds - before[pid][0]
    return {
        "output_tok_s": float(result["output_throughput"]),
        "ttft_p50_ms": float(result["median_ttft_ms"]),
        "itl_p50_ms": float(result["median_itl_ms"]),
        "cpu_s": cpu,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--a", type=Path, default=REPO, help="checkout A (this one)")
    parser.add_argument("--b", type=Path, required=True, help="checkout B (e.g. a worktree)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--up-args", default="", help="pdserve up flags, both arms")
    parser.add_argument("--tokenizer", default=None, help="bench serve --tokenizer")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--input-len", type=int, default=104)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=int(time.time()) % 10_000 * 10)
    parser.add_argument("--json", type=Path, default=None, help="write every run here")
    args = parser.parse_args()
    arms = {"A": args.a.resolve(), "B": args.b.resolve()}
    runs: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
    with tempfile.TemporaryDirectory(prefix="stack-ab-") as tmp:
        seed = args.seed
        for r in range(args.rounds):
            for arm in ("B", "A"):  # the baseline first in every round
                seed += 1
                run = one_run(arms[arm], args, seed, Path(tmp))
                runs[arm].append(run)
                cpu = "  ".join(f"{k} {v:.2f}" for k, v in sorted(run["cpu_s"].items()))
                print(f"round {r + 1} {arm}: {run['output_tok_s']:7.1f} tok/s  TTFT p50 "
                      f"{run['ttft_p50_ms']:7.1f} ms  ITL p50 {run['itl_p50_ms']:6.2f} ms  "
                      f"CPU s: {cpu}", flush=True)  # fmt: skip
    medians = {arm: statistics.median(r["output_tok_s"] for r in rs) for arm, rs in runs.items()}
    print(f"\nA = {arms['A']}\nB = {arms['B']}")
    print(f"median output tok/s: A {medians['A']:.1f}, B {medians['B']:.1f}, "
          f"A / B {medians['A'] / medians['B']:.3f}")  # fmt: skip
    if args.json:
        record = {"arms": arms, "args": vars(args), "runs": runs, "medians": medians}
        args.json.write_text(json.dumps(record, indent=2, default=str))


if __name__ == "__main__":
    main()
