"""``pdserve bench soak``: a stack under steady open-loop load, at a fraction of its measured
capacity, for a long time, watching every process's memory.

1. The stack: by default ``pdserve up --detach`` in a private run directory (every process
   real: redis-server, block store, workers, gateway), stopped at the end; or ``--run-dir``
   of a stack you started (its ``stack.json`` names the processes).
2. Capacity: ``--capacity-clients`` closed-loop clients for ``--capacity-s`` seconds on the
   soak's own request mix; completions per second. ``--capacity-rps`` skips it.
3. The soak: Poisson arrivals at ``--load-fraction`` x capacity for ``--duration-s``. Half
   the prompts share one of a few long prefixes (cache hits, and evictions as the pools
   fill), half are random with lengths spread by ``--range-ratio``.
4. Every ``--sample-s``: each process's RSS (psutil). Growth is measured from the first
   sample after ``--warmup-s`` (allocators, caches and the KV pools settle first) to the
   end, and as a least-squares slope over that span in MiB per hour.
5. After the load: every KV block free again, per worker (from the gateway's
   GetClusterStatus).

Writes soak.json (setup, capacity, per-process memory, failures by status code, latency
per window), soak.txt and soak.png (RSS over time; TTFT and TPOT per window).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.backends.base import RequestOutput, SendOptions
from loadtest.backends.grpc_gateway import GrpcGatewayBackend
from loadtest.datasets.base import SampleRequest
from loadtest.datasets.prefix_repetition import prefix_repetition_requests
from loadtest.datasets.random_dataset import random_requests
from loadtest.metrics import calculate_metrics
from loadtest.runner import LoadConfig, run_load

MiB = 2**20
SUMMARY_KEYS = (
    "request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "p99_tpot_ms", "p99_itl_ms", "p99_e2el_ms", "prefix_cache_hit_rate",
)  # fmt: skip


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 1800.0
    load_fraction: float = 0.7
    capacity_rps: float | None = None  # None: measured first
    capacity_s: float = 60.0
    capacity_clients: int = 8
    input_len: int = 256
    output_len: int = 32
    range_ratio: float = 0.5
    num_prefixes: int = 8
    sample_s: float = 10.0
    warmup_s: float = 120.0
    windows: int = 6  # latency and failures reported per this many equal spans
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.load_fraction <= 2:
            raise ValueError(f"load_fraction must be in (0, 2], got {self.load_fraction}")
        if self.duration_s <= 0 or self.sample_s <= 0 or self.capacity_s <= 0:
            raise ValueError("duration_s, sample_s and capacity_s must be positive")
        if self.warmup_s >= self.duration_s:
            raise ValueError("warmup_s must be shorter than duration_s")


# -- memory ------------------------------------------------------------------------------------


# A process's resident memory by where it lies (/proc/PID/smaps), so that growth can be
# told apart: anonymous mappings of at least BIG_MAPPING bytes (a worker's KV pool, whose
# pages become resident as its blocks are first used: growth that ends at the pool's size),
# the C heap and the other anonymous mappings (glibc's arenas, thread stacks: what a leak or
# the allocator's retention grows), and mapped files (code, the model's weights).
BIG_MAPPING = 256 * MiB
RSS_PARTS = ("big_anon", "heap", "files")


def rss_parts(pid: int) -> dict[str, int] | None:
    """Resident bytes of ``pid`` by RSS_PARTS; None if its smaps cannot be read."""
    parts = dict.fromkeys(RSS_PARTS, 0)
    name, size = "", 0
    try:
        with open(f"/proc/{pid}/smaps", encoding="ascii", errors="replace") as f:
            for line in f:
                if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                    fields = line.split(maxsplit=5)
                    name = fields[5].strip() if len(fields) > 5 else ""
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    size = end - start
                elif line.startswith("Rss:"):
                    rss = int(line.split()[1]) * 1024
                    if name and not name.startswith("["):
                        parts["files"] += rss
                    elif not name and size >= BIG_MAPPING:
                        parts["big_anon"] += rss
                    else:
                        parts["heap"] += rss
    except OSError:
        return None
    return parts


@dataclass
class MemoryTrack:
    """RSS samples of one process: (seconds since the soak started, bytes), and the same
    samples by part (rss_parts)."""

    name: str
    pid: int
    samples: list[tuple[float, int]] = field(default_factory=list)
    exited_at_s: float | None = None
    parts: list[tuple[float, dict[str, int]]] = field(default_factory=list)

    def summary(self, warmup_s: float) -> dict[str, Any]:
        settled = [(t, rss) for t, rss in self.samples if t >= warmup_s] or self.samples[-1:]
        out: dict[str, Any] = {"name": self.name, "pid": self.pid, "exited_at_s": self.exited_at_s}
        if not settled:
            return out
        start, end = settled[0][1], settled[-1][1]
        # The second half alone: a cache that fills to its bound (the block store) takes
        # longer than any fixed warm-up; a leak still grows there.
        half = self.samples[-1][0] / 2
        late = [(t, rss) for t, rss in self.samples if t >= half]
        out.update(
            rss_start_mib=round(self.samples[0][1] / MiB, 1),
            rss_settled_mib=round(start / MiB, 1),
            rss_end_mib=round(end / MiB, 1),
            rss_peak_mib=round(max(rss for _, rss in self.samples) / MiB, 1),
            growth_mib=round((end - start) / MiB, 1),
            slope_mib_per_h=round(growth_slope(settled) / MiB * 3600, 1),
            late_growth_mib=round((late[-1][1] - late[0][1]) / MiB, 1),
            late_slope_mib_per_h=round(growth_slope(late) / MiB * 3600, 1),
        )
        late_parts = [(t, p) for t, p in self.parts if t >= half]
        if len(late_parts) >= 3:  # which part the second half's slope comes from
            out["late_slope_by_part_mib_per_h"] = {
                part: round(growth_slope([(t, p[part]) for t, p in late_parts]) / MiB * 3600, 1)
                for part in RSS_PARTS
            }
            out["end_by_part_mib"] = {k: round(v / MiB, 1) for k, v in late_parts[-1][1].items()}
        return out


def growth_slope(samples: Sequence[tuple[float, int]]) -> float:
    """Least-squares bytes per second over ``samples``; 0 with fewer than 3 or no spread."""
    if len(samples) < 3:
        return 0.0
    t = np.array([s[0] for s in samples], dtype=np.float64)
    y = np.array([s[1] for s in samples], dtype=np.float64)
    if np.ptp(t) == 0:
        return 0.0
    slope, _ = np.polyfit(t, y, 1)
    return float(slope)


class MemorySampler:
    """Samples every process's RSS on a thread (the event loop is busy sending load)."""

    def __init__(self, processes: dict[str, int], every_s: float) -> None:
        import psutil

        self.tracks = {name: MemoryTrack(name, pid) for name, pid in processes.items()}
        self._procs = {name: psutil.Process(pid) for name, pid in processes.items()}
        self._every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self.started = time.monotonic()

    def sample(self) -> None:
        import psutil

        now = time.monotonic() - self.started
        for name, proc in self._procs.items():
            track = self.tracks[name]
            if track.exited_at_s is not None:
                continue
            try:
                track.samples.append((now, proc.memory_info().rss))
            except psutil.Error:
                track.exited_at_s = now
                continue
            parts = rss_parts(track.pid)
            if parts is not None:
                track.parts.append((now, parts))

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            self.sample()

    def __enter__(self) -> MemorySampler:
        self.started = time.monotonic()
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


