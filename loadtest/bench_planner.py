"""A real local run with a load shift, the planner against every fixed split of the same
workers (issue 29's live check), and the records the simulator is calibrated on.

Each configuration is its own ``pdserve up`` stack of ``--workers`` engine workers (same
threads for all: ``--threads-per-worker``): every fixed split ``P prefill + D decode`` of
that total, then ``--planner`` starting from the first split. Each replays the same open-loop
schedule: phase A (long prompts, few output tokens), then phase B (short prompts, many
output tokens), same arrival rate, every prompt distinct random tokens (no prefix hits).
Per request the client measures TTFT and its mean time per output token after the first
(TPOT); a request attains the SLA when both are within the targets. Printed per
configuration: attainment per phase and overall, TTFT and TPOT p50/p90, and for the planner
the splits it chose when; with ``--record DIR`` each run's RUN.json
(``pdserve bench plan-sim --calibrate RUN.json``).

    python -m loadtest.bench_planner --ttft-ms 6000 --itl-ms 60 --rate 0.3 --phase-s 150

Run it on a quiet machine: both workers share its cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common.planner.types import Split
from loadtest.arrival import arrival_offsets
from loadtest.backends.base import RequestOutput, SendOptions
from loadtest.backends.grpc_gateway import GrpcGatewayBackend
from loadtest.datasets.base import SampleRequest
from loadtest.datasets.random_dataset import random_requests
from pdserve.cli.launcher import free_port


@dataclass(frozen=True)
class Phase:
    name: str
    prompt_tokens: int
    output_tokens: int


@dataclass
class Result:
    config: str
    requests: list[dict[str, float | str | int]] = field(default_factory=list)
    splits: list[tuple[float, Split]] = field(default_factory=list)  # (at_s, split) seen


def schedule(args: argparse.Namespace, vocab_size: int) -> list[tuple[float, str, SampleRequest]]:
    """(send offset, phase name, request) for both phases, the same in every run."""
    phases = [Phase("A", args.prompt_a, args.output_a), Phase("B", args.prompt_b, args.output_b)]
    per_phase = round(args.rate * args.phase_s)
    out: list[tuple[float, str, SampleRequest]] = []
    for number, phase in enumerate(phases):
        offsets = arrival_offsets(per_phase, args.rate, args.burstiness, seed=args.seed + number)
        requests = random_requests(
            per_phase, phase.prompt_tokens, phase.output_tokens, vocab_size,
            seed=args.seed + 10 * number,
        )  # fmt: skip
        out += [(number * args.phase_s + t, phase.name, r) for t, r in zip(offsets, requests, strict=True)]
    return out


def tpot_ms(out: RequestOutput) -> float:
    """Mean time per output token after the first (0 for one token)."""
    if out.output_tokens < 2 or not out.chunk_times:
        return 0.0
    return (out.end_time - out.chunk_times[0]) * 1000 / (out.output_tokens - 1)


async def replay(
    target: str, plan: list[tuple[float, str, SampleRequest]], on_tick: object = None
) -> list[dict[str, float | str | int]]:
    backend = GrpcGatewayBackend(target, timeout_s=600)
    await backend.ready(60)
    start = time.perf_counter()
    results: list[dict[str, float | str | int]] = []

    async def one(offset: float, phase: str, request: SampleRequest, index: int) -> None:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        out = await backend.send(request, f"shift-{index}", SendOptions())
        results.append({
            "phase": phase, "arrival_s": out.start_time - start,
            "prompt_tokens": len(request.prompt_token_ids), "cached_tokens": out.cached_tokens,
            "output_tokens": out.output_tokens, "ttft_ms": out.ttft * 1000 if out.success else -1,
            "itl_ms": tpot_ms(out), "ok": int(out.success), "error": out.error,
        })  # fmt: skip

    try:
        await asyncio.gather(*(one(t, p, r, i) for i, (t, p, r) in enumerate(plan)))
    finally:
        await backend.close()
    return sorted(results, key=lambda r: float(r["arrival_s"]))


def pdserve(env: dict[str, str], *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdserve", *args], env=env, capture_output=True, text=True,
        timeout=timeout, check=False,
    )  # fmt: skip


def watch_splits(env: dict[str, str], target: str, result: Result, start: float, stop: asyncio.Event) -> asyncio.Task[None]:  # fmt: skip
    """Records the engine workers' roles every second (the split in force over time)."""

    async def run() -> None:
        while not stop.is_set():
            status = await asyncio.to_thread(pdserve, env, "status", "--target", target, "--json")
            if status.returncode == 0:
                roles = [w["role"] for w in json.loads(status.stdout)
                         if w["role"] in ("prefill", "decode", "both")]  # fmt: skip
                prefill = roles.count("prefill")
                if len(roles) > prefill:
                    split = Split(prefill, len(roles) - prefill)
                    if not result.splits or result.splits[-1][1] != split:
                        result.splits.append((time.perf_counter() - start, split))
            await asyncio.sleep(1.0)

    return asyncio.create_task(run())


