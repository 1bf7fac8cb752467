"""``pdserve bench plan-sim``: the planner against every fixed split, in simulation.

pdserve bench plan-sim --workload shift --workers 32 --workers 128
pdserve bench plan-sim --workload mooncake --workers 8 --workers 256 --fixed none
pdserve bench plan-sim --profile cpu --workload shift --workers 2
pdserve bench plan-sim --forecast-eval
pdserve bench plan-sim --calibrate RUN.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from loadtest.plan_sim import PROFILE_NAMES, WORKLOADS

if TYPE_CHECKING:
    from common.planner.policy import PlannerConfig
    from common.planner.profile import WorkerProfile
    from common.planner.types import Targets
    from loadtest.plan_sim.report import Comparison
    from loadtest.plan_sim.scenarios import Fleet

# services/gateway/config.py's default (common/planner/model.py repeats it).
DEFAULT_LOCAL_PREFILL_TOKENS = 16
PLANNER_MODES = ("elastic", "roles")


def add_plan_sim_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=WORKLOADS, default="shift")
    parser.add_argument(
        "--workers", type=int, action="append", default=None,
        help="fleet size (repeatable; default 32 and 128); fixed splits are of this total "
        "and the planner's maximum",
    )  # fmt: skip
    parser.add_argument(
        "--profile", default="gpu",
        help=f"a WorkerProfile JSON (pdserve profile --json), or {' / '.join(PROFILE_NAMES)}",
    )  # fmt: skip
    parser.add_argument("--ttft-ms", type=float, default=None, help="default: per workload")
    parser.add_argument("--itl-ms", type=float, default=None, help="default: per workload")
    parser.add_argument("--load", type=float, default=0.7,
                        help="shift: the rate as a share of the fleet's phase-A prefill capacity")  # fmt: skip
    parser.add_argument("--rate-per-worker", type=float, default=None,
                        help="mooncake: requests/s per worker (default per profile)")  # fmt: skip
    parser.add_argument("--phase-s", type=float, default=600.0)
    parser.add_argument("--cycles", type=int, default=2)
    parser.add_argument("--duration-s", type=float, default=None,
                        help="mooncake: replay only this much of the hour")  # fmt: skip
    parser.add_argument(
        "--fixed", default="search",
        help="fixed splits to run: search (coarse to fine), all, none, or prefill counts "
        "(comma separated)",
    )  # fmt: skip
    parser.add_argument(
        "--sizes", default="",
        help="also fixed fleets of these fractions of --workers (comma separated, e.g. "
        "0.5,0.75): colocated and at the best split's prefill share",
    )  # fmt: skip
    parser.add_argument(
        "--planner", default="elastic,roles",
        help="planner modes (comma separated): elastic (1 to --workers), roles (the total "
        "fixed, roles change), none",
    )  # fmt: skip
    parser.add_argument("--interval-s", type=float, default=30.0)
    parser.add_argument("--no-feedback", action="store_true")
    parser.add_argument("--local-prefill-tokens", type=int, default=DEFAULT_LOCAL_PREFILL_TOKENS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write every run here")
    parser.add_argument("--decisions", action="store_true", help="print the planner's changes")
    parser.add_argument("--forecast-eval", action="store_true",
                        help="one-step-ahead errors of rate forecasts on the traces; no runs")  # fmt: skip
    parser.add_argument("--calibrate", type=Path, default=None, metavar="RUN.json",
                        help="simulate a recorded local run; simulated against measured")  # fmt: skip


def run_plan_sim(args: argparse.Namespace) -> int:
    from common.planner.types import Targets
    from loadtest.plan_sim.profiles import load_profile
    from loadtest.plan_sim.report import dump
    from loadtest.plan_sim.scenarios import fleet_for

    if args.forecast_eval:
        from loadtest.plan_sim.forecast_eval import print_forecast_eval

        print_forecast_eval()
        return 0
    if args.calibrate is not None:
        from loadtest.plan_sim.calibrate import print_calibration

        return print_calibration(args.calibrate, args)
    profile = load_profile(args.profile)
    fleet = fleet_for(profile)
    default = fleet.targets[args.workload]
    targets = Targets(args.ttft_ms or default.ttft_ms, args.itl_ms or default.itl_ms)
    comparisons = []
    for workers in args.workers or [32, 128]:
        comparison = _compare(args, profile, fleet, targets, workers)
        print(comparison.table(), flush=True)
        print(flush=True)
        comparisons.append(comparison)
    if args.json is not None:
        args.json.write_text(dump(comparisons) + "\n", encoding="utf-8")
    return 0


def _compare(
    args: argparse.Namespace,
    profile: WorkerProfile,
    fleet: Fleet,
    targets: Targets,
    workers: int,
) -> Comparison:
    from common.planner.policy import Planner
    from common.planner.types import Split
    from loadtest.plan_sim.report import Comparison, fixed_split_search, smaller_fleets
    from loadtest.plan_sim.run import RunResult, simulate
    from loadtest.plan_sim.scenarios import build_workload, cluster_config

    workload = build_workload(
        args.workload, profile, fleet, workers, load=args.load,
        rate_per_worker=args.rate_per_worker, phase_s=args.phase_s, cycles=args.cycles,
        duration_s=args.duration_s, seed=args.seed,
    )  # fmt: skip
    config = cluster_config(fleet, profile, workers, args.local_prefill_tokens, args.seed)
    began = time.perf_counter()
    print(
        f"{workload.name}: {len(workload.requests)} requests over {workload.duration_s:.0f} s "
        f"({workload.rate:.2f}/s), targets ttft {targets.ttft_ms:g} ms, itl {targets.itl_ms:g} "
        f"ms, profile {profile.key.slug()}",
        file=sys.stderr, flush=True,
    )  # fmt: skip

    def run_fixed(split: Split) -> RunResult:
        result = simulate(workload, profile, config, targets, split, interval_s=args.interval_s)
        print(f"  {split}: attainment {result.attainment:.3f} ({result.wall_s:.1f} s)",
              file=sys.stderr, flush=True)  # fmt: skip
        return result

    if args.fixed == "none":
        fixed: dict[int, RunResult] = {}
    elif args.fixed in ("search", "all"):
        fixed = fixed_split_search(workers, run_fixed, exhaustive=args.fixed == "all")
    else:
        fixed = {p: run_fixed(Split(p, workers - p)) for p in map(int, args.fixed.split(","))}
    comparison = Comparison(workload.name, workers, fixed)
    if args.sizes and fixed:
        fractions = [float(f) for f in args.sizes.split(",")]
        best = comparison.best_fixed.fixed_split
        assert best is not None, "a fixed run knows its split"
        comparison.smaller = smaller_fleets(workers, best, fractions, run_fixed)
    for mode in [m for m in args.planner.split(",") if m and m != "none"]:
        if mode not in PLANNER_MODES:
            raise SystemExit(f"unknown planner mode {mode!r}; one of {', '.join(PLANNER_MODES)}")
        planner = Planner(profile, targets, _planner_config(args, fleet, workers, mode))
        start = Split(workers // 2, workers - workers // 2)
        result = simulate(
            workload, profile, config, targets, start, planner=planner,
            interval_s=args.interval_s, name=f"planner ({mode})",
        )  # fmt: skip
        print(f"  planner ({mode}): attainment {result.attainment:.3f} ({result.wall_s:.1f} s)",
              file=sys.stderr, flush=True)  # fmt: skip
        if args.decisions:
            for d in result.decisions:
                if d.changed:
                    print(f"    {d.at_s:7.0f} s  {d.split}  {d.reason}")
        comparison.planners[result.name] = result
    print(f"  ({time.perf_counter() - began:.0f} s)", file=sys.stderr, flush=True)
    return comparison


def _planner_config(
    args: argparse.Namespace, fleet: Fleet, workers: int, mode: str
) -> PlannerConfig:
    from common.planner.feedback import FeedbackConfig
    from common.planner.policy import PlannerConfig
    from loadtest.plan_sim.scenarios import model_config

    return PlannerConfig(
        min_workers=1 if mode == "elastic" else workers,
        max_workers=workers,
        fixed_total=mode == "roles",
        model=model_config(fleet, args.local_prefill_tokens, args.interval_s),
        feedback=FeedbackConfig(enabled=not args.no_feedback),
    )