# -- the request mix ---------------------------------------------------------------------------


def soak_requests(config: SoakConfig, num: int, vocab_size: int, seed: int) -> list[SampleRequest]:
    """``num`` requests: half share one of ``num_prefixes`` prefixes (3/4 of the input
    length), half random with spread lengths; shuffled."""
    shared = num // 2
    prefix_len = config.input_len * 3 // 4
    requests = prefix_repetition_requests(
        shared, prefix_len, config.input_len - prefix_len, config.num_prefixes,
        config.output_len, vocab_size, seed=seed,
    ) if shared else []  # fmt: skip
    requests += random_requests(
        num - shared, config.input_len, config.output_len, vocab_size,
        range_ratio=config.range_ratio, seed=seed + 1,
    )  # fmt: skip
    random.Random(seed).shuffle(requests)
    return requests


# -- capacity ----------------------------------------------------------------------------------


async def measure_capacity(
    backend: GrpcGatewayBackend, config: SoakConfig, vocab_size: int
) -> dict[str, Any]:
    """Completions per second with ``capacity_clients`` closed-loop clients."""
    pool = soak_requests(config, 4096, vocab_size, config.seed + 1000)
    outputs: list[RequestOutput] = []
    start = time.monotonic()
    stop = start + config.capacity_s

    async def client(slot: int) -> None:
        index = slot
        while time.monotonic() < stop:
            request = pool[index % len(pool)]
            outputs.append(await backend.send(request, f"capacity-{index}", SendOptions()))
            index += config.capacity_clients

    await asyncio.gather(*(client(s) for s in range(config.capacity_clients)))
    elapsed = time.monotonic() - start
    done = [o for o in outputs if o.success]
    return {
        "clients": config.capacity_clients,
        "seconds": round(elapsed, 1),
        "completed": len(done),
        "failed": len(outputs) - len(done),
        "rps": len(done) / elapsed,
    }


