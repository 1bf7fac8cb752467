"""``pdserve experts``: the expert load MoE workers publish to Redis, and a placement plan.

pdserve experts [--model NAME] [--phase all|prefill|decode] [--top K] [--json]
    Per MoE layer, over the live windows (all workers added up): tokens routed, imbalance
    (max/mean), coefficient of variation, the hottest experts, and the trend (recent half
    of the windows against the older half); totals since the workers started.
pdserve experts plan --devices D --redundant R [--source windows|total] [--load 5,1,...]
    An EPLB-style replication and placement per layer (common/experts/planner.py): which
    experts get replicas, which device holds each, max/mean device load before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections import Counter
from typing import Any

from common.experts.planner import Plan, plan_placement
from common.experts.stats import summarize_layer

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def _common_args(parser: argparse.ArgumentParser, suppress: bool) -> None:
    """Options both ``experts`` and ``experts plan`` take; on the subcommand their defaults
    are suppressed so that ``pdserve experts --json plan`` keeps the --json given first."""

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    parser.add_argument(
        "--redis-url", default=default(None),
        help="default: $PDSERVE_REDIS_URL, else the stack `pdserve up` started, else "
        f"{DEFAULT_REDIS_URL}",
    )  # fmt: skip
    parser.add_argument(
        "--model", default=default(None), help="served model name (default: every MoE model)"
    )
    parser.add_argument(
        "--phase", choices=("all", "prefill", "decode"), default=default("all"),
        help="count tokens routed during prefill, decode, or both",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", default=default(False), help="JSON output")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "experts", help="MoE expert load per layer from Redis; `experts plan` for a placement",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    _common_args(parser, suppress=False)
    parser.add_argument("--top", type=int, default=5, help="hottest experts shown per layer")
    parser.set_defaults(func=run_show)
    commands = parser.add_subparsers(dest="experts_command", metavar="COMMAND")
    plan = commands.add_parser(
        "plan", help="EPLB-style replication and placement of the experts onto devices"
    )
    _common_args(plan, suppress=True)
    plan.add_argument("--devices", type=int, required=True, help="expert-parallel devices")
    plan.add_argument(
        "--redundant",
        type=int,
        default=0,
        help="redundant slots per MoE layer, over all devices: extra replicas to place",
    )
    plan.add_argument(
        "--source", choices=("windows", "total"), default="windows",
        help="balance the live windows' load (recent traffic) or the totals since start",
    )  # fmt: skip
    plan.add_argument("--layer", type=int, action="append", help="only this layer (repeatable)")
    plan.add_argument(
        "--load", default=None,
        help="plan this comma-separated load vector (one layer) instead of reading Redis",
    )  # fmt: skip
    plan.add_argument(
        "--distinct-devices", action="store_true",
        help="never two replicas of an expert on one device (by default a device may take "
        "two of a hot expert, as EPLB allows, and serves twice the replica share)",
    )  # fmt: skip
    plan.add_argument(
        "--placement", action="store_true", help="text output: list every device's experts"
    )
    plan.set_defaults(func=run_plan)


def redis_url(args: argparse.Namespace) -> str:
    if args.redis_url:
        return str(args.redis_url)
    if os.environ.get("PDSERVE_REDIS_URL"):
        return os.environ["PDSERVE_REDIS_URL"]
    from pdserve.cli.launcher import StackState, run_dir

    state = StackState.load(run_dir() / "stack.json")
    if state is not None and state.redis_url:
        return state.redis_url
    return DEFAULT_REDIS_URL


async def read_load(url: str, model: str | None) -> list[Any]:
    """ModelLoad of ``model`` (or of every model with published expert load)."""
    import redis.asyncio

    from common.index import expert_load

    client = redis.asyncio.from_url(url)
    try:
        names = [model] if model else await expert_load.models(client)
        return [await expert_load.read_model(client, name) for name in names]
    finally:
        await client.aclose()


def show(loads: list[Any], phase: str, top: int) -> list[dict[str, Any]]:
    """What ``pdserve experts --json`` prints: one object per model."""
    result = []
    for load in loads:
        layers = [
            summarize_layer(layer.layer, layer.window_counts(phase), layer.total_counts(phase), top)
            for layer in load.layers.values()
        ]
        result.append(
            {
                "model": load.model,
                "workers": load.workers,
                "window_s": load.window_ms / 1000,
                "windows": load.num_windows,
                "phase": phase,
                "layers": layers,
                **(
                    {"workers_with_other_windows": load.other_window_workers}
                    if load.other_window_workers
                    else {}
                ),
            }
        )
    return result


def _fetch(args: argparse.Namespace) -> list[Any] | None:
    import redis.exceptions

    url = redis_url(args)
    try:
        return asyncio.run(read_load(url, args.model))
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        print(f"pdserve experts: cannot reach Redis at {url}: {exc}", file=sys.stderr)
        return None


def run_show(args: argparse.Namespace) -> int:
    loads = _fetch(args)
    if loads is None:
        return 1
    models = show(loads, args.phase, max(1, args.top))
    if args.json:
        print(json.dumps(models, indent=2))
        return 0
    if not any(m["layers"] for m in models):
        target = args.model or "any model"
        print(f"no expert load published for {target} (only MoE workers with Redis publish it)")
        return 0
    for m in models:
        print(
            f"{m['model']}: {len(m['workers'])} worker(s), {m['windows']} windows of "
            f"{m['window_s']:g}s, phase {m['phase']}"
        )
        print(
            f"{'layer':>5} {'tokens':>10} {'max/mean':>8} {'cv':>6}  "
            f"{'trend max/mean (older -> recent)':<34} hottest experts (share)"
        )
        for layer in m["layers"]:
            trend = layer["trend"]
            if trend.get("comparable"):
                older, recent = trend["imbalance_older"], trend["imbalance_recent"]
                arrow = (
                    "up" if recent > older * 1.05 else "down" if recent < older / 1.05 else "flat"
                )
                trend_text = f"{older:.2f} -> {recent:.2f} ({arrow})"
            else:
                trend_text = "-"
            hot = ", ".join(f"e{h['expert']} {h['share'] * 100:.1f}%" for h in layer["hottest"])
            print(
                f"{layer['layer']:>5} {layer['tokens']:>10} {layer['imbalance']:>8.2f} "
                f"{layer['cv']:>6.2f}  {trend_text:<34} {hot or '-'}"
            )
        totals = [layer for layer in m["layers"] if layer["total_tokens"]]
        if totals:
            worst = max(totals, key=lambda layer: layer["total_imbalance"])
            print(
                f"since start: {sum(layer['total_tokens'] for layer in totals)} tokens routed; "
                f"most imbalanced layer {worst['layer']} (max/mean {worst['total_imbalance']:.2f})"
            )
    return 0


def plans_for(
    loads: list[Any],
    phase: str,
    source: str,
    devices: int,
    redundant: int,
    only: set[int] | None,
    distinct: bool = False,
) -> list[dict[str, Any]]:
    from common.index.expert_load import planner_load

    result = []
    for load in loads:
        layers = []
        for layer in load.layers.values():
            if only and layer.layer not in only:
                continue
            vector = planner_load(layer, phase, source)
            layers.append(_layer_plan(layer.layer, vector, devices, redundant, distinct))
        result.append({"model": load.model, "workers": load.workers, "layers": layers})
    return result


def _layer_plan(
    layer: int | None, load: list[int], devices: int, redundant: int, distinct: bool
) -> dict[str, Any]:
    plan = plan_placement(load, devices, redundant, distinct_devices=distinct)
    return {"layer": layer, "load": load, "plan": plan}


def run_plan(args: argparse.Namespace) -> int:
    if args.devices < 1 or args.redundant < 0:
        raise ValueError("--devices must be >= 1 and --redundant >= 0")
    results: list[dict[str, Any]]
    if args.load:
        vector = [int(float(x)) for x in args.load.split(",") if x.strip()]
        results = [{"model": "(--load)", "workers": [], "layers": [
            _layer_plan(None, vector, args.devices, args.redundant, args.distinct_devices)]}]  # fmt: skip
        source = "--load"
    else:
        loads = _fetch(args)
        if loads is None:
            return 1
        only = set(args.layer) if args.layer else None
        results = plans_for(
            loads, args.phase, args.source, args.devices, args.redundant, only,
            args.distinct_devices,
        )  # fmt: skip
        source = args.source
    if args.json:
        out = [
            {
                **{k: v for k, v in model.items() if k != "layers"},
                "devices": args.devices,
                "redundant": args.redundant,
                "source": source,
                "phase": args.phase,
                "layers": [
                    {"layer": entry["layer"], "load": entry["load"], **entry["plan"].to_json()}
                    for entry in model["layers"]
                ],
            }
            for model in results
        ]
        print(json.dumps(out, indent=2))
        return 0
    if not any(model["layers"] for model in results):
        print("no expert load to plan from (only MoE workers with Redis publish it)")
        return 0
    for model in results:
        if not model["layers"]:
            continue
        first: Plan = model["layers"][0]["plan"]
        print(
            f"{model['model']}: {args.devices} device(s), {args.redundant} redundant slot(s), "
            f"{first.slots_per_device} slots per device; load from {source}, phase {args.phase}"
        )
        print(
            f"{'layer':>5} {'tokens':>10} {'max/mean before':>15} {'after':>6}  "
            "replicated experts (replicas @ devices)"
        )
        for entry in model["layers"]:
            plan: Plan = entry["plan"]
            replicated = ", ".join(
                f"e{e} x{c} @ " + _devices_text(plan.devices_of(e))
                for e, c in sorted(plan.replicated().items(), key=lambda item: -item[1])
            )
            label = "-" if entry["layer"] is None else entry["layer"]
            print(
                f"{label:>5} {sum(entry['load']):>10} {plan.balance_before:>15.3f} "
                f"{plan.balance_after:>6.3f}  {replicated or '(none)'}"
            )
            if args.placement:
                for d, slots in enumerate(plan.placement):
                    experts = " ".join(f"e{e}" for e in slots)
                    print(f"{'':>7}d{d} load {plan.load_after[d]:.1f}: {experts}")
    return 0


def _devices_text(devices: list[int]) -> str:
    """``d0,d3(2)``: the devices holding an expert's replicas, with how many when > 1."""
    counts = Counter(devices)
    return ",".join(f"d{d}" + (f"({n})" if n > 1 else "") for d, n in sorted(counts.items()))
