"""``pdserve blockstore``: serve the shared KV tier (BlockStoreService) until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import sys

from pdserve.cli.commands.security_args import add_tls_args, tls_from_args
from pdserve.cli.commands.telemetry_args import add_metrics_port_arg
from services.blockstore.config import DEFAULT_PORT, BlockStoreConfig


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "blockstore", help="serve the shared, content-addressed KV block store"
    )
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind; [::] for all")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 picks a free port")
    parser.add_argument(
        "--capacity",
        default=None,
        help="memory for blocks: bytes (2GiB, 512MB) or a fraction of host memory (0.25); "
        "env PDSERVE_BLOCKSTORE_CAPACITY; default 1GiB",
    )
    parser.add_argument(
        "--redis-url",
        default=None,
        help="Redis for the prefix index and worker registry (env PDSERVE_REDIS_URL); "
        "without it the store serves gRPC only",
    )
    parser.add_argument("--worker-id", default=None, help="default blockstore-<host>-<port>-<pid>")
    parser.add_argument("--advertise", default=None, help="host:port others use; default host:port")
    parser.add_argument(
        "--disk-dir",
        default=None,
        help="a directory for the disk tier: blocks are written behind to it, survive restarts "
        "and are read back when memory no longer holds them (env PDSERVE_BLOCKSTORE_DISK_DIR); "
        "default memory only",
    )
    parser.add_argument(
        "--disk-capacity",
        default=None,
        help="bound on the disk tier's files: bytes (20GiB) or a fraction of the file system "
        "(env PDSERVE_BLOCKSTORE_DISK_CAPACITY); default 0.5",
    )
    parser.add_argument(
        "--put-expiry-s", type=float, default=None, help="abort puts left open this long (30)"
    )
    add_metrics_port_arg(parser)
    add_tls_args(parser)


def config_from_args(args: argparse.Namespace) -> BlockStoreConfig:
    return BlockStoreConfig.from_env(
        capacity=args.capacity,
        disk_capacity=args.disk_capacity,
        disk_dir=args.disk_dir,
        host=args.host,
        port=args.port,
        redis_url=args.redis_url,
        worker_id=args.worker_id,
        advertise=args.advertise,
        put_expiry_s=args.put_expiry_s,
        metrics_port=args.metrics_port,
        tls=tls_from_args(args),
    )


def run(args: argparse.Namespace) -> int:
    from services.blockstore.server import serve

    try:
        asyncio.run(serve(config_from_args(args)))
    except OSError as exc:  # the port is taken, Redis is unreachable
        print(f"pdserve blockstore: error: {exc}", file=sys.stderr)
        return 2
    return 0