def run_config(args: argparse.Namespace, name: str, split: Split, planner: bool,
               plan: list[tuple[float, str, SampleRequest]]) -> Result:  # fmt: skip
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench-planner-{name}-"))
    env = {**os.environ, "PDSERVE_RUN_DIR": str(run_dir), "PDSERVE_LOG_LEVEL": "INFO"}
    port = free_port()
    target = f"127.0.0.1:{port}"
    up = ["up", "--detach", "--port", str(port), "--http-port", "-1", "--kserve-port", "-1",
          "--prefill", str(split.prefill), "--decode", str(split.decode),
          "--threads-per-worker", str(args.threads), "--kv-cache-memory", args.kv_cache_memory,
          "--local-prefill-tokens", str(args.local_prefill_tokens)]  # fmt: skip
    if args.kv_prefault:
        up.append("--kv-prefault")
    if planner:
        up += ["--planner", "--ttft-ms", str(args.ttft_ms), "--itl-ms", str(args.itl_ms),
               "--interval-s", str(args.interval_s), "--dwell-s", str(args.dwell_s)]  # fmt: skip
    started = pdserve(env, *up)
    if started.returncode != 0:
        raise RuntimeError(f"pdserve up failed:\n{started.stdout}\n{started.stderr}")
    result = Result(name)
    try:

        async def go() -> None:
            stop = asyncio.Event()
            watcher = watch_splits(env, target, result, time.perf_counter(), stop)
            try:
                result.requests = await replay(target, plan)
            finally:
                stop.set()
                await watcher

        asyncio.run(go())
    finally:
        pdserve(env, "down", timeout=120)
    result.config = name
    (run_dir / "result.json").write_text(json.dumps(result.requests))
    print(f"  {name}: logs in {run_dir / 'logs'}", flush=True)
    return result


def attainment(requests: list[dict[str, float | str | int]], args: argparse.Namespace,
               phase: str | None = None) -> float:  # fmt: skip
    chosen = [r for r in requests if phase is None or r["phase"] == phase]
    if not chosen:
        return 0.0
    met = [r for r in chosen if r["ok"] and 0 <= float(r["ttft_ms"]) <= args.ttft_ms
           and float(r["itl_ms"]) <= args.itl_ms]  # fmt: skip
    return len(met) / len(chosen)


def describe(result: Result, args: argparse.Namespace) -> str:
    rows = result.requests
    ttft = np.array([float(r["ttft_ms"]) for r in rows if r["ok"]])
    tpot = np.array([float(r["itl_ms"]) for r in rows if r["ok"]])
    failed = sum(1 for r in rows if not r["ok"])
    line = (f"{result.config:<10} attainment A {attainment(rows, args, 'A'):.2f}  "
            f"B {attainment(rows, args, 'B'):.2f}  all {attainment(rows, args):.2f}   "
            f"ttft p50/p90 {np.percentile(ttft, 50):.0f}/{np.percentile(ttft, 90):.0f} ms   "
            f"tpot p50/p90 {np.percentile(tpot, 50):.1f}/{np.percentile(tpot, 90):.1f} ms"
            f"   failed {failed}")  # fmt: skip
    if len(result.splits) > 1 or "planner" in result.config:
        line += "\n" + " " * 11 + "splits: " + ", ".join(f"{s} at {t:.0f} s" for t, s in result.splits)
    return line


