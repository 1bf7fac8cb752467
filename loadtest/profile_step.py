"""Where a batched step's time goes on the CPU: ``perf record`` over the engine in this process
running one phase, its samples sorted into parts (the matmul kernels, attention, norms and
the other C++ ops, torch's own ops, the Python interpreter, the kernels' thread pool waiting,
the allocator and copies, the rest).

Phases (the default model as pdserve serves it with no options unless --act-bits /
--kv-dtype say otherwise):
  decode16   16 requests of 104-token prompts decoding together: only the decode steps are
             sampled (the prompts are prefilled before perf starts counting)
  prefill512 512-token prompts, one at a time, one output token each

    .venv/bin/python -m loadtest.profile_step --phase decode16 [--steps 200]
    .venv/bin/python -m loadtest.profile_step --phase prefill512 [--prompts 6]

Needs ``perf`` (linux-perf) allowed to sample this process (perf_event_paranoid <= 2).
Without --perf-out the report goes to stdout; with it also to PATH (text) and PATH.json.
Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

# Parts, in the order their patterns are tried on "dso symbol".
PARTS: list[tuple[str, re.Pattern[str]]] = [
    (
        "matmuls (quantized / x16 kernels)",
        re.compile(r"quant|kq|x16_matmul|q4|q8|q6|q5|gemm|matmul|dot_row|vnni|amx|half_x16", re.I),
    ),
    (
        "attention",
        re.compile(
            r"attention|attend|scores_run|softmax_numerators|weighted_values|"
            r"group_attention|exp256|exp512|hsum|join_partials|sdpa|flash",
            re.I,
        ),
    ),
    (
        "norms, rotary, SwiGLU, KV write, argmax (C++ ops)",
        re.compile(r"rms_norm|rotary|silu|write_kv|argmax|decode_model|pdserve_cpu", re.I),
    ),
    (
        "thread pool (spinning, waiting, yielding)",
        re.compile(r"Pool::|pool\(|sched_yield|futex|pause|spin|parallel_for|gomp|omp", re.I),
    ),
    (
        "allocator, copies, page faults",
        re.compile(
            r"malloc|free|memcpy|memmove|memset|page_fault|clear_page|mmap|munmap|_int_|cfree|"
            r"copy_|cat_|index_|gather",
            re.I,
        ),
    ),
    ("torch ops (dispatch and ATen kernels)", re.compile(r"libtorch|libc10|at::|c10::|aten", re.I)),
    ("Python interpreter", re.compile(r"python|_Py|Py[A-Z]|libpython", re.I)),
]
OTHER = "other (kernel, libc, the rest)"


def short_name(symbol: str) -> str:
    """A pool task's lambda as the function it belongs to; arguments dropped."""
    task = "std::_Function_handler<void (long, long), "
    suffix = ""
    if symbol.startswith(task):
        symbol, suffix = symbol[len(task) :], " (its pool tasks)"
    symbol = symbol.replace("(anonymous namespace)::", "")
    depth, cut = 0, len(symbol)
    for i, ch in enumerate(symbol):  # the first "(" outside template brackets
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0 and i > 0:
            cut = i
            break
    return symbol[:cut] + suffix


def part_of(dso: str, symbol: str) -> str:
    text = f"{dso} {symbol}"
    for name, pattern in PARTS:
        if pattern.search(text):
            return name
    return OTHER


