"""``pdserve worker --role ROLE``, and its names ``pdserve prefill`` and ``pdserve decode``:
serve one engine as a worker until SIGTERM. Every engine worker serves both faces; the role
it starts in says which takes new calls, and changes in place (``pdserve role``)."""

from __future__ import annotations

import argparse
import asyncio
import os

from common.planner.types import ENGINE_ROLES
from pdserve.cli.commands.security_args import add_tls_args, tls_from_args
from pdserve.cli.commands.telemetry_args import add_metrics_port_arg
from pdserve.cli.engine_args import add_engine_args, engine_config_from_args
from services.worker.config import KV_LOAD_FAILURE_POLICIES, PROFILE_MODES, WorkerConfig

DEFAULT_PORTS = {"prefill": 50052, "decode": 50053, "worker": 50054}


def register(subparsers: argparse._SubParsersAction) -> None:
    for command, text in (
        ("worker", "serve an engine worker in a role (prefill, decode, both) it can change"),
        ("prefill", "serve an engine worker that starts in the prefill role"),
        ("decode", "serve an engine worker that starts in the decode role"),
    ):
        parser = subparsers.add_parser(command, help=text)
        if command == "worker":
            parser.add_argument(
                "--role", choices=ENGINE_ROLES, default="both",
                help="the role it starts in: which of PrefillService and DecodeService take "
                "new calls (both: it prefills what it decodes, and prefills for others)",
            )  # fmt: skip
        parser.add_argument("--host", default="127.0.0.1", help="address to bind; [::] for all")
        parser.add_argument(
            "--port", type=int, default=DEFAULT_PORTS[command], help="0 = any free port"
        )
        parser.add_argument("--advertise", default=None, help="host:port others use to reach us")
        parser.add_argument("--worker-id", default=None)
        parser.add_argument("--model-name", default=None, help="served model name (dir name)")
        parser.add_argument(
            "--redis-url", default=os.environ.get("PDSERVE_REDIS_URL"), help="registry and index"
        )
        parser.add_argument(
            "--blockstore", default=os.environ.get("PDSERVE_BLOCKSTORE"), help="block store address"
        )
        parser.add_argument("--lease-ttl-s", type=float, default=30.0, help="KV lease lifetime")
        parser.add_argument("--drain-grace-s", type=float, default=10.0)
        parser.add_argument(
            "--blockstore-timeout-s",
            type=float,
            default=5.0,
            help="most a block store read on a request's path may take; a store that fails "
            "is skipped for a few seconds (requests never fail because of it)",
        )
        parser.add_argument(
            "--kv-load-failure",
            choices=KV_LOAD_FAILURE_POLICIES,
            default="recompute",
            help="when a request's KV can be pulled neither from its prefill worker nor "
            "(every full block) from the block store: recompute it here, or fail the "
            "request (UNAVAILABLE, reason KV_LOAD_FAILED)",
        )
        parser.add_argument(
            "--kv-pull-timeout-s",
            type=float,
            default=60.0,
            help="most a KV pull from a prefill worker may take before the block store "
            "and recompute take over",
        )
        parser.add_argument(
            "--profile", choices=PROFILE_MODES, default="auto",
            help="at start, the worker's measured profile (what the planner sizes roles "
            "with): auto reuses the one of this model, weights, threads and device from Redis "
            "or $PDSERVE_CACHE/profiles and measures only when there is none (seconds); "
            "measure always; off none",
        )  # fmt: skip
        moe = parser.add_argument_group("expert load (MoE models)")
        moe.add_argument(
            "--expert-load-interval-s", type=float, default=5.0,
            help="how often expert load is read from the engine and published to Redis",
        )  # fmt: skip
        moe.add_argument(
            "--expert-load-window-s", type=float, default=60.0,
            help="length of one expert-load window in Redis (and of the gauges' window)",
        )  # fmt: skip
        moe.add_argument(
            "--expert-load-windows", type=int, default=60,
            help="windows kept in Redis before they expire",
        )  # fmt: skip
        moe.add_argument(
            "--expert-metrics-per-expert", action="store_true",
            help="also export a Prometheus counter per layer, expert and phase (many series)",
        )  # fmt: skip
        add_metrics_port_arg(parser)
        add_tls_args(parser)
        add_engine_args(parser)
        if command != "worker":
            parser.set_defaults(role=command)
        parser.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    from common.models.default_model import resolve_model

    return WorkerConfig(
        role=args.role,
        engine=engine_config_from_args(args, resolve_model(args.model)),
        host=args.host,
        port=args.port,
        advertise=args.advertise,
        worker_id=args.worker_id,
        model_name=args.model_name,
        redis_url=args.redis_url,
        blockstore=args.blockstore,
        lease_ttl_s=args.lease_ttl_s,
        drain_grace_s=args.drain_grace_s,
        metrics_port=args.metrics_port,
        blockstore_timeout_s=args.blockstore_timeout_s,
        kv_load_failure=args.kv_load_failure,
        kv_pull_timeout_s=args.kv_pull_timeout_s,
        expert_load_interval_s=args.expert_load_interval_s,
        expert_load_window_s=args.expert_load_window_s,
        expert_load_windows=args.expert_load_windows,
        expert_metrics_per_expert=args.expert_metrics_per_expert,
        tls=tls_from_args(args),
        profile=args.profile,
    )


def run(args: argparse.Namespace) -> int:
    from services.worker.server import serve

    asyncio.run(serve(config_from_args(args)))
    return 0
