"""pdserve against llama.cpp on this machine's CPU, same GGUF file, same threads, one run.

1. Finds llama.cpp's ``llama-server`` and ``llama-bench`` (built once, outside the repo, by
   loadtest/baselines/build_llama_server.sh: 25-40 min the first time on 2 cores).
2. Single stream: ``llama-bench -m GGUF -t THREADS -p 512 -n 128`` (pp512 = prefill tok/s,
   tg128 = decode tok/s from an empty context) and ``-p 0 -n 128 -d 104`` (tg128 after a
   104-token context); then pdserve's engine in this process on the same file for each
   ``--formats`` entry: decode tok/s over 128 tokens after a 104-token prompt, prefill tok/s
   of a 512-token prompt (median of ``--reps``).
3. Stack: llama-server on the GGUF with ``-t THREADS --parallel 16`` (and a context that
   holds 16 x (104 + 128) tokens), then ``pdserve up`` (one stack per ``--topology``, its
   workers of each role sharing THREADS, as pdserve up shares the cores), each driven by ``pdserve bench serve`` with the same
   workload: random prompts of exactly 104 tokens sent as token ids, 128 output tokens with
   ignore_eos, request rate inf, max concurrency 1 and then 16. Before each stack stops,
   the RSS of each of its processes.
4. One table of figures and ratios (pdserve / llama.cpp), and a JSON with everything.

Prompts are the same for both servers: ``bench serve`` draws them from the same seed and
the same vocabulary (``--tokenizer`` = the default model's tokenizer.json for both) and sends
them as token ids (``prompt: [ids]`` on /v1/completions, ``token_ids`` over gRPC). The
script checks what each server counted: llama-server's ``llamacpp:prompt_tokens_total``
(+ cached tokens) and pdserve's gateway ``prompt_tokens`` counter over each measured run must
equal requests x 104, and one prompt of each run is sent again with max_tokens=1 to read the
server's ``usage.prompt_tokens``.

Run it on a quiet machine (nothing else using the CPUs):

    .venv/bin/python -m loadtest.bench_llamacpp                          # the full run
    .venv/bin/python -m loadtest.bench_llamacpp --topology pd,decode-only  # two stacks
    .venv/bin/python -m loadtest.bench_llamacpp --num-prompts-c1 2 --num-prompts-c16 16 \\
        --output-len 16 --reps 1 --llama-bench-reps 1 --warmup-prompts 4  # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from datetime import datetime
from pathlib import Path
from typing import Any

from common.openmp import environment_without_default

REPO = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = REPO / "loadtest" / "baselines" / "build_llama_server.sh"
FORMATS = ("gguf", "int4", "int8", "none")
# pdserve up flags of each topology; --up-args are added to every one.
TOPOLOGIES = {
    "default": [],  # pdserve up as it starts by default (on 2 cores: 1 decode worker alone)
    "pd": ["--prefill", "1", "--decode", "1"],  # disaggregated: one core per worker here
    "decode-only": ["--prefill", "0", "--decode", "1"],  # one worker prefills locally
}
CLI = [sys.executable, "-m", "pdserve", "--log-level", "WARNING"]
MiB = 2**20


def log(text: str) -> None:
    print(text, flush=True)


# -- the machine ---------------------------------------------------------------------------


def machine_info(threads: int) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "threads": threads,
        "loadavg_at_start": list(os.getloadavg()),
        "python": platform.python_version(),
        "date": datetime.now().isoformat(timespec="seconds"),
    }


NOISY = 0.05  # other work above this fraction of the CPUs: the figures are flagged


class OtherWork:
    """What processes outside this benchmark took of the CPUs while it measured: the
    machine's busy time (/proc/stat, steal included) less the CPU time of this process, its
    children (bench serve, llama-bench, llama-server) and ``pids`` (a stack's processes,
    which ``pdserve up`` leaves running on their own), as a fraction of all CPUs."""

    def __init__(self, pids: Sequence[int] = ()) -> None:
        self.pids = list(pids)
        self.fraction = 0.0

    @staticmethod
    def machine_busy_s() -> float:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
        return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")

    def ours_s(self) -> float:
        import psutil

        me = psutil.Process()
        t = me.cpu_times()
        total = t.user + t.system + t.children_user + t.children_system
        others = {p.pid: p for p in me.children(recursive=True)}
        for pid in self.pids:
            with suppress(psutil.Error):
                others.setdefault(pid, psutil.Process(pid))
        for proc in others.values():
            with suppress(psutil.Error):
                c = proc.cpu_times()
                total += c.user + c.system
        return total

    def __enter__(self) -> OtherWork:
        self._start = (self.machine_busy_s(), self.ours_s(), time.monotonic())
        return self

    def __exit__(self, *exc: object) -> None:
        busy, ours, wall = self.machine_busy_s(), self.ours_s(), time.monotonic()
        other = (busy - self._start[0]) - (ours - self._start[1])
        cpus = os.cpu_count() or 1
        self.fraction = max(0.0, other) / max(1e-9, (wall - self._start[2]) * cpus)


def noise_note(fraction: float) -> str:
    """A warning to print beside a figure measured while other work took ``fraction``."""
    if fraction > NOISY:
        return f" (WARNING: other work took {fraction:.0%} of the CPUs meanwhile)"
    return ""


# -- llama.cpp -----------------------------------------------------------------------------


def llama_binaries() -> tuple[Path, Path]:
    """llama-server and llama-bench, building them once if they are not in the cache."""
    env = {**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable)}
    done = subprocess.run(["bash", str(BUILD_SCRIPT)], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{BUILD_SCRIPT} failed:\n{done.stdout}\n{done.stderr}")
    server = Path(done.stdout.strip().splitlines()[-1])
    bench = server.with_name("llama-bench")
    if not bench.is_file():
        raise FileNotFoundError(f"{bench} is missing; delete {server} and build again")
    return server, bench


def llama_version(server: Path) -> str:
    version = server.with_name("VERSION")
    return version.read_text().strip() if version.is_file() else "unknown"


def run_llama_bench(
    bench: Path, gguf: str, threads: int, reps: int, prefill_len: int, output_len: int,
    depth: int,
) -> dict[str, Any]:  # fmt: skip
    """pp{prefill_len}, tg{output_len} from an empty context, and tg{output_len} after
    ``depth`` tokens, as llama-bench reports them (mean and stddev over ``reps``)."""
    runs = [["-p", str(prefill_len), "-n", str(output_len)],
            ["-p", "0", "-n", str(output_len), "-d", str(depth)]]  # fmt: skip
    figures: dict[str, Any] = {}
    for extra in runs:
        argv = [str(bench), "-m", gguf, "-t", str(threads), "-r", str(reps), "-o", "json", *extra]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=1800,
                              env=environment_without_default())  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"{shlex.join(argv)} failed:\n{done.stderr[-2000:]}")
        for test in json.loads(done.stdout):
            if test["n_prompt"]:
                key = f"pp{test['n_prompt']}"
            else:
                key = f"tg{test['n_gen']}" + (f"_d{test['n_depth']}" if test["n_depth"] else "")
            figures[key] = {"tok_s": float(test["avg_ts"]), "stddev": float(test["stddev_ts"]),
                            "reps": len(test.get("samples_ts") or ()) or reps,
                            "command": shlex.join(argv)}  # fmt: skip
            figures.setdefault("build", f"{test.get('build_commit')} ({test.get('cpu_info')})")
    return figures


def metrics_of(url: str) -> dict[str, float]:
    """A Prometheus page's unlabelled samples, by name."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                values[name] = float(value)
            except ValueError:
                continue
    return values