def record(result: Result, args: argparse.Namespace, directory: Path, split: Split) -> None:
    """RUN.json for ``pdserve bench plan-sim --calibrate``."""
    changes = [{"at_s": t, "split": {"prefill": s.prefill, "decode": s.decode}}
               for t, s in result.splits] or [
        {"at_s": 0.0, "split": {"prefill": split.prefill, "decode": split.decode}}]  # fmt: skip
    run = {
        "cores": len(os.sched_getaffinity(0)), "threads_per_worker": args.threads,
        "workers_per_host": args.workers, "profile": args.profile or "cpu",
        "local_prefill_tokens": args.local_prefill_tokens,
        "targets": {"ttft_ms": args.ttft_ms, "itl_ms": args.itl_ms},
        "phases": [{"name": "A", "start_s": 0.0, "end_s": args.phase_s},
                   {"name": "B", "start_s": args.phase_s, "end_s": 2 * args.phase_s}],
        "changes": changes,
        "requests": result.requests,
    }  # fmt: skip
    path = directory / f"run-{result.config}.json"
    path.write_text(json.dumps(run, indent=1))
    print(f"  recorded {path}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ttft-ms", type=float, required=True)
    parser.add_argument("--itl-ms", type=float, required=True)
    parser.add_argument("--rate", type=float, default=0.3, help="requests per second, both phases")
    parser.add_argument("--phase-s", type=float, default=150.0)
    parser.add_argument("--burstiness", type=float, default=1.0)
    parser.add_argument("--prompt-a", type=int, default=1500)
    parser.add_argument("--output-a", type=int, default=8)
    parser.add_argument("--prompt-b", type=int, default=50)
    parser.add_argument("--output-b", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2, help="engine workers of every config")
    parser.add_argument("--threads", type=int, default=1, help="threads of each worker")
    parser.add_argument("--kv-cache-memory", default="512MiB")
    parser.add_argument("--kv-prefault", action="store_true",
                        help="workers write their KV pools at start (no page faults later)")
    parser.add_argument("--local-prefill-tokens", type=int, default=16)
    parser.add_argument("--interval-s", type=float, default=5.0)
    parser.add_argument("--dwell-s", type=float, default=20.0)
    parser.add_argument("--configs", default="fixed,planner",
                        help="fixed (every split), planner, or splits like 1P+1D")  # fmt: skip
    parser.add_argument("--record", default=None, help="write each run's RUN.json here")
    parser.add_argument("--profile", default="",
                        help="the profile RUN.json names (relative to it); with --record and "
                        "none given, one measured here before the runs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from transformers import AutoConfig

    from common.models.default_model import resolve_model

    vocab = AutoConfig.from_pretrained(resolve_model(None)).vocab_size
    plan = schedule(args, vocab)
    fixed = [Split(p, args.workers - p) for p in range(args.workers)]
    configs: list[tuple[str, Split, bool]] = []
    for item in args.configs.split(","):
        if item == "fixed":
            configs += [(str(s), s, False) for s in fixed]
        elif item == "planner":
            configs.append(("planner", fixed[-1], True))  # starts disaggregated
        else:
            p, d = item.rstrip("D").split("P+")
            configs.append((item, Split(int(p), int(d)), False))
    print(f"{len(plan)} requests over {2 * args.phase_s:.0f} s at {args.rate}/s; targets ttft "
          f"{args.ttft_ms:.0f} ms, tpot {args.itl_ms:.0f} ms", flush=True)  # fmt: skip
    if args.record and not args.profile:
        # The simulator's profile, measured here before any stack starts: the one each
        # stack's workers take at start is measured while its other workers load, and
        # came out 35 % slow on this machine.
        Path(args.record).mkdir(parents=True, exist_ok=True)
        path = Path(args.record) / f"profile-t{args.threads}.json"
        got = pdserve(dict(os.environ), "profile", "--threads", str(args.threads), "--json", str(path))
        if got.returncode != 0:
            raise RuntimeError(f"pdserve profile failed:\n{got.stderr[-2000:]}")
        args.profile = path.name
    results = []
    for name, split, planner in configs:
        print(f"running {name} ...", flush=True)
        result = run_config(args, name, split, planner, plan)
        results.append(result)
        if args.record:
            Path(args.record).mkdir(parents=True, exist_ok=True)
            record(result, args, Path(args.record), split)
        print(describe(result, args), flush=True)
    print("\nsummary")
    for result in results:
        print(describe(result, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
