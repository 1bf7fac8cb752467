"""``pdserve gateway``: serve the public GatewayService until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import os

from common.rpc.tls import PublicTls
from pdserve.cli.commands.security_args import add_tls_args, tls_from_args
from pdserve.cli.commands.telemetry_args import add_metrics_port_arg
from services.gateway.auth import ApiKeys
from services.gateway.config import GatewayConfig


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("gateway", help="serve the public gateway (GatewayService)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind; [::] for all")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument(
        "--http-port",
        type=int,
        default=8000,
        help="the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics); 0 = a free port; -1 = off",
    )
    parser.add_argument(
        "--kserve-port",
        type=int,
        default=8001,
        help="the KServe v2 / Triton gRPC protocol (inference.GRPCInferenceService, as "
        "tritonclient and perf_analyzer speak it); 0 = a free port; -1 = off",
    )
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
    parser.add_argument(
        "--overlap-weight",
        type=float,
        default=1.0,
        help="prefix-aware: one cached block is worth this much queued load",
    )
    parser.add_argument(
        "--routing-policy",
        choices=("prefix-aware", "load", "round-robin"),
        default="prefix-aware",
        help="prefix-aware (default); load and round-robin ignore the prefix index (baselines)",
    )
    parser.add_argument(
        "--prefill-timeout-s",
        type=float,
        default=60.0,
        help="per-hop limit of a prefill call; past it (or when the worker dies) the prompt "
        "moves to another prefill worker, else to the decode worker; 0 = the client's "
        "deadline only",
    )
    parser.add_argument(
        "--decode-stall-timeout-s",
        type=float,
        default=30.0,
        help="a decode stream silent this long (a hung worker) breaks and the request "
        "migrates to another decode worker; the first token may take --prefill-timeout-s "
        "longer; 0 = the client's deadline only",
    )
    parser.add_argument(
        "--breaker-failures",
        type=int,
        default=3,
        help="consecutive failed calls after which a worker gets no traffic for a cool-down",
    )
    parser.add_argument(
        "--breaker-cooldown-s",
        type=float,
        default=5.0,
        help="how long a failing worker is left alone before one probe call",
    )
    parser.add_argument(
        "--max-migrations",
        type=int,
        default=3,
        help="times a request whose decode stream breaks continues on another decode worker",
    )
    parser.add_argument(
        "--resume-ttl-s",
        type=float,
        default=300.0,
        help="how long after its last message a broken stream can be resumed on any gateway "
        "(its record in Redis lives that long); 0 = no resume records",
    )
    parser.add_argument("--worker-id", default=None)
    parser.add_argument("--drain-grace-s", type=float, default=10.0)
    add_admission_args(parser)
    add_auth_args(parser)
    add_metrics_port_arg(parser)
    add_tls_args(parser)
    parser.set_defaults(func=run)


def add_admission_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "admission", "beyond a bound, RESOURCE_EXHAUSTED at once with a retry delay"
    )
    group.add_argument("--max-in-flight", type=int, default=1024, help="requests in flight")
    group.add_argument(
        "--max-in-flight-per-tenant", type=int, default=0, help="per tenant; 0 = the global one"
    )
    group.add_argument(
        "--max-queued-prompt-tokens",
        type=int,
        default=262_144,
        help="prompt tokens admitted and not yet prefilled",
    )
    group.add_argument(
        "--max-queued-prompt-tokens-per-tenant",
        type=int,
        default=0,
        help="per tenant; 0 = the global one",
    )
    group.add_argument(
        "--max-request-bytes",
        type=int,
        default=4 * 1024 * 1024,
        help="largest request message read (larger: RESOURCE_EXHAUSTED unparsed)",
    )


def add_auth_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "authentication",
        "clients send 'authorization: Bearer KEY'; without keys, authentication is off",
    )
    group.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="an accepted API key, its own tenant (repeatable; env PDSERVE_API_KEYS, "
        "comma-separated)",
    )
    group.add_argument(
        "--api-keys-file",
        default=os.environ.get("PDSERVE_API_KEYS_FILE"),
        help="lines of 'KEY TENANT' (# comments); a tenant's requests share a cache salt",
    )
    group.add_argument(
        "--admin-tenant",
        action="append",
        default=[],
        help="a tenant whose keys may call AdminService (pdserve role); repeatable; with "
        "keys, no other may",
    )
    group.add_argument(
        "--public-tls-cert", default=None, help="PEM certificate: TLS on the public port"
    )
    group.add_argument("--public-tls-key", default=None, help="PEM key of --public-tls-cert")


def api_keys_from_args(args: argparse.Namespace) -> ApiKeys | None:
    from_env = [k for k in os.environ.get("PDSERVE_API_KEYS", "").split(",") if k.strip()]
    return ApiKeys.load([*args.api_key, *from_env], args.api_keys_file)


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
        routing_policy=args.routing_policy,
        max_in_flight=args.max_in_flight,
        prefill_timeout_s=args.prefill_timeout_s,
        decode_stall_timeout_s=args.decode_stall_timeout_s,
        breaker_failure_threshold=args.breaker_failures,
        breaker_cooldown_s=args.breaker_cooldown_s,
        max_in_flight_per_tenant=args.max_in_flight_per_tenant,
        max_queued_prompt_tokens=args.max_queued_prompt_tokens,
        max_queued_prompt_tokens_per_tenant=args.max_queued_prompt_tokens_per_tenant,
        max_request_bytes=args.max_request_bytes,
        api_keys=api_keys_from_args(args),
        admin_tenants=frozenset(args.admin_tenant),
        tls=tls_from_args(args),
        public_tls=PublicTls.from_flags(args.public_tls_cert, args.public_tls_key),
        max_migrations=args.max_migrations,
        resume_ttl_s=args.resume_ttl_s,
        worker_id=args.worker_id,
        drain_grace_s=args.drain_grace_s,
        metrics_port=args.metrics_port,
        http_port=None if args.http_port < 0 else args.http_port,
        kserve_port=None if args.kserve_port < 0 else args.kserve_port,
    )


def run(args: argparse.Namespace) -> int:
    from services.gateway.server import keep_torch_out, serve

    config = config_from_args(args)  # may convert the default model first (that needs torch)
    keep_torch_out()
    asyncio.run(serve(config))
    return 0