class ServerDied(RuntimeError):
    """llama-server ended before it was healthy."""

    def __init__(self, returncode: int, message: str) -> None:
        super().__init__(message)
        self.returncode = returncode


@contextmanager
def llama_server(
    binary: Path, gguf: str, threads: int, parallel: int, ctx: int, logs: Path,
    extra: Sequence[str],
) -> Iterator[tuple[str, subprocess.Popen[bytes], list[str]]]:  # fmt: skip
    from pdserve.cli.launcher import free_port

    port = free_port()
    argv = [str(binary), "-m", gguf, "-t", str(threads), "--parallel", str(parallel),
            "-c", str(ctx), "--host", "127.0.0.1", "--port", str(port), "--metrics",
            "--no-webui", *extra]  # fmt: skip
    logs.mkdir(parents=True, exist_ok=True)
    with (logs / "llama-server.log").open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                   env=environment_without_default())  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None:
                tail = (logs / "llama-server.log").read_text(errors="replace")[-2000:]
                raise ServerDied(process.returncode, f"llama-server exited with "
                                 f"{process.returncode}:\n{tail}")  # fmt: skip
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"llama-server at {url} not healthy after 300 s")
            time.sleep(0.25)
        yield url, process, argv
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def llama_prompt_tokens(url: str, prompt: Sequence[int]) -> int:
    """What llama-server counts for this prompt (``usage.prompt_tokens``, one output token)."""
    body = json.dumps({"prompt": list(prompt), "max_tokens": 1, "temperature": 0,
                       "cache_prompt": False}).encode()  # fmt: skip
    request = urllib.request.Request(
        f"{url}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        return int(json.loads(reply.read())["usage"]["prompt_tokens"])


# -- pdserve's engine, single stream -------------------------------------------------------


def engine_single_stream(
    fmt: str, model_dir: str, threads: int, input_len: int, output_len: int, prefill_len: int,
    reps: int, seed: int,
) -> dict[str, Any]:  # fmt: skip
    """Decode tok/s over ``output_len`` tokens after an ``input_len``-token prompt (the
    first token, from the prefill, is not counted), and prefill tok/s of a
    ``prefill_len``-token prompt (add_request to the first token), medians of ``reps``."""
    from common.contract.sampling import SamplingParams
    from common.engine.config import EngineConfig
    from common.engine.engine import Engine
    from loadtest.datasets.base import TokenSource

    start = time.perf_counter()
    engine = Engine(EngineConfig(model=model_dir, quantization=fmt, num_threads=threads,
                                 kv_cache_memory="256MiB", max_num_seqs=4,
                                 max_num_batched_tokens=max(1024, prefill_len),
                                 enable_prefix_caching=False))  # fmt: skip
    load_s = time.perf_counter() - start
    wf = engine.runner.weight_format
    source = TokenSource(engine.spec.vocab_size, seed)
    count = 0

    def generate(prompt_len: int, max_tokens: int) -> list[float]:
        """Arrival time of each token; the first entry is add_request's time."""
        nonlocal count
        count += 1
        prompt = list(source.tokens(prompt_len))
        times = [time.perf_counter()]
        engine.add_request(f"single-{count}", prompt,
                           SamplingParams(max_tokens=max_tokens, ignore_eos=True))  # fmt: skip
        while engine.has_unfinished():
            for out in engine.step():
                times += [time.perf_counter()] * len(out.new_token_ids)
        return times

    generate(input_len, 16)  # warm-up: first calls pay allocation and kernel set-up
    generate(prefill_len, 1)
    decode, prefill = [], []
    with OtherWork() as meter:
        for _ in range(reps):
            times = generate(input_len, output_len + 1)
            decode.append(output_len / (times[-1] - times[1]))
        for _ in range(reps):
            times = generate(prefill_len, 1)
            prefill.append(prefill_len / (times[1] - times[0]))
    result = {
        "format": fmt, "weight_format": {"name": wf.name, "file_type": wf.file_type,
                                         "kernel": wf.kernel, "act_bits": wf.act_bits,
                                         "group_size": wf.group_size},
        "attention_backend": engine.config.attention_backend, "load_s": load_s,
        "decode_tok_s": statistics.median(decode), "decode_tok_s_all": decode,
        "prefill_tok_s": statistics.median(prefill), "prefill_tok_s_all": prefill,
        "other_cpu": meter.fraction,
    }  # fmt: skip
    return result  # the engine goes with this frame; the caller collects it


def alternating_rounds(
    args: argparse.Namespace, bench: Path, gguf: str, model_dir: str
) -> list[dict[str, Any]]:
    """Single-stream decode, llama-bench and pdserve's engine (the first --formats entry)
    in turn, ``--rounds`` times. A shared machine's speed drifts by more than the gap
    being measured, minutes apart; each round's ratio compares two runs a minute apart."""
    fmt = next(f for f in args.formats.split(",") if f)
    d, n = args.input_len, args.output_len
    rounds = []
    for i in range(args.rounds):
        with OtherWork() as meter:
            lb = run_llama_bench(bench, gguf, args.threads, args.llama_bench_reps,
                                 args.prefill_len, args.output_len, args.input_len)  # fmt: skip
            fig = engine_single_stream(fmt, model_dir, args.threads, d, n, args.prefill_len,
                                       args.reps, args.seed)  # fmt: skip
        gc.collect()
        llama = lb[f"tg{n}_d{d}"]["tok_s"]
        ours = fig["decode_tok_s"]
        rounds.append({"format": fmt, "llama_tok_s": llama, "pdserve_tok_s": ours,
                       "ratio": ours / llama, "other_cpu": meter.fraction})  # fmt: skip
        log(f"  round {i + 1}: llama.cpp {llama:.1f} tok/s, pdserve [{fmt}] {ours:.1f} tok/s, "
            f"{ours / llama:.2f}x{noise_note(meter.fraction)}")
    return rounds


# -- pdserve's stack -----------------------------------------------------------------------


def worker_counts(up_args: Sequence[str]) -> tuple[int, int]:
    """(prefill, decode) workers these ``pdserve up`` flags start on this machine."""
    from pdserve.cli.commands.up import num_prefill_workers
    from pdserve.cli.main import build_parser

    args = build_parser().parse_args(["up", *up_args])
    return num_prefill_workers(args), args.decode


def status_json(target: str, env: dict[str, str]) -> list[dict[str, Any]]:
    done = subprocess.run([*CLI, "status", "--target", target, "--json"], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"pdserve status failed: {done.stderr[-1000:]}")
    workers: list[dict[str, Any]] = json.loads(done.stdout)
    return workers


def wait_registered(target: str, env: dict[str, str], num_workers: int) -> None:
    deadline = time.monotonic() + 60
    while True:
        workers = status_json(target, env)
        if sum(w["role"] in ("prefill", "decode") for w in workers) >= num_workers:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"gateway {target} sees {len(workers)} processes after 60 s")
        time.sleep(0.5)


