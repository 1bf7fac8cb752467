"""pdserve's engine against OpenVINO GenAI's continuous-batching pipeline on this CPU, one run.

1. OpenVINO GenAI in its own venv with the default model exported by optimum-intel (int4
   symmetric group 32, and int8): loadtest/baselines/build_openvino.sh, once, outside the repo.
2. One workload for both (seeded random token ids, sent as ids to both engines, greedy, EOS
   ignored): ``c1``, ``c16``, ``c64``: that many requests in flight (closed loop) of 104 prompt
   tokens and 128 output tokens (output tok/s over the wall time, prefill included, TTFT and
   TPOT); ``prefill512``, ``prefill2000``: one prompt at a time, prefill tok/s (add to first
   token), apart from decode. loadtest/baselines/engine_cases.py measures both engines.
3. Each engine runs in a process of its own, one at a time, each setting of each engine once a
   round, the engines' order alternating between rounds. Settings: each engine's defaults (as
   a user who loads the model with no options gets them) and the alternatives below; per case
   the report gives the defaults, the best setting (the highest median over the rounds), and
   the ratios pdserve / OpenVINO of both. pdserve's process applies glibc's tuning as every
   pdserve server process does (common/heap.py tune_malloc).

Run it on a quiet machine:

    bash loadtest/baselines/build_openvino.sh          # once: about 3 minutes
    .venv/bin/python -m loadtest.bench_openvino --result-dir docs/benchmarks/DATE-openvino
    .venv/bin/python -m loadtest.bench_openvino --quick  # small shapes, a check of the script
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = REPO / "loadtest" / "baselines" / "build_openvino.sh"
OV_WORKER = REPO / "loadtest" / "baselines" / "openvino_engine.py"

# name -> EngineConfig fields over the defaults (the model: the default model, as pdserve
# serves it with no options: its GGUF file's own quantization).
PDSERVE_SETTINGS: dict[str, dict[str, Any]] = {
    "default": {},
    "kv16": {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "kv_dtype": "float16"},
    "act8-kv16": {
        "max_num_seqs": 64,
        "max_num_batched_tokens": 2048,
        "kv_dtype": "float16",
        "quant_act_bits": 8,
    },
}
# name -> the export (under the build script's cache), SchedulerConfig fields, CPU properties.
OPENVINO_SETTINGS: dict[str, dict[str, Any]] = {
    "default": {"export": "int4"},
    "f16kv": {"export": "int4", "properties": {"KV_CACHE_PRECISION": "f16"}},
    "f16kv-batch2048": {
        "export": "int4",
        "properties": {"KV_CACHE_PRECISION": "f16"},
        "scheduler": {"max_num_batched_tokens": 2048},
    },
    "int8": {"export": "int8"},
}


def log(text: str) -> None:
    print(text, flush=True)


# -- the workload ----------------------------------------------------------------------------


def make_workload(vocab_size: int, args: argparse.Namespace) -> dict[str, Any]:
    from loadtest.datasets.base import TokenSource

    source = TokenSource(vocab_size, args.seed)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [list(source.tokens(length)) for _ in range(n)]

    cases = []
    for concurrency in args.concurrency:
        n = max(concurrency, args.min_requests) if concurrency > 1 else args.single_requests
        cases.append({"name": f"c{concurrency}", "kind": "batch", "concurrency": concurrency,
                      "output_len": args.output_len,
                      "prompts": prompts(n, args.input_len)})  # fmt: skip
    for length in args.prefill_lens:
        cases.append({"name": f"prefill{length}", "kind": "prefill",
                      "prompts": prompts(args.prefill_reps, length)})  # fmt: skip
    return {"cases": cases,
            "warmup": {"batch": prompts(2, args.input_len),
                       "prefill": prompts(1, max(args.prefill_lens))}}  # fmt: skip


# -- pdserve's side (a process of its own: python -m loadtest.bench_openvino --worker ...) ----


def pdserve_worker(workload_path: str, settings_path: str, result_path: str) -> None:
    import common.openmp  # noqa: F401  (before torch: OpenMP's wait policy)

    # isort: split
    import torch

    from common.engine.config import EngineConfig
    from common.engine.engine import Engine
    from common.heap import tune_malloc
    from loadtest.baselines.engine_cases import run_cases
    from loadtest.gpu_check import SteppedPdserve

    # As every pdserve server process starts (pdserve/cli/main.py): glibc keeps the steps'
    # large buffers in the heap instead of mapping fresh, zeroed pages for each.
    malloc_tuned = tune_malloc()
    workload = json.loads(Path(workload_path).read_text())
    settings = json.loads(Path(settings_path).read_text())
    start = time.perf_counter()
    engine = Engine(EngineConfig(**settings))
    load_s = time.perf_counter() - start
    wf = engine.runner.weight_format
    figures = run_cases(SteppedPdserve(engine), workload, log=log)
    result = {"engine": "pdserve", "load_s": load_s, "threads": torch.get_num_threads(),
              "malloc_tuned": malloc_tuned,
              "weight_format": {"name": wf.name, "file_type": wf.file_type, "kernel": wf.kernel,
                                "act_bits": wf.act_bits},
              "attention": type(engine.runner.backend).__name__, "cases": figures}  # fmt: skip
    Path(result_path).write_text(json.dumps(result, indent=1))


# -- rounds -----------------------------------------------------------------------------------


def openvino_python() -> tuple[str, Path]:
    """The OpenVINO venv's python and the exports' folder (built once by BUILD_SCRIPT)."""
    out = subprocess.run(["bash", str(BUILD_SCRIPT)], check=True, capture_output=True, text=True)
    python = out.stdout.strip().splitlines()[-1]
    return python, Path(python).parents[2] / "models"


def run_one(engine: str, name: str, settings: dict[str, Any], workload_path: Path,
            scratch: Path, ov_python: str | None, threads: int) -> dict[str, Any]:  # fmt: skip
    settings_path = scratch / f"{engine}-{name}.settings.json"
    result_path = scratch / f"{engine}-{name}.result.json"
    settings_path.write_text(json.dumps(settings))
    env = dict(os.environ)
    if engine == "pdserve":
        command = [sys.executable, "-m", "loadtest.bench_openvino", "--worker",
                   str(workload_path), str(settings_path), str(result_path)]  # fmt: skip
    else:
        assert ov_python is not None
        command = [ov_python, str(OV_WORKER), str(workload_path), str(settings_path),
                   str(result_path)]  # fmt: skip
    env["OMP_NUM_THREADS"] = str(threads)
    log(f"-- {engine} [{name}]")
    subprocess.run(command, check=True, cwd=REPO, env=env)
    result: dict[str, Any] = json.loads(result_path.read_text())
    return result


def settings_of(args: argparse.Namespace, model_dir: str,
                exports: Path | None) -> dict[str, dict[str, dict[str, Any]]]:  # fmt: skip
    chosen: dict[str, dict[str, dict[str, Any]]] = {"pdserve": {}, "openvino": {}}
    for name in args.pdserve_settings:
        chosen["pdserve"][name] = {"model": model_dir, "num_threads": args.threads,
                                   **PDSERVE_SETTINGS[name]}  # fmt: skip
    if exports is not None:
        for name in args.openvino_settings:
            preset = OPENVINO_SETTINGS[name]
            properties = {"INFERENCE_NUM_THREADS": args.threads, **preset.get("properties", {})}
            chosen["openvino"][name] = {"model": str(exports / preset["export"]),
                                        "scheduler": preset.get("scheduler", {}),
                                        "properties": properties}  # fmt: skip
    return chosen


def rounds(args: argparse.Namespace, workload: dict[str, Any], model_dir: str
           ) -> tuple[dict[str, dict[str, list[dict[str, Any]]]], dict[str, Any]]:  # fmt: skip
    from loadtest.bench_llamacpp import OtherWork

    ov_python, exports = (None, None) if "openvino" not in args.engines else openvino_python()
    chosen = settings_of(args, model_dir, exports)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {e: {} for e in args.engines}
    with tempfile.TemporaryDirectory(prefix="bench-openvino-") as tmp, OtherWork() as meter:
        scratch = Path(tmp)
        workload_path = scratch / "workload.json"
        workload_path.write_text(json.dumps(workload))
        for r in range(args.rounds):
            order = list(args.engines) if r % 2 == 0 else list(reversed(args.engines))
            log(f"== round {r + 1} of {args.rounds}: {' then '.join(order)}")
            for engine in order:
                for name, settings in chosen[engine].items():
                    result = run_one(engine, name, settings, workload_path, scratch, ov_python,
                                     args.threads)  # fmt: skip
                    runs[engine].setdefault(name, []).append(result)
    return runs, {"settings": chosen, "other_cpu": meter.fraction}


# -- the report -------------------------------------------------------------------------------


def figure_of(case: dict[str, Any]) -> float:
    return float(case["output_tok_s"] if "output_tok_s" in case else case["prefill_tok_s"])


def summarize(runs: dict[str, dict[str, list[dict[str, Any]]]],
              case_names: list[str]) -> dict[str, Any]:  # fmt: skip
    """Per case and engine: each setting's median over rounds (and range), the defaults'
    figure, the best setting and its figure; ratios pdserve / OpenVINO."""
    summary: dict[str, Any] = {}
    for case in case_names:
        row: dict[str, Any] = {}
        for engine, by_setting in runs.items():
            per = {name: [figure_of(r["cases"][case]) for r in results]
                   for name, results in by_setting.items()}  # fmt: skip
            medians = {name: statistics.median(v) for name, v in per.items()}
            best = max(medians, key=lambda n: medians[n])
            row[engine] = {"settings": {n: {"median": medians[n], "all": per[n]} for n in per},
                           "default": medians.get("default"), "best": medians[best],
                           "best_setting": best}  # fmt: skip
        if "pdserve" in row and "openvino" in row:
            pd, ov = row["pdserve"], row["openvino"]
            row["ratio_default"] = (pd["default"] / ov["default"]
                                    if pd["default"] and ov["default"] else None)  # fmt: skip
            row["ratio_best"] = pd["best"] / ov["best"]
        summary[case] = row
    return summary


def format_report(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [f"{m['cpu']}, {m['threads']} threads for each engine, {result['rounds']} rounds; "
             f"other work on the CPUs while measuring: {100 * result['other_cpu']:.1f} %",
             f"workload: {result['input_len']}-token prompts, {result['output_len']} output "
             "tokens (EOS ignored, greedy); cN = N requests in flight, output tok/s; "
             "prefillN = prefill tok/s of an N-token prompt", ""]  # fmt: skip
    engines = list(result["runs"])
    header = f"{'case':<12}"
    for engine in engines:
        header += f"{engine + ' default':>18}{engine + ' best':>26}"
    if len(engines) == 2:
        header += f"{'ratio default':>15}{'ratio best':>12}"
    lines.append(header)
    for case, row in result["summary"].items():
        line = f"{case:<12}"
        for engine in engines:
            e = row[engine]
            default = f"{e['default']:.1f}" if e["default"] is not None else "-"
            best = f"{e['best']:.1f} ({e['best_setting']})"
            line += f"{default:>18}{best:>26}"
        if "ratio_best" in row:
            rd = f"{row['ratio_default']:.2f}x" if row["ratio_default"] else "-"
            line += f"{rd:>15}{row['ratio_best']:>11.2f}x"
        lines.append(line)
    lines += ["", "every setting (median over rounds; all rounds):"]
    for case, row in result["summary"].items():
        for engine in engines:
            for name, s in row[engine]["settings"].items():
                values = ", ".join(f"{v:.1f}" for v in s["all"])
                lines.append(f"  {case:<12}{engine:<10}{name:<18}{s['median']:9.1f}  [{values}]")
    detail = []
    for engine in engines:
        for name, results in result["runs"][engine].items():
            first = results[0]
            if engine == "pdserve":
                wf = first["weight_format"]
                detail.append(f"  pdserve [{name}]: weights {wf['name']} {wf['file_type'] or ''} "
                              f"act {wf['act_bits']}-bit, {first['attention']}, "
                              f"{first['threads']} threads")  # fmt: skip
            else:
                detail.append(f"  openvino [{name}]: {first['version']}, "
                              f"{result['settings']['openvino'][name]}")  # fmt: skip
    lines += ["", "settings:", *detail]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--worker", nargs=3, metavar=("WORKLOAD", "SETTINGS", "RESULT"),
                        help=argparse.SUPPRESS)  # fmt: skip
    parser.add_argument("--engines", nargs="+", default=["pdserve", "openvino"],
                        choices=["pdserve", "openvino"])  # fmt: skip
    parser.add_argument("--pdserve-settings", nargs="+", default=list(PDSERVE_SETTINGS),
                        choices=list(PDSERVE_SETTINGS))  # fmt: skip
    parser.add_argument("--openvino-settings", nargs="+", default=list(OPENVINO_SETTINGS),
                        choices=list(OPENVINO_SETTINGS))  # fmt: skip
    parser.add_argument("--model", default=None, help="pdserve's model (default: the default)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--input-len", type=int, default=104)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--single-requests", type=int, default=4,
                        help="requests one after another at concurrency 1")  # fmt: skip
    parser.add_argument("--min-requests", type=int, default=32,
                        help="at least this many requests at concurrency > 1")  # fmt: skip
    parser.add_argument("--prefill-lens", type=int, nargs="+", default=[512, 2000])
    parser.add_argument("--prefill-reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="small shapes and one round: a check of the script")  # fmt: skip
    parser.add_argument("--result-dir", default=None)
    args = parser.parse_args(argv)
    if args.worker:
        pdserve_worker(*args.worker)
        return None
    if args.quick:
        args.rounds, args.concurrency, args.input_len, args.output_len = 1, [1, 4], 32, 8
        args.single_requests, args.min_requests, args.prefill_lens = 2, 4, [64]
        args.prefill_reps = 1

    from common.models.default_model import resolve_model
    from loadtest.bench_llamacpp import machine_info

    model_dir = resolve_model(args.model)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    workload = make_workload(vocab, args)
    machine = machine_info(args.threads)
    start = time.perf_counter()
    runs, extra = rounds(args, workload, model_dir)
    case_names = [c["name"] for c in workload["cases"]]
    result = {"machine": machine, "rounds": args.rounds, "input_len": args.input_len,
              "output_len": args.output_len, "wall_s": time.perf_counter() - start,
              "summary": summarize(runs, case_names), "runs": runs, **extra}  # fmt: skip
    text = format_report(result)
    log("")
    log(text)
    if args.result_dir:
        out = Path(args.result_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_openvino.json").write_text(json.dumps(result, indent=1))
        (out / "bench_openvino.txt").write_text(text)
    return result


if __name__ == "__main__":
    main()
