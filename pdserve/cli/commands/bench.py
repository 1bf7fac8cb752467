"""``pdserve bench``: load tests with the definitions and flag names of ``vllm bench serve``.

pdserve bench serve [--backend pdserve|openai|openai-chat] [--base-url URL] ...
pdserve bench scenario NAME|all [--small] [--result-dir DIR] [--model DIR]
pdserve bench soak [--duration-s S] [--load-fraction F] [--result-dir DIR]
pdserve bench plan-sim [--workload shift|mooncake|rate-step] [--workers N ...] [--profile P]
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    from loadtest.scenarios import SCENARIOS
    from loadtest.serve import add_serve_args

    parser = subparsers.add_parser("bench", help="benchmark a server (vllm bench serve style)")
    kinds = parser.add_subparsers(dest="bench_command", required=True, metavar="KIND")
    serve = kinds.add_parser(
        "serve", help="one open-loop run against one server; vLLM's flags and result JSON",
        description="One open-loop benchmark run against pdserve's gateway or an "
        "OpenAI-compatible streaming server.",
    )  # fmt: skip
    add_serve_args(serve)
    serve.set_defaults(func=run_serve)
    scenario = kinds.add_parser(
        "scenario", help="start what a scenario needs, run it, write its report and figures",
        description="Scenarios: " + ", ".join(SCENARIOS) + ".",
    )  # fmt: skip
    scenario.add_argument("names", nargs="+", metavar="NAME", choices=[*SCENARIOS, "all"])
    scenario.add_argument("--small", action="store_true", help="CI size: seconds per scenario")
    scenario.add_argument(
        "--result-dir", default=None, help="default loadtest/results/{small,full}"
    )
    scenario.add_argument("--model", default=None, help="checkpoint directory (default model)")
    scenario.add_argument("--seed", type=int, default=0)
    scenario.add_argument("--progress", action="store_true", help="show progress bars")
    scenario.set_defaults(func=run_scenario)
    from loadtest.soak import add_soak_args

    soak = kinds.add_parser(
        "soak", help="steady load at a fraction of capacity for a long time; RSS per process",
        description="Starts a stack (pdserve up) unless --run-dir names one, measures its "
        "capacity, sends Poisson load at --load-fraction of it for --duration-s, and reports "
        "every process's memory growth, failures by status code and latency per window.",
    )  # fmt: skip
    add_soak_args(soak)
    soak.set_defaults(func=run_soak)
    from loadtest.plan_sim.cli import add_plan_sim_args

    plan_sim = kinds.add_parser(
        "plan-sim", help="the SLA planner against every fixed split, in a simulated fleet",
        description="A discrete-event model of N engine workers built from a worker profile "
        "replays a workload at each fleet size, with every fixed prefill:decode split of that "
        "size and with the planner in the loop, and reports SLA attainment, goodput per "
        "worker and worker-seconds. --calibrate compares it with a recorded real run.",
    )  # fmt: skip
    add_plan_sim_args(plan_sim)
    plan_sim.set_defaults(func=run_plan_sim)


def run_serve(args: argparse.Namespace) -> int:
    from loadtest.serve import run_serve as serve

    result = asyncio.run(serve(args))
    return 0 if result["completed"] else 1


def run_plan_sim(args: argparse.Namespace) -> int:
    from loadtest.plan_sim.cli import run_plan_sim as plan_sim

    return plan_sim(args)


def run_soak(args: argparse.Namespace) -> int:
    from loadtest.soak import run_soak as soak

    result = soak(args)
    return 0 if result["completed"] and not result["failed"] else 1


def run_scenario(args: argparse.Namespace) -> int:
    from common.models.default_model import resolve_model
    from loadtest.scenarios import SCENARIOS, default_result_dir, run_scenarios
    from loadtest.scenarios.common import ScenarioOptions

    names = list(SCENARIOS) if "all" in args.names else list(dict.fromkeys(args.names))
    result_dir = Path(args.result_dir) if args.result_dir else default_result_dir(args.small)
    options = ScenarioOptions(small=args.small, result_dir=result_dir, seed=args.seed,
                              disable_tqdm=not args.progress)  # fmt: skip
    reports = run_scenarios(names, options, resolve_model(args.model))
    for report in reports:
        print(f"{report.name}: {report.directory / 'report.txt'}")
    return 0 if all(r["completed"] for rep in reports for r in rep.rows) else 1
