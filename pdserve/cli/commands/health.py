"""``pdserve health``: one grpc.health.v1 check of a pdserve process, as an exit status.

For probes that kubelet's own gRPC probe cannot make: a port that serves TLS (mutual TLS
on the internal hops, or the gateway's public TLS). Exit 0 when the process answers
SERVING, 1 when it answers anything else (NOT_SERVING while it drains), 2 when it cannot
be reached or the check fails (refused, timed out, TLS handshake refused).
"""

from __future__ import annotations

import argparse
import sys

from pdserve.cli.commands.security_args import add_tls_args

SERVING, NOT_SERVING, UNREACHABLE = 0, 1, 2


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "health", help="check one process's grpc.health.v1 status (exit 0 = SERVING)"
    )
    parser.add_argument("--target", default="127.0.0.1:50051", help="the process's address")
    parser.add_argument("--service", default="", help="health service name ('' = the server)")
    parser.add_argument("--timeout-s", type=float, default=1.5, help="the check's deadline")
    parser.add_argument(
        "--server-name",
        default=None,
        help="with TLS: the name the server's certificate must hold, when --target is an IP "
        "or another name (a probe in the pod connects to 127.0.0.1)",
    )
    parser.add_argument(
        "--public-tls-ca",
        default=None,
        help="PEM CA of a gateway's public TLS port (server authentication only)",
    )
    add_tls_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pdserve.cli.commands.security_args import tls_from_args

    tls = tls_from_args(args)
    if tls is not None and args.public_tls_ca:
        raise ValueError("give --tls-* (mutual TLS) or --public-tls-ca, not both")
    options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
    if tls is not None:
        channel = grpc.secure_channel(args.target, tls.channel_credentials(), options)
    elif args.public_tls_ca:
        with open(args.public_tls_ca, "rb") as ca:
            credentials = grpc.ssl_channel_credentials(root_certificates=ca.read())
        channel = grpc.secure_channel(args.target, credentials, options)
    else:
        channel = grpc.insecure_channel(args.target)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout_s
            )
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            name = code.name if code is not None else "ERROR"
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            print(f"{args.target}: {name}: {details}", file=sys.stderr)
            return UNREACHABLE
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.target}: {status}")
    return SERVING if reply.status == health_pb2.HealthCheckResponse.SERVING else NOT_SERVING
