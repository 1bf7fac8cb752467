"""The ``pdserve`` command: one subcommand per role or tool."""

from __future__ import annotations

import argparse
import os
import sys

import common.openmp  # noqa: F401  (first: OpenMP's wait policy before any role loads torch)
from common.heap import HeapTrimmer, tune_malloc
from common.telemetry.logs import configure_logging
from pdserve.cli.commands import (
    bench,
    blockstore,
    chat,
    convert,
    experts,
    gateway,
    generate,
    health,
    perplexity,
    planner,
    profile,
    restart,
    role,
    status,
    up,
    worker,
)

COMMANDS = (
    up,
    restart,
    role,
    generate,
    chat,
    status,
    health,
    experts,
    gateway,
    worker,
    planner,
    blockstore,
    convert,
    bench,
    perplexity,
    profile,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Disaggregated prefill/decode LLM serving over gRPC."
    )
    parser.add_argument(
        "--log-level", default=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"), help="logging level"
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    if tune_malloc():  # and, with it, a bound on the freed memory all arenas keep
        trimmer = HeapTrimmer.for_this_process()
        if trimmer is not None:
            trimmer.start()
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"pdserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