@contextmanager
def pdserve_stack(run_dir: Path, up_args: Sequence[str]) -> Iterator[tuple[str, dict[str, str]]]:
    """``pdserve up --detach`` in a run directory of its own (so it meets no other stack on
    this machine), on a free port; ``pdserve down`` at the end."""
    from pdserve.cli.launcher import free_port

    env = {**os.environ, "PDSERVE_RUN_DIR": str(run_dir)}
    port = free_port()
    argv = [*CLI, "up", "--detach", "--port", str(port), "--http-port", "0", "--kserve-port", "0", *up_args]
    log(f"  $ pdserve {shlex.join(argv[len(CLI) :])}")
    try:
        started = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1200)
        if started.returncode != 0:
            raise RuntimeError(f"pdserve up failed:\n{started.stdout}\n{started.stderr}")
        for line in started.stdout.splitlines():
            log(f"  {line.strip()}")
        target = f"127.0.0.1:{port}"
        wait_registered(target, env, sum(worker_counts(up_args)))
        yield target, env
    finally:
        subprocess.run([*CLI, "down"], env=env, capture_output=True, timeout=300)


def process_memory(pid: int) -> dict[str, float]:
    """RSS now and its peak (VmHWM), MiB."""
    import psutil

    rss = psutil.Process(pid).memory_info().rss / MiB
    peak = rss
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024 / MiB
    return {"rss_mib": rss, "peak_rss_mib": peak}