# -- the run -----------------------------------------------------------------------------------


def window_rows(outputs: Sequence[RequestOutput], start: float, duration_s: float, n: int) -> list[dict[str, Any]]:  # fmt: skip
    """Latency and failures of the requests sent in each of ``n`` equal spans."""
    rows = []
    width = duration_s / n
    for i in range(n):
        lo, hi = start + i * width, start + (i + 1) * width
        part = [
            o for o in outputs if lo <= o.start_time < hi or (i == n - 1 and o.start_time >= hi)
        ]
        row: dict[str, Any] = {"window": i, "from_s": round(i * width), "to_s": round((i + 1) * width),
                               "sent": len(part), "completed": sum(o.success for o in part),
                               "failed": sum(not o.success for o in part)}  # fmt: skip
        if row["completed"]:
            metrics = calculate_metrics(part, width, percentiles=(50.0, 99.0))
            for key in ("p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms"):
                row[key] = round(metrics[key], 1)
        rows.append(row)
    return rows


async def soak(
    target: str, processes: dict[str, int], config: SoakConfig, progress: bool = False
) -> dict[str, Any]:
    backend = GrpcGatewayBackend(target)
    try:
        await backend.ready(60)
        vocab = (await backend.model_info()).vocab_size
        if config.capacity_rps is None:
            capacity = await measure_capacity(backend, config, vocab)
        else:
            capacity = {"rps": config.capacity_rps, "given": True}
        rate = config.load_fraction * capacity["rps"]
        if not rate > 0:
            raise RuntimeError(
                f"the stack completed no request while measuring capacity: {capacity}"
            )
        num = max(1, math.ceil(rate * config.duration_s))
        requests = soak_requests(config, num, vocab, config.seed)
        load = LoadConfig(request_rate=rate, seed=config.seed, request_id_prefix="soak-",
                          disable_tqdm=not progress)  # fmt: skip
        with MemorySampler(processes, config.sample_s) as sampler:
            outcome = await run_load(backend, requests, SendOptions(), load)
        blocks = await blocks_free_after(target)
    finally:
        await backend.close()
    outputs = outcome.outputs
    metrics = calculate_metrics(outputs, outcome.duration_s, percentiles=(50.0, 90.0, 99.0))
    failures = Counter(o.status_code or "ERROR" for o in outputs if not o.success)
    return {
        "setup": {**asdict(config), "target": target, "request_rate": rate, "num_requests": num},
        "capacity": capacity,
        "duration_s": round(outcome.duration_s, 1),
        "completed": metrics["completed"],
        "failed": metrics["failed"],
        "failures_by_code": dict(failures),
        "summary": {k: metrics[k] for k in SUMMARY_KEYS},
        "windows": window_rows(outputs, outcome.start_time, outcome.duration_s, config.windows),
        "memory": [t.summary(config.warmup_s) for t in sampler.tracks.values()],
        "memory_samples": {n: t.samples for n, t in sampler.tracks.items()},
        "kv_blocks_after": blocks,
    }


