"""``pdserve role WORKER_ID prefill|decode|both``: change an engine worker's role in place,
through the gateway (AdminService.SetWorkerRole)."""

from __future__ import annotations

import argparse
import asyncio
import sys

import grpc

from common.planner.types import ENGINE_ROLES
from common.rpc.roles import ROLE_OF_PB
from pdserve.client import add_client_args, client_from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "role", help="change an engine worker's role in place (prefill, decode, both)"
    )
    parser.add_argument("worker_id", help="the worker, as pdserve status lists it")
    # Not choices=: an unknown role goes to the gateway, whose INVALID_ARGUMENT names the
    # roles (the same answer a client in another language gets).
    parser.add_argument("role", help=f"one of {', '.join(ENGINE_ROLES)}")
    parser.add_argument("--timeout-s", type=float, default=60.0)
    add_client_args(parser)
    parser.set_defaults(func=run)


async def _set(args: argparse.Namespace) -> int:
    client = client_from_args(args)
    try:
        reply = await client.set_worker_role(args.worker_id, args.role, args.timeout_s)
    except grpc.aio.AioRpcError as exc:
        print(f"pdserve role: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    finally:
        await client.close()
    previous, role = ROLE_OF_PB[reply.previous_role], ROLE_OF_PB[reply.role]
    moved = f", {reply.num_streams_moved} decode streams moved on" if reply.num_streams_moved else ""
    print(f"{reply.worker_id}: {previous} -> {role} in {reply.elapsed_ms:.0f} ms{moved}")
    return 0


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_set(args))