def stack_memory(target: str, env: dict[str, str], run_dir: Path) -> dict[str, dict[str, float]]:
    """Each process's memory: the pids ``pdserve status --json`` reports, and redis-server
    from the stack's record (it is not in the worker registry)."""
    from pdserve.cli.launcher import StackState

    pids = {str(w["id"]): int(w["pid"]) for w in status_json(target, env) if w.get("pid")}
    state = StackState.load(run_dir / "stack.json")
    known = set(pids.values())
    for child in state.children if state else []:
        if child.pid not in known:
            pids[child.name] = child.pid
    return {name: {"pid": pid, **process_memory(pid)} for name, pid in sorted(pids.items())}


def gateway_counters(target: str, env: dict[str, str]) -> dict[str, float]:
    for w in status_json(target, env):
        if w["role"] == "gateway":
            metrics: dict[str, float] = w.get("metrics") or {}
            return metrics
    return {}


def pdserve_prompt_tokens(target: str, prompt: Sequence[int]) -> int:
    from common.contract.sampling import SamplingParams
    from pdserve.client import GatewayClient

    async def ask() -> int:
        client = GatewayClient(target)
        try:
            done = await client.complete(token_ids=list(prompt), sampling=SamplingParams(
                max_tokens=1, ignore_eos=True), timeout_s=60, cache_salt="prompt-check")  # fmt: skip
        finally:
            await client.close()
        return done.prompt_tokens

    return asyncio.run(ask())


# -- the workload --------------------------------------------------------------------------


