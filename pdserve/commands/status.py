"""``pdserve status``: every live process of the cluster, from the gateway."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import grpc

from pdserve.client import GatewayClient
from pdserve.common.v1 import common_pb2

ROLE_NAMES = {
    common_pb2.WORKER_ROLE_PREFILL: "prefill",
    common_pb2.WORKER_ROLE_DECODE: "decode",
    common_pb2.WORKER_ROLE_BLOCK_STORE: "blockstore",
    common_pb2.WORKER_ROLE_GATEWAY: "gateway",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("status", help="list the cluster's workers and their load")
    parser.add_argument("--target", default="localhost:50051", help="gateway address")
    parser.add_argument("--json", action="store_true", help="a JSON list, one object per worker")
    parser.set_defaults(func=run)


async def fetch(target: str) -> list[dict[str, object]]:
    client = GatewayClient(target)
    try:
        reply = await client.cluster_status()
    finally:
        await client.close()
    return [
        {
            "id": w.worker_id,
            "role": ROLE_NAMES.get(w.role, "unknown"),
            "address": w.address,
            "model": w.model,
            "kv_blocks_total": w.num_kv_blocks_total,
            "kv_blocks_free": w.num_kv_blocks_free,
            "running": w.num_running_requests,
            "waiting": w.num_waiting_requests,
            "prefix_cache_hit_rate": round(w.prefix_cache_hit_rate, 4),
        }
        for w in reply.workers
    ]


def run(args: argparse.Namespace) -> int:
    try:
        workers = asyncio.run(fetch(args.target))
    except grpc.aio.AioRpcError as exc:
        print(f"pdserve status: {args.target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(workers, indent=2))
        return 0
    header = f"{'id':<14} {'role':<10} {'address':<22} {'kv free/total':>15} {'run':>4} {'wait':>5} {'hit rate':>8}"
    print(header)
    for w in workers:
        blocks = f"{w['kv_blocks_free']}/{w['kv_blocks_total']}" if w["kv_blocks_total"] else "-"
        print(f"{w['id']!s:<14} {w['role']!s:<10} {w['address']!s:<22} {blocks:>15} "
              f"{w['running']!s:>4} {w['waiting']!s:>5} {w['prefix_cache_hit_rate']!s:>8}")  # fmt: skip
    return 0
