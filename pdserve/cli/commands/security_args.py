"""The transport-security flags every service command takes (mutual TLS on internal hops)."""

from __future__ import annotations

import argparse
import os

from common.rpc.tls import TlsConfig


def add_tls_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "mutual TLS",
        "internal hops: serve TLS only, refuse peers without a certificate from --tls-ca, "
        "and present --tls-cert when calling other pdserve processes (all three or none)",
    )
    group.add_argument(
        "--tls-cert", default=os.environ.get("PDSERVE_TLS_CERT"), help="PEM certificate"
    )
    group.add_argument("--tls-key", default=os.environ.get("PDSERVE_TLS_KEY"), help="PEM key")
    group.add_argument(
        "--tls-ca", default=os.environ.get("PDSERVE_TLS_CA"), help="PEM CA of every peer"
    )


def tls_from_args(args: argparse.Namespace) -> TlsConfig | None:
    return TlsConfig.from_flags(args.tls_cert, args.tls_key, args.tls_ca)