def run_bench_serve(
    argv: list[str], out_dir: Path, name: str, timeout_s: float
) -> dict[str, Any]:
    """Runs a ``bench serve`` command line that saves ``out_dir/name.json``; keeps its
    command and output beside it (``name.txt``) and returns the saved result."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    (out_dir / f"{name}.txt").write_text(shlex.join(argv) + "\n" + done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"bench serve ({name}) failed:\n{done.stdout[-2000:]}\n"
                           f"{done.stderr[-2000:]}")  # fmt: skip
    result: dict[str, Any] = json.loads((out_dir / f"{name}.json").read_text())
    return result


class Workload:
    """The ``bench serve`` runs both servers get, and the prompts they send."""

    def __init__(self, args: argparse.Namespace, model_dir: str) -> None:
        from tokenizers import Tokenizer

        self.args = args
        self.model_dir = model_dir
        self.vocab = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")).get_vocab_size()
        # (name, concurrency, requests, seed): distinct seeds, so no run's prompts are in a
        # prefix cache from an earlier one.
        self.runs = [("c1", 1, args.num_prompts_c1, args.seed + 1),
                     (f"c{args.concurrency}", args.concurrency, args.num_prompts_c16,
                      args.seed + 2)]  # fmt: skip

    def prompts(self, num: int, seed: int) -> list[tuple[int, ...]]:
        """The prompts ``bench serve --seed SEED`` sends (same dataset code and vocabulary)."""
        from loadtest.datasets.random_dataset import random_requests

        a = self.args
        requests = random_requests(num, a.input_len, a.output_len, self.vocab, seed=seed)
        return [r.prompt_token_ids for r in requests]

    def digest(self, num: int, seed: int) -> str:
        h = hashlib.sha256()
        for prompt in self.prompts(num, seed):
            h.update(json.dumps(prompt).encode())
        return h.hexdigest()[:16]

    def bench(
        self, server: list[str], label: str, concurrency: int, num: int, seed: int,
        output_len: int, out_dir: Path,
    ) -> dict[str, Any]:  # fmt: skip
        a = self.args
        name = f"{label}-{concurrency}"
        argv = [*CLI, "bench", "serve", *server, "--tokenizer", self.model_dir,
                "--label", label, "--dataset-name", "random",
                "--random-input-len", str(a.input_len), "--random-output-len", str(output_len),
                "--num-prompts", str(num), "--request-rate", "inf",
                "--max-concurrency", str(concurrency), "--seed", str(seed), "--ignore-eos",
                "--temperature", "0", "--metric-percentiles", "50,90,99", "--disable-tqdm",
                "--save-result", "--save-detailed", "--result-dir", str(out_dir),
                "--result-filename", f"{name}.json"]  # fmt: skip
        return run_bench_serve(argv, out_dir, name, a.bench_timeout_s)

    def warm_up(self, server: list[str], label: str, out_dir: Path) -> None:
        """Prompts of their own seed, short outputs, at the high concurrency: first-call
        costs (threads, allocations, kernel set-up) come before the measured runs."""
        if self.args.warmup_prompts:
            self.bench(server, f"{label}-warmup", self.args.concurrency, self.args.warmup_prompts,
                       self.args.seed + 100, 16, out_dir)  # fmt: skip


def summarize_run(result: dict[str, Any], expected: int, input_len: int) -> dict[str, Any]:
    """The figures the table shows, and what the client saw of the token counts."""
    outputs = [int(r["output_tokens"]) for r in result["requests"] if r["success"]]
    inputs = [int(r["prompt_len"]) for r in result["requests"]]
    return {
        "completed": result["completed"], "failed": result["failed"],
        "duration_s": result["duration"], "output_tok_s": result["output_throughput"],
        "request_s": result["request_throughput"], "ttft_p50_ms": result["median_ttft_ms"],
        "ttft_p99_ms": result["p99_ttft_ms"], "tpot_p50_ms": result["median_tpot_ms"],
        "tpot_p99_ms": result["p99_tpot_ms"], "itl_p50_ms": result["median_itl_ms"],
        "e2el_p50_ms": result["median_e2el_ms"],
        "total_input_tokens": result["total_input_tokens"],
        "total_output_tokens": result["total_output_tokens"],
        "cached_prompt_tokens": result.get("total_cached_tokens", 0),
        "client_prompt_lens_ok": all(n == input_len for n in inputs),
        "output_lens_ok": bool(outputs) and all(n == expected for n in outputs),
        "output_lens": sorted(set(outputs)),
    }  # fmt: skip


def run_llama_stack(
    args: argparse.Namespace, work: Workload, server: Path, gguf: str, out: Path,
) -> dict[str, Any]:  # fmt: skip
    extra = shlex.split(args.llama_server_args)
    try:
        return _llama_stack(args, work, server, gguf, out, extra)
    except ServerDied as exc:
        # Built natively on an Intel Xeon with AMX, llama-server died with SIGSEGV at load in
        # its AMX weight repacking; its plain CPU kernels (--no-repack) run.
        if exc.returncode >= 0 or {"--no-repack", "-nr"} & set(extra):
            raise
        log(f"  llama-server died at load (signal {-exc.returncode}); again with --no-repack")
        record = _llama_stack(args, work, server, gguf, out, [*extra, "--no-repack"])
        record["fallback"] = f"--no-repack (as built it died with signal {-exc.returncode})"
        return record


def _llama_stack(
    args: argparse.Namespace, work: Workload, server: Path, gguf: str, out: Path,
    extra: list[str],
) -> dict[str, Any]:  # fmt: skip
    per_slot = -(-(args.input_len + args.output_len + 16) // 256) * 256
    ctx = max(4096, args.concurrency * per_slot)
    log(f"\n== llama-server: -t {args.threads} --parallel {args.concurrency} -c {ctx} ==")
    record: dict[str, Any] = {"runs": {}}
    with llama_server(server, gguf, args.threads, args.concurrency, ctx, out / "logs",
                      extra) as (url, process, argv):  # fmt: skip
        record["command"] = shlex.join(argv)
        backend = ["--backend", "openai", "--base-url", url, "--served-model-name", "llama"]
        work.warm_up(backend, "llama.cpp", out)
        for name, concurrency, num, seed in work.runs:
            before = metrics_of(url)
            with OtherWork([process.pid]) as meter:
                result = work.bench(backend, "llama.cpp", concurrency, num, seed,
                                    args.output_len, out)  # fmt: skip
            after = metrics_of(url)
            run = summarize_run(result, args.output_len, args.input_len)
            run["other_cpu"] = meter.fraction
            note = noise_note(meter.fraction)
            key = "llamacpp:prompt_tokens_total"
            processed = after[key] - before[key]
            run["server_prompt_tokens"] = int(processed + run["cached_prompt_tokens"])
            run["server_output_tokens"] = int(after["llamacpp:tokens_predicted_total"]
                                              - before["llamacpp:tokens_predicted_total"])  # fmt: skip
            run["probe_prompt_tokens"] = llama_prompt_tokens(url, work.prompts(1, seed)[0])
            record["runs"][name] = run
            log(f"  {name}: {run['output_tok_s']:.1f} output tok/s, TTFT p50 "
                f"{run['ttft_p50_ms']:.1f} ms, TPOT p50 {run['tpot_p50_ms']:.1f} ms{note}")  # fmt: skip
        record["memory"] = {"llama-server": process_memory(process.pid)}
    return record


def run_pdserve_stack(
    args: argparse.Namespace, work: Workload, topology: str, out: Path,
) -> dict[str, Any]:  # fmt: skip
    up_args = [*TOPOLOGIES[topology], *shlex.split(args.up_args)]
    prefill, decode = worker_counts(up_args)
    if "--threads-per-worker" not in " ".join(up_args):
        # llama.cpp's threads shared out among the workers of each role, as pdserve up
        # does with the machine's cores (threads_per_worker): the roles overlap.
        up_args += ["--threads-per-worker", str(max(1, args.threads // max(prefill, decode)))]
    log(f"\n== pdserve up [{topology}]: {prefill} prefill + {decode} decode workers ==")
    run_dir = out / f"stack-{topology}"
    record: dict[str, Any] = {"up_args": up_args, "runs": {}}
    with pdserve_stack(run_dir, up_args) as (target, env):
        record["memory_idle"] = stack_memory(target, env, run_dir)
        pids = [int(v["pid"]) for v in record["memory_idle"].values()]
        backend = ["--backend", "pdserve", "--base-url", target]
        label = f"pdserve-{topology}"
        work.warm_up(backend, label, out)
        for name, concurrency, num, seed in work.runs:
            before = gateway_counters(target, env)
            with OtherWork(pids) as meter:
                result = work.bench(backend, label, concurrency, num, seed, args.output_len, out)
            after = gateway_counters(target, env)
            run = summarize_run(result, args.output_len, args.input_len)
            run["other_cpu"] = meter.fraction
            note = noise_note(meter.fraction)
            for key, counter in (("server_prompt_tokens", "prompt_tokens"),
                                 ("server_output_tokens", "generation_tokens")):  # fmt: skip
                run[key] = int(after.get(counter, 0) - before.get(counter, 0))
            run["probe_prompt_tokens"] = pdserve_prompt_tokens(target, work.prompts(1, seed)[0])
            record["runs"][name] = run
            log(f"  {name}: {run['output_tok_s']:.1f} output tok/s, TTFT p50 "
                f"{run['ttft_p50_ms']:.1f} ms, TPOT p50 {run['tpot_p50_ms']:.1f} ms{note}")  # fmt: skip
        record["memory"] = stack_memory(target, env, run_dir)
        if "--threads-per-worker" in up_args:
            per_worker = int(up_args[up_args.index("--threads-per-worker") + 1])
            record["threads_total"] = per_worker * (prefill + decode)
    return record


def token_checks(result: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """Each server's own counts of the prompt and output tokens it was sent and produced."""
    lines = []
    servers = {"llama.cpp": result.get("llama_server")} | {
        f"pdserve[{t}]": r for t, r in (result.get("pdserve") or {}).items()
    }
    for server, record in servers.items():
        for name, run in (record or {}).get("runs", {}).items():
            n = run["completed"] + run["failed"]
            want_in, want_out = n * args.input_len, n * args.output_len
            ok = (run["server_prompt_tokens"] == want_in and run["probe_prompt_tokens"] == args.input_len
                  and run["client_prompt_lens_ok"] and run["output_lens_ok"]
                  and run["server_output_tokens"] == want_out)  # fmt: skip
            lines.append(
                f"  {'ok  ' if ok else 'FAIL'} {server} {name}: server counted {run['server_prompt_tokens']} "
                f"prompt tokens (want {n} x {args.input_len} = {want_in}; cached "
                f"{run['cached_prompt_tokens']}), probe usage.prompt_tokens "
                f"{run['probe_prompt_tokens']}, {run['server_output_tokens']} output tokens "
                f"(want {want_out}), output lengths seen {run['output_lens']}"
            )
            run["token_counts_ok"] = ok
    return lines