def run_phase(args: argparse.Namespace) -> None:
    """The phase itself, run under perf: a warm-up, then the measured part, whose wall-clock
    start and end it writes to --marks (perf's timestamps are on the same clock, -k
    CLOCK_REALTIME, so the parent keeps only the samples between them)."""
    import common.openmp  # noqa: F401  (before torch: OpenMP's wait policy)

    # isort: split
    from common.contract.sampling import SamplingParams
    from common.engine.config import EngineConfig
    from common.engine.engine import Engine
    from common.heap import tune_malloc
    from common.models.default_model import resolve_model
    from loadtest.datasets.base import TokenSource

    tune_malloc()  # as a pdserve server process runs (pdserve/cli/main.py)

    engine = Engine(EngineConfig(model=resolve_model(args.model), quant_act_bits=args.act_bits,
                                 kv_dtype=args.kv_dtype, max_num_batched_tokens=2048,
                                 enable_prefix_caching=False))  # fmt: skip
    source = TokenSource(engine.spec.vocab_size, 0)
    marks: dict[str, Any] = {"steps": 0, "tokens": 0}
    if args.phase == "decode16":
        n, prompt_len = 16, 104
        total = args.steps + 8
        for i in range(n):
            engine.add_request(f"d{i}", list(source.tokens(prompt_len)),
                               SamplingParams(max_tokens=total, ignore_eos=True))  # fmt: skip
        produced = 0
        while produced < 4 * n:  # the prefills and first decode steps, not measured
            produced += sum(len(o.new_token_ids) for o in engine.step())
        marks["start"] = time.time()
        for _ in range(args.steps):
            marks["tokens"] += sum(len(o.new_token_ids) for o in engine.step())
            marks["steps"] += 1
        marks["end"] = time.time()
    else:
        length = 512
        sampling = SamplingParams(max_tokens=1, ignore_eos=True)
        engine.add_request("warm", list(source.tokens(length)), sampling)
        while engine.has_unfinished():
            engine.step()
        marks["start"] = time.time()
        for i in range(args.prompts):
            engine.add_request(f"p{i}", list(source.tokens(length)), sampling)
            while engine.has_unfinished():
                engine.step()
                marks["steps"] += 1
            marks["tokens"] += length
        marks["end"] = time.time()
    marks["backend"] = type(engine.runner.backend).__name__
    backend = engine.runner.backend
    marks["prefill_sdpa"] = bool(getattr(backend, "sdpa_prefill", False))
    marks["sdpa_min_context"] = getattr(backend, "sdpa_min_context", None)
    marks["weights"] = engine.runner.weight_format.describe()
    Path(args.marks).write_text(json.dumps(marks))


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--phase", choices=["decode16", "prefill512"], default="decode16")
    parser.add_argument("--model", default=None)
    parser.add_argument("--act-bits", type=int, default=16)
    parser.add_argument("--kv-dtype", default="auto")
    parser.add_argument("--steps", type=int, default=200, help="decode steps sampled")
    parser.add_argument("--prompts", type=int, default=6, help="512-token prefills sampled")
    parser.add_argument("--perf-out", default=None)
    parser.add_argument("--marks", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.marks:
        run_phase(args)
        return None
    if shutil.which("perf") is None:
        raise SystemExit("profile_step needs perf (apt install linux-perf)")
    with tempfile.TemporaryDirectory(prefix="profile-step-") as tmp:
        data, marks_path = Path(tmp) / "perf.data", Path(tmp) / "marks.json"
        child = [sys.executable, "-m", "loadtest.profile_step", "--phase", args.phase,
                 "--act-bits", str(args.act_bits), "--kv-dtype", args.kv_dtype,
                 "--steps", str(args.steps), "--prompts", str(args.prompts),
                 "--marks", str(marks_path), *(["--model", args.model] if args.model else [])]  # fmt: skip
        # -k realtime: sample timestamps on the wall clock, so the phase's marks cut them.
        subprocess.run(["perf", "record", "-q", "-F", "997", "-k", "CLOCK_REALTIME", "-o",
                        str(data), "--", *child], check=True)  # fmt: skip
        marks = json.loads(marks_path.read_text())
        script = subprocess.run(["perf", "script", "-i", str(data), "-F", "time,ip,sym,dso",
                                 "--ns"], capture_output=True, text=True, check=True)  # fmt: skip
    by_part: dict[str, int] = defaultdict(int)
    by_symbol: dict[str, int] = defaultdict(int)
    total = 0
    for line in script.stdout.splitlines():
        m = re.match(r"\s*(\d+\.\d+):\s+\S+\s+(.*)\s+\(([^()]*)\)\s*$", line)
        if not m:
            continue
        stamp = float(m.group(1))
        if not marks["start"] <= stamp <= marks["end"]:
            continue
        symbol, dso = m.group(2), Path(m.group(3)).name
        symbol = re.sub(r"\+0x[0-9a-f]+$", "", symbol)
        by_part[part_of(dso, symbol)] += 1
        by_symbol[f"{short_name(symbol)} [{dso}]"] += 1
        total += 1
    wall = marks["end"] - marks["start"]
    result = {"phase": args.phase, "wall_s": wall, "steps": marks["steps"],
              "tokens": marks["tokens"], "samples": total, "backend": marks["backend"],
              "prefill_sdpa": marks["prefill_sdpa"], "weights": marks["weights"],
              "sdpa_min_context": marks["sdpa_min_context"],
              "parts": {k: v / max(1, total) for k, v in sorted(by_part.items(), key=lambda kv: -kv[1])},
              "top": [(s, n / max(1, total)) for s, n in sorted(by_symbol.items(), key=lambda kv: -kv[1])[:25]]}  # fmt: skip
    text = report(result)
    print(text, end="")
    if args.perf_out:
        Path(args.perf_out).write_text(text)
        Path(args.perf_out + ".json").write_text(json.dumps(result, indent=1))
    return result


def sdpa_note(result: dict[str, Any]) -> str:
    if not result["prefill_sdpa"]:
        return ""
    return f" (prompt chunks through SDPA from {result.get('sdpa_min_context')} positions)"


def report(result: dict[str, Any]) -> str:
    per_step = result["wall_s"] / max(1, result["steps"]) * 1e3
    lines = [f"{result['phase']}: {result['weights']}, {result['backend']}"
             f"{sdpa_note(result)}; "
             f"{result['steps']} steps in {result['wall_s']:.2f} s ({per_step:.1f} ms a step, "
             f"{result['tokens'] / result['wall_s']:.0f} tok/s), {result['samples']} samples "
             "(both threads' CPU time)", ""]  # fmt: skip
    for part, share in result["parts"].items():
        lines.append(f"  {100 * share:5.1f} %  {part}")
    lines += ["", "top symbols:"]
    for symbol, share in result["top"]:
        lines.append(f"  {100 * share:5.1f} %  {symbol[:200]}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
