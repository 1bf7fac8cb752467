"""``pdserve planner``: sets the prefill:decode split from live load to meet TTFT and ITL
targets (services/planner), by roles in place, ``pdserve up``'s workers, or Kubernetes."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

from common.planner.types import Targets
from pdserve.cli.commands.security_args import add_tls_args, tls_from_args
from pdserve.cli.commands.telemetry_args import add_metrics_port_arg
from services.planner.config import CONNECTORS, PlannerServiceConfig


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "planner", help="size the prefill and decode roles from live load (SLA planner)"
    )
    add_planner_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind; [::] for all")
    parser.add_argument("--port", type=int, default=0, help="gRPC health port; 0 = a free one")
    parser.add_argument("--worker-id", default="planner-0", help="its id in the registry")
    parser.add_argument(
        "--model", default=None,
        help="the model the workers serve: its served name, or its directory as given to "
        "them (default: the default model)",
    )  # fmt: skip
    parser.add_argument(
        "--redis-url", default=os.environ.get("PDSERVE_REDIS_URL"), help="registry and profiles"
    )
    parser.add_argument(
        "--connector",
        choices=CONNECTORS,
        default="local",
        help="local: change roles of the workers in place (and with --stack-state start and "
        "stop pdserve up's workers); kubernetes: set the prefill and decode Deployments' "
        "replicas; metrics: only export pdserve:planner_desired_workers for an autoscaler",
    )
    parser.add_argument(
        "--stack-state",
        default=None,
        help="local: pdserve up's stack.json; the planner may then start and stop workers "
        "within --max-workers (without it, it changes roles only)",
    )
    k8s = parser.add_argument_group("kubernetes connector")
    k8s.add_argument("--namespace", default="default")
    k8s.add_argument("--prefill-deployment", default="")
    k8s.add_argument("--decode-deployment", default="")
    k8s.add_argument("--kubeconfig", default=None, help="default: in-cluster, else KUBECONFIG")
    add_metrics_port_arg(parser)
    add_tls_args(parser)
    parser.set_defaults(func=run)


def add_planner_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The SLA and sizing flags, shared with ``pdserve up --planner``."""
    parser.add_argument(
        "--ttft-ms", type=float, default=None, help="SLA: time to first token target (ms)"
    )
    parser.add_argument(
        "--itl-ms", type=float, default=None,
        help="SLA: each request's mean time per output token after the first (ms)",
    )  # fmt: skip
    parser.add_argument("--interval-s", type=float, default=10.0, help="planning interval")
    parser.add_argument(
        "--dwell-s", type=float, default=60.0,
        help="a worker that entered a role keeps it at least this long",
    )  # fmt: skip
    parser.add_argument("--min-workers", type=int, default=1)
    parser.add_argument(
        "--max-workers", type=int, default=0,
        help="most engine workers; 0 = as many as are registered at start (roles change only)",
    )  # fmt: skip


def targets_from_args(args: argparse.Namespace) -> Targets:
    if args.ttft_ms is None or args.itl_ms is None:
        raise ValueError("the planner needs its targets: --ttft-ms and --itl-ms")
    return Targets(ttft_ms=args.ttft_ms, itl_ms=args.itl_ms)


def config_from_args(args: argparse.Namespace) -> PlannerServiceConfig:
    if not args.redis_url:
        raise ValueError("the planner needs Redis: --redis-url or PDSERVE_REDIS_URL")
    from common.models.default_model import DEFAULT_MODEL_NAME

    # Workers serve a checkpoint under its directory's name (WorkerConfig.served_model_name).
    model = Path(args.model).name if args.model else DEFAULT_MODEL_NAME
    return PlannerServiceConfig(
        targets=targets_from_args(args),
        model=model,
        redis_url=args.redis_url,
        connector=args.connector,
        interval_s=args.interval_s,
        dwell_s=args.dwell_s,
        min_workers=args.min_workers,
        max_workers=args.max_workers,
        namespace=args.namespace,
        prefill_deployment=args.prefill_deployment,
        decode_deployment=args.decode_deployment,
        kubeconfig=args.kubeconfig,
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        worker_id=args.worker_id,
        tls=tls_from_args(args),
    )


def run(args: argparse.Namespace) -> int:
    from services.planner.server import serve

    config = config_from_args(args)
    processes = None
    if args.stack_state:
        from pdserve.cli.stack_workers import StackWorkers

        processes = StackWorkers(Path(args.stack_state))
    asyncio.run(serve(config, processes))
    return 0