async def blocks_free_after(target: str, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """Each prefill and decode worker's free/total KV blocks once the load is over (polled
    until all are free, or ``timeout_s``)."""
    from pdserve.cli.commands.status import fetch

    deadline = time.monotonic() + timeout_s
    while True:
        workers = [w for w in await fetch(target) if w["role"] in ("prefill", "decode")]
        rows = [{"id": w["id"], "free": w["kv_blocks_free"], "total": w["kv_blocks_total"]}
                for w in workers]  # fmt: skip
        if all(r["free"] == r["total"] for r in rows) or time.monotonic() > deadline:
            return rows
        await asyncio.sleep(1.0)


# -- the stack ---------------------------------------------------------------------------------


@contextlib.contextmanager
def local_stack(run_dir: Path, up_args: Sequence[str]) -> Iterator[tuple[str, dict[str, int]]]:
    """``pdserve up --detach`` in ``run_dir``: (gateway address, name -> pid); ``pdserve
    down`` at the end."""
    from pdserve.cli.launcher import free_port

    env = {**os.environ, "PDSERVE_RUN_DIR": str(run_dir)}
    port = free_port()
    cli = [sys.executable, "-m", "pdserve", "--log-level", "WARNING"]
    started = subprocess.run([*cli, "up", "--detach", "--port", str(port), "--http-port", "0", "--kserve-port", "0", *up_args],
                             env=env, capture_output=True, text=True, timeout=1200)  # fmt: skip
    if started.returncode != 0:
        raise RuntimeError(f"pdserve up failed:\n{started.stdout}\n{started.stderr}")
    try:
        yield f"127.0.0.1:{port}", stack_processes(run_dir)
    finally:
        subprocess.run([*cli, "down"], env=env, capture_output=True, timeout=300)


def stack_processes(run_dir: Path) -> dict[str, int]:
    from pdserve.cli.launcher import StackState

    state = StackState.load(run_dir / "stack.json")
    if state is None:
        raise RuntimeError(f"no stack recorded in {run_dir} (stack.json)")
    return {c.name: c.pid for c in state.children}


# -- reports -----------------------------------------------------------------------------------


def format_report(result: dict[str, Any]) -> str:
    setup, capacity = result["setup"], result["capacity"]
    lines = [
        f"soak: {setup['duration_s']:.0f} s at {setup['load_fraction']:.0%} of capacity "
        f"({capacity['rps']:.3f} req/s measured with {capacity.get('clients', '-')} closed-loop "
        f"clients) = {setup['request_rate']:.3f} req/s, {setup['num_requests']} requests",
        f"completed {result['completed']}, failed {result['failed']} "
        f"{result['failures_by_code'] or ''}".rstrip(),
        "",
        f"{'process':<14}{'pid':>8}{'start':>9}{'settled':>9}{'end':>9}{'peak':>9}"
        f"{'growth':>9}{'MiB/h':>9}{'2nd half':>10}{'MiB/h':>9}",
    ]
    for m in result["memory"]:
        if "rss_end_mib" not in m:
            lines.append(f"{m['name']:<14}{m['pid']:>8}  (no sample)")
            continue
        lines.append(
            f"{m['name']:<14}{m['pid']:>8}{m['rss_start_mib']:>9}{m['rss_settled_mib']:>9}"
            f"{m['rss_end_mib']:>9}{m['rss_peak_mib']:>9}{m['growth_mib']:>9}"
            f"{m['slope_mib_per_h']:>9}{m['late_growth_mib']:>10}{m['late_slope_mib_per_h']:>9}"
            + (f"  exited at {m['exited_at_s']:.0f} s" if m["exited_at_s"] else "")
        )  # fmt: skip
    lines.append(f"(RSS in MiB; settled = first sample after {setup['warmup_s']:.0f} s; growth "
                 "and MiB/h from there to the end; 2nd half: the same over the last half)")  # fmt: skip
    by_part = [m for m in result["memory"] if "late_slope_by_part_mib_per_h" in m]
    if by_part:
        lines += ["", "2nd half MiB/h by part (end MiB): anonymous mappings >= 256 MiB (a KV "
                  "pool), heap and other anonymous memory, mapped files"]  # fmt: skip
        for m in by_part:
            slope, end = m["late_slope_by_part_mib_per_h"], m["end_by_part_mib"]
            lines.append(f"{m['name']:<14}" + "".join(
                f"{part:>10} {slope[part]:>7} ({end[part]:>7})" for part in RSS_PARTS))  # fmt: skip
    lines += ["", f"{'window':<12}{'sent':>6}{'done':>6}{'failed':>7}{'TTFT p50':>10}{'p99':>9}"
              f"{'TPOT p50':>10}{'p99':>8}"]  # fmt: skip
    for w in result["windows"]:
        lines.append(
            f"{w['from_s']:>5}-{w['to_s']:<6}{w['sent']:>6}{w['completed']:>6}{w['failed']:>7}"
            f"{w.get('p50_ttft_ms', '-'):>10}{w.get('p99_ttft_ms', '-'):>9}"
            f"{w.get('p50_tpot_ms', '-'):>10}{w.get('p99_tpot_ms', '-'):>8}"
        )
    s = result["summary"]
    lines += ["", f"throughput {s['request_throughput']:.3f} req/s, {s['output_throughput']:.2f} "
              f"tok/s; TTFT median {s['median_ttft_ms']:.0f} ms p99 {s['p99_ttft_ms']:.0f} ms; "
              f"TPOT mean {s['mean_tpot_ms']:.0f} ms p99 {s['p99_tpot_ms']:.0f} ms; prefix hit "
              f"rate {s['prefix_cache_hit_rate']:.2f}"]  # fmt: skip
    free = ", ".join(f"{b['id']} {b['free']}/{b['total']}" for b in result["kv_blocks_after"])
    lines.append(f"KV blocks free after the load: {free}")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, lat) = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, samples in result["memory_samples"].items():
        if samples:
            mem.plot([t / 60 for t, _ in samples], [r / MiB for _, r in samples], label=name)
    mem.axvline(result["setup"]["warmup_s"] / 60, color="grey", linestyle=":", label="warm-up end")
    mem.set_xlabel("minutes")
    mem.set_ylabel("RSS (MiB)")
    mem.set_title("memory per process")
    mem.legend(fontsize=7)
    windows = [w for w in result["windows"] if "p50_ttft_ms" in w]
    mid = [(w["from_s"] + w["to_s"]) / 120 for w in windows]
    for key, style in (("p50_ttft_ms", "-o"), ("p99_ttft_ms", "--o"), ("p50_tpot_ms", "-s"),
                       ("p99_tpot_ms", "--s")):  # fmt: skip
        lat.plot(mid, [w[key] for w in windows], style, label=key.replace("_ms", ""))
    lat.set_xlabel("minutes")
    lat.set_ylabel("ms")
    lat.set_title("latency per window")
    lat.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save(result: dict[str, Any], result_dir: Path) -> Path:
    result_dir.mkdir(parents=True, exist_ok=True)
    (result_dir / "soak.json").write_text(json.dumps(result, indent=1))
    (result_dir / "soak.txt").write_text(format_report(result))
    plot(result, result_dir / "soak.png")
    return result_dir / "soak.txt"


