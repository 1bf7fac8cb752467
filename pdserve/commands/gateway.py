"""``pdserve gateway``: serve the public GatewayService until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import os

from pdserve.commands.telemetry_args import add_metrics_port_arg
from services.gateway.config import GatewayConfig


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("gateway", help="serve the public gateway (GatewayService)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind; [::] for all")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--model", default=None, help="checkpoint directory (tokenizer, config)")
    parser.add_argument("--model-name", default=None, help="served model name (dir name)")
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("PDSERVE_REDIS_URL", "redis://127.0.0.1:6379/0"),
        help="worker registry and prefix index",
    )
    parser.add_argument("--block-size", type=int, default=16, help="must match the workers'")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--local-prefill-tokens",
        type=int,
        default=16,
        help="prefill on the decode worker when fewer uncached prompt tokens than this",
    )
    parser.add_argument("--overlap-weight", type=float, default=1.0)
    parser.add_argument("--max-in-flight", type=int, default=1024)
    parser.add_argument(
        "--max-migrations",
        type=int,
        default=3,
        help="times a request whose decode stream breaks continues on another decode worker",
    )
    parser.add_argument("--worker-id", default=None)
    parser.add_argument("--drain-grace-s", type=float, default=10.0)
    add_metrics_port_arg(parser)
    parser.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    from common.models.default_model import resolve_model

    return GatewayConfig(
        model=resolve_model(args.model),
        redis_url=args.redis_url,
        host=args.host,
        port=args.port,
        model_name=args.model_name,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        local_prefill_tokens=args.local_prefill_tokens,
        overlap_weight=args.overlap_weight,
        max_in_flight=args.max_in_flight,
        max_migrations=args.max_migrations,
        worker_id=args.worker_id,
        drain_grace_s=args.drain_grace_s,
        metrics_port=args.metrics_port,
    )


def run(args: argparse.Namespace) -> int:
    from services.gateway.server import serve

    asyncio.run(serve(config_from_args(args)))
    return 0
