"""``pdserve restart``: a rolling restart of processes of the stack that ``pdserve up`` started."""

from __future__ import annotations

import argparse
import time

from pdserve.cli.launcher import StackState, restart_child, run_dir


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "restart",
        help="restart processes of the local stack one at a time (SIGTERM drains each)",
    )
    parser.add_argument(
        "names", nargs="*", metavar="NAME", help="processes as pdserve up names them (decode-0)"
    )
    parser.add_argument(
        "--workers", action="store_true", help="every prefill and decode worker, in turn"
    )
    parser.add_argument("--timeout-s", type=float, default=600.0, help="start-up limit per process")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    state_path = run_dir() / "stack.json"
    names = list(args.names)
    if args.workers:
        state = StackState.load(state_path)
        if state is None:
            raise FileNotFoundError("no stack is running (nothing recorded by pdserve up)")
        names += [c.name for c in state.children if c.role in ("prefill", "decode")]
    if not names:
        raise ValueError("name the processes to restart, or pass --workers")
    for name in names:
        start = time.monotonic()
        child = restart_child(state_path, name, args.timeout_s)
        print(
            f"  {child.name:<12} {child.address:<22} restarted in {time.monotonic() - start:.1f}s "
            f"(pid {child.pid})",
            flush=True,
        )
    return 0