# -- the report ----------------------------------------------------------------------------


def ratio(pd: float | None, ref: float | None) -> str:
    if pd is None or ref is None or not ref:
        return "-"
    return f"{pd / ref:.2f}x"


def cell(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def noise_of(result: dict[str, Any]) -> list[float]:
    """Every part's share of the CPUs taken by other work."""
    found: list[float] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if "other_cpu" in node:
                found.append(float(node["other_cpu"]))
            for value in node.values():
                walk(value)

    walk(result)
    return found


def format_table(result: dict[str, Any], args: argparse.Namespace) -> str:
    m = result["machine"]
    busy = max(noise_of(result) or [0.0])
    lines = [
        f"machine: {m['cpu']}, {m['usable_cpus']} usable of {m['logical_cpus']} logical CPUs, "
        f"{m['threads']} threads for llama.cpp and for pdserve's engines of each role; load "
        f"average at start {m['loadavg_at_start'][0]:.2f}",
        "the machine must be quiet (nothing else on the CPUs) for these figures to mean anything",
        f"llama.cpp: {result.get('llama_cpp_version', '-')}; GGUF {result['gguf']}",
        f"other work on the CPUs while measuring: at most {busy:.0%} of them"
        f"{'  <- NOT QUIET, these figures are not reliable' if busy > NOISY else ''}",
        "ratio = pdserve / llama.cpp (tok/s: higher is better; TTFT, TPOT, RSS: lower)",
    ]
    rows: list[tuple[str, ...]] = []
    single = result.get("single_stream") or {}
    lb = single.get("llama_bench") or {}
    n, d, p = args.output_len, args.input_len, args.prefill_len
    tg_d0 = (lb.get(f"tg{n}") or {}).get("tok_s")
    tg_d = (lb.get(f"tg{n}_d{d}") or {}).get("tok_s")
    pp = (lb.get(f"pp{p}") or {}).get("tok_s")
    if single:
        rows.append((f"single stream, {args.threads} threads", "llama.cpp", "pdserve", "ratio"))
        for fmt, fig in (single.get("pdserve") or {}).items():
            rows.append((f"decode tok/s after {d} [{fmt}]", cell(tg_d), cell(fig["decode_tok_s"]),
                         ratio(fig["decode_tok_s"], tg_d)))  # fmt: skip
        rows.append((f"  (llama.cpp tg{n} from empty ctx)", cell(tg_d0), "", ""))
        for fmt, fig in (single.get("pdserve") or {}).items():
            rows.append((f"prefill tok/s at {p} [{fmt}]", cell(pp), cell(fig["prefill_tok_s"]),
                         ratio(fig["prefill_tok_s"], pp)))  # fmt: skip
        rows.append(("", "", "", ""))
    rounds = result.get("single_stream_rounds") or []
    if rounds:
        rows.append((f"alternating rounds, decode after {d}", "llama.cpp", "pdserve", "ratio"))
        for i, r in enumerate(rounds):
            rows.append((f"round {i + 1} [{r['format']}]", cell(r["llama_tok_s"]),
                         cell(r["pdserve_tok_s"]), f"{r['ratio']:.2f}x"))  # fmt: skip
        median = statistics.median(r["ratio"] for r in rounds)
        rows.append(("median of the rounds' ratios", "", "", f"{median:.2f}x"))
        rows.append(("", "", "", ""))
    llama = result.get("llama_server") or {}
    for topology, record in (result.get("pdserve") or {}).items():
        rows.append((f"stack: {d} in / {n} out", "llama-server", f"pdserve[{topology}]", "ratio"))
        for name, _, _, _ in result["workload"]["runs"]:
            ref, pd = (llama.get("runs") or {}).get(name) or {}, record["runs"].get(name) or {}
            for key, label, digits in (("output_tok_s", "output tok/s", 1),
                                       ("ttft_p50_ms", "TTFT p50 ms", 1),
                                       ("tpot_p50_ms", "TPOT p50 ms", 2)):  # fmt: skip
                rows.append((f"{name} {label}", cell(ref.get(key), digits),
                             cell(pd.get(key), digits), ratio(pd.get(key), ref.get(key))))  # fmt: skip
        ref_mem = sum(v["rss_mib"] for v in (llama.get("memory") or {}).values()) or None
        memory = record.get("memory") or {}
        for proc, fig in memory.items():
            rows.append((f"RSS MiB {proc}", "", cell(fig["rss_mib"], 0), ""))
        engines = sum(
            v["rss_mib"] for k, v in memory.items() if k.startswith(("prefill", "decode"))
        )
        rows.append(("RSS MiB engine workers", cell(ref_mem, 0), cell(engines, 0),
                     ratio(engines, ref_mem)))  # fmt: skip
        total = sum(v["rss_mib"] for v in memory.values())
        rows.append(("RSS MiB all processes", cell(ref_mem, 0), cell(total, 0),
                     ratio(total, ref_mem)))  # fmt: skip
        rows.append(("", "", "", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(4)] if rows else [0] * 4
    for r in rows:
        lines.append(f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  "
                     f"{r[3]:>{widths[3]}}".rstrip())  # fmt: skip
    if llama.get("command"):
        lines.append(f"llama-server: {llama['command']}")
    for topology, record in (result.get("pdserve") or {}).items():
        threads = record.get("threads_total")
        lines.append(f"pdserve[{topology}]: pdserve up {shlex.join(record['up_args'])}"
                     f"{f' ({threads} engine threads in all)' if threads else ''}")  # fmt: skip
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="llama.cpp's -t, the engine's threads, pdserve's total (default: "
                        "the usable CPUs)")  # fmt: skip
    parser.add_argument("--formats", default=",".join(FORMATS),
                        help="pdserve weight formats for the single-stream figures")  # fmt: skip
    parser.add_argument("--gguf", default=None,
                        help="this GGUF file for both engines (default: the shipped Q4_1 "
                        "file; e.g. a llama-quantize Q4_K_M of it, with --formats gguf)")  # fmt: skip
    parser.add_argument("--input-len", type=int, default=104, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens (ignore_eos)")
    parser.add_argument("--prefill-len", type=int, default=512, help="the prefill figure's prompt")
    parser.add_argument("--concurrency", type=int, default=16,
                        help="the second concurrency level and llama-server's --parallel")  # fmt: skip
    parser.add_argument("--num-prompts-c1", type=int, default=8)
    parser.add_argument("--num-prompts-c16", type=int, default=48,
                        help="requests at --concurrency")  # fmt: skip
    parser.add_argument("--warmup-prompts", type=int, default=16,
                        help="a warm-up run per server (own prompts, 16 tokens each); 0 = none")  # fmt: skip
    parser.add_argument("--reps", type=int, default=3, help="engine single-stream repetitions")
    parser.add_argument("--llama-bench-reps", type=int, default=5)
    parser.add_argument("--topology", default="default",
                        help=f"comma list of {', '.join(TOPOLOGIES)}: one pdserve stack each")  # fmt: skip
    parser.add_argument("--up-args", default="", help="more `pdserve up` flags, every topology")
    parser.add_argument("--llama-server-args", default="", help="more llama-server flags")
    parser.add_argument("--skip-single-stream", action="store_true")
    parser.add_argument("--rounds", type=int, default=0,
                        help="also alternate llama-bench and the engine (first --formats "
                        "entry) this many times: per-round ratios under a drifting machine")  # fmt: skip
    parser.add_argument("--skip-stack", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bench-timeout-s", type=float, default=1800.0)
    parser.add_argument("--result-dir", default=None,
                        help="default loadtest/results/llamacpp/DATE")  # fmt: skip
    args = parser.parse_args(argv)
    unknown = [t for t in args.topology.split(",") if t not in TOPOLOGIES]
    if unknown:
        parser.error(f"--topology: unknown {unknown}; use {', '.join(TOPOLOGIES)}")
    bad = [f for f in args.formats.split(",") if f and f not in FORMATS]
    if bad:
        parser.error(f"--formats: unknown {bad}; use {', '.join(FORMATS)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    from common.models.default_model import gguf_path, resolve_model

    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.result_dir or REPO / "loadtest" / "results" / "llamacpp" / stamp)
    out.mkdir(parents=True, exist_ok=True)
    model_dir, gguf = resolve_model(None), str(gguf_path())
    if args.gguf:  # another file of the same model (a K-quant preset): both engines read it
        gguf = str(Path(args.gguf).resolve())
        model_dir = resolve_model(gguf)
        args.up_args = f"{args.up_args} --model {shlex.quote(gguf)}".strip()
    work = Workload(args, model_dir)
    result: dict[str, Any] = {
        "machine": machine_info(args.threads), "gguf": gguf, "model_dir": model_dir,
        "args": vars(args),
        "workload": {"input_len": args.input_len, "output_len": args.output_len,
                     "ignore_eos": True, "request_rate": "inf", "vocab_size": work.vocab,
                     "runs": [list(r) for r in work.runs],
                     "prompt_sha256": {name: work.digest(num, seed)
                                       for name, _, num, seed in work.runs}},
    }  # fmt: skip
    m = result["machine"]
    log(f"machine: {m['cpu']}; {m['usable_cpus']} usable CPUs; {args.threads} threads; load "
        f"average {m['loadavg_at_start'][0]:.2f}. Run this on a quiet machine.")  # fmt: skip
    log("llama.cpp: finding or building llama-server and llama-bench ...")
    server, bench = llama_binaries()
    result["llama_cpp_version"] = llama_version(server)
    log(f"  {server} ({result['llama_cpp_version']})")
    path = out / "bench_llamacpp.json"

    def save() -> None:
        path.write_text(json.dumps(result, indent=2) + "\n")

    if not args.skip_single_stream:
        log(f"\n== single stream: llama-bench -t {args.threads} ==")
        with OtherWork() as meter:
            lb = run_llama_bench(bench, gguf, args.threads, args.llama_bench_reps,
                                 args.prefill_len, args.output_len, args.input_len)  # fmt: skip
        lb["other_cpu"] = meter.fraction
        note = noise_note(meter.fraction)
        for key, fig in lb.items():
            if isinstance(fig, dict):
                log(f"  {key}: {fig['tok_s']:.1f} +- {fig['stddev']:.1f} tok/s")
        log(f"  other work: {meter.fraction:.0%} of the CPUs{note}")
        single: dict[str, Any] = {"llama_bench": lb, "pdserve": {}}
        result["single_stream"] = single
        for fmt in [f for f in args.formats.split(",") if f]:
            log(f"== single stream: pdserve engine [{fmt}], {args.threads} threads ==")
            fig = engine_single_stream(fmt, model_dir, args.threads, args.input_len,
                                       args.output_len, args.prefill_len, args.reps, args.seed)  # fmt: skip
            single["pdserve"][fmt] = fig
            gc.collect()
            wf = fig["weight_format"]
            log(f"  {wf['name']} {wf['file_type']} kernel={wf['kernel'] or '-'} "
                f"act_bits={wf['act_bits']}: decode {fig['decode_tok_s']:.1f} tok/s, prefill "
                f"{fig['prefill_tok_s']:.1f} tok/s (loaded in {fig['load_s']:.1f} s)"
                f"{noise_note(fig['other_cpu'])}")  # fmt: skip
            save()
    if args.rounds:
        result["single_stream_rounds"] = alternating_rounds(args, bench, gguf, model_dir)
        save()
    if not args.skip_stack:
        result["llama_server"] = run_llama_stack(args, work, server, gguf, out)
        save()
        result["pdserve"] = {}
        for topology in args.topology.split(","):
            result["pdserve"][topology] = run_pdserve_stack(args, work, topology, out)
            save()
        checks = token_checks(result, args)
        log("\ntoken counts (prompts sent as token ids, same seed and vocabulary for both "
            "servers; counted by each server over each measured run):")  # fmt: skip
        for line in checks:
            log(line)
        result["token_checks"] = checks
    table = format_table(result, args)
    result["table"] = table
    save()
    (out / "bench_llamacpp.txt").write_text(table + "\n")
    log("\n" + table)
    log(f"\nresult: {path} ({time.monotonic() - started:.0f} s in all)")
    return 0 if all(line.startswith("  ok") for line in result.get("token_checks", [])) else 1


if __name__ == "__main__":
    raise SystemExit(main())