# -- the command -------------------------------------------------------------------------------


def add_soak_args(parser: argparse.ArgumentParser) -> None:
    d = SoakConfig()
    parser.add_argument("--duration-s", type=float, default=d.duration_s)
    parser.add_argument("--load-fraction", type=float, default=d.load_fraction,
                        help="offered load as a fraction of the measured capacity")  # fmt: skip
    parser.add_argument("--capacity-rps", type=float, default=None,
                        help="skip measuring: the stack completes this many requests a second")  # fmt: skip
    parser.add_argument("--capacity-s", type=float, default=d.capacity_s)
    parser.add_argument("--capacity-clients", type=int, default=d.capacity_clients)
    parser.add_argument("--input-len", type=int, default=d.input_len)
    parser.add_argument("--output-len", type=int, default=d.output_len)
    parser.add_argument("--sample-s", type=float, default=d.sample_s, help="RSS sampling period")
    parser.add_argument("--warmup-s", type=float, default=d.warmup_s,
                        help="memory growth is measured from the first sample after this")  # fmt: skip
    parser.add_argument("--windows", type=int, default=d.windows)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--run-dir", default=None,
                        help="a running stack's PDSERVE_RUN_DIR (default: start one)")  # fmt: skip
    parser.add_argument("--target", default=None, help="its gateway (with --run-dir)")
    parser.add_argument("--up-arg", action="append", default=[], metavar="ARG",
                        help="passed to pdserve up (repeatable), e.g. --up-arg=--decode=2")  # fmt: skip
    parser.add_argument("--result-dir", default="loadtest/results/soak")
    parser.add_argument("--progress", action="store_true")


def config_of(args: argparse.Namespace) -> SoakConfig:
    return SoakConfig(
        duration_s=args.duration_s, load_fraction=args.load_fraction,
        capacity_rps=args.capacity_rps, capacity_s=args.capacity_s,
        capacity_clients=args.capacity_clients, input_len=args.input_len,
        output_len=args.output_len, sample_s=args.sample_s, warmup_s=args.warmup_s,
        windows=args.windows, seed=args.seed,
    )  # fmt: skip


def run_soak(args: argparse.Namespace) -> dict[str, Any]:
    config = config_of(args)
    result_dir = Path(args.result_dir)
    if args.run_dir:
        if not args.target:
            raise SystemExit("--run-dir needs --target (the stack's gateway)")
        processes = stack_processes(Path(args.run_dir))
        result = asyncio.run(soak(args.target, processes, config, args.progress))
    else:
        result_dir.mkdir(parents=True, exist_ok=True)
        with local_stack(result_dir / "stack", args.up_arg) as (target, processes):
            result = asyncio.run(soak(target, processes, config, args.progress))
    report = save(result, result_dir)
    print(report.read_text(), end="")
    return result
