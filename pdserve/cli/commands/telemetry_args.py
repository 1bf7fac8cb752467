"""The telemetry flag every service command takes (tracing is configured by OTEL_* only)."""

from __future__ import annotations

import argparse
import os


def add_metrics_port_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ.get("PDSERVE_METRICS_PORT") or 0),
        help="serve Prometheus metrics at http://HOST:PORT/metrics (env PDSERVE_METRICS_PORT); "
        "0 = off",
    )
