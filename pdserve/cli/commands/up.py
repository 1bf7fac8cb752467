"""``pdserve up`` starts the whole stack on this machine; ``pdserve down`` stops it."""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

from common.models.quant.formats import QUANT_KERNELS, QUANTIZATIONS
from common.rpc.tls import TlsConfig
from pdserve.cli.commands.planner import add_planner_args, targets_from_args
from pdserve.cli.engine_args import (
    KV_DTYPE_CHOICES,
    add_compression_args,
    add_eviction_args,
    speculative_config_arg,
)
from pdserve.cli.launcher import (
    Child,
    RedisSecurity,
    StackState,
    free_port,
    redact,
    redis_url,
    run_dir,
    spawn,
    start_redis,
    stop_children,
    wait_redis,
    wait_serving,
)

Env = dict[str, str] | None


class Pki:
    """The stack's private CA (made on first use) and one certificate per process."""

    def __init__(self, directory: Path) -> None:
        from common.rpc.pki import make_ca

        self.directory = directory
        self.ca = make_ca(directory)
        self._launcher: TlsConfig | None = None

    def issue(self, name: str) -> TlsConfig:
        return self.ca.issue(name, self.directory)

    def client_credentials(self) -> grpc.ChannelCredentials:
        """This launcher's own identity, for its health checks of the workers."""
        if self._launcher is None:
            self._launcher = self.issue("launcher")
        return self._launcher.channel_credentials()


# Engine flags forwarded to every worker as given.
_ENGINE_FLAGS = (
    "dtype", "device", "kv_cache_memory", "num_kv_blocks", "max_num_seqs",
    "max_num_batched_tokens", "max_model_len", "attention_backend", "prefill_attention",
    "block_size", "kv_dtype",
    "kv_prefault",
    "quantization", "quant_group_size", "quant_kernel", "quant_act_bits",
    "kv_compression", "snapkv_budget_tokens", "snapkv_window_tokens",
)  # fmt: skip
# Gateway flags forwarded as given.
_GATEWAY_FLAGS = (
    "local_prefill_tokens", "block_size", "max_in_flight", "max_in_flight_per_tenant",
    "max_queued_prompt_tokens", "max_queued_prompt_tokens_per_tenant", "api_keys_file",
    "resume_ttl_s",
)  # fmt: skip


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    up = subparsers.add_parser("up", help="start redis, block store, workers and gateway here")
    up.add_argument("--port", type=int, default=50051, help="gateway port")
    up.add_argument(
        "--gateways",
        type=_at_least_one,
        default=1,
        help="gateways to start, each on the next port after the one before (--port, and the "
        "HTTP and KServe ports when given): a client of several survives one's loss",
    )
    up.add_argument(
        "--http-port",
        type=int,
        default=8000,
        help="the gateway's OpenAI-compatible HTTP API; 0 = a free port; -1 = off",
    )
    up.add_argument(
        "--kserve-port",
        type=int,
        default=8001,
        help="the gateway's KServe v2 / Triton gRPC port; 0 = a free port; -1 = off",
    )
    up.add_argument(
        "--prefill",
        type=int,
        default=None,
        help="prefill workers; default 1, or 0 on a machine of 2 cores or fewer, where the "
        "decode worker prefills locally (it served more than a 1 + 1 split there: issue 13's "
        "note)",
    )
    up.add_argument("--decode", type=int, default=1, help="decode workers")
    up.add_argument(
        "--redis-url",
        default=None,
        help="use this Redis instead of a private one (redis://:PASSWORD@host:port/db; "
        "rediss:// for TLS)",
    )
    up.add_argument(
        "--redis-password",
        default=os.environ.get("PDSERVE_REDIS_PASSWORD"),
        help="start the private redis-server with this requirepass (env "
        "PDSERVE_REDIS_PASSWORD); with --mtls a random one by default",
    )
    up.add_argument(
        "--mtls",
        action="store_true",
        help="mutual TLS on every internal hop: a private CA and a certificate per process in "
        "the run directory's tls/; workers and the block store refuse peers without one; "
        "the private Redis serves TLS only, with a password",
    )
    up.add_argument(
        "--public-tls",
        action="store_true",
        help="TLS on the gateway's public port too, with a certificate from the stack's CA "
        "(clients pass --tls-ca RUN_DIR/tls/ca.pem)",
    )
    up.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="the gateway accepts this API key (repeatable; each its own tenant)",
    )
    up.add_argument("--api-keys-file", default=None, help="the gateway's 'KEY TENANT' lines")
    up.add_argument("--max-in-flight", type=int, default=None, help="gateway admission bound")
    up.add_argument("--resume-ttl-s", type=float, default=None,
                    help="gateways: how long a broken stream can be resumed (see pdserve gateway)")  # fmt: skip
    up.add_argument("--max-in-flight-per-tenant", type=int, default=None)
    up.add_argument("--max-queued-prompt-tokens", type=int, default=None)
    up.add_argument("--max-queued-prompt-tokens-per-tenant", type=int, default=None)
    up.add_argument("--no-blockstore", action="store_true", help="run without the block store")
    up.add_argument("--blockstore-capacity", default=None, help="the block store's memory (1GiB)")
    up.add_argument(
        "--blockstore-disk-dir",
        default=None,
        help="the block store's disk tier (see pdserve blockstore --disk-dir): its blocks "
        "survive a restart of the stack",
    )
    up.add_argument("--blockstore-disk-capacity", default=None, help="bound on the disk tier")
    up.add_argument("--model", default=None)
    up.add_argument("--detach", action="store_true", help="return once SERVING; stop with down")
    up.add_argument("--timeout-s", type=float, default=600.0, help="start-up limit per process")
    up.add_argument("--local-prefill-tokens", type=int, default=None)
    failures = up.add_argument_group("failure handling (see pdserve gateway|decode --help)")
    failures.add_argument("--prefill-timeout-s", type=float, default=None, help="gateway")
    failures.add_argument("--decode-stall-timeout-s", type=float, default=None, help="gateway")
    failures.add_argument("--breaker-failures", type=int, default=None, help="gateway")
    failures.add_argument("--breaker-cooldown-s", type=float, default=None, help="gateway")
    failures.add_argument(
        "--kv-load-failure", choices=["recompute", "fail"], default=None, help="decode workers"
    )
    failures.add_argument("--kv-pull-timeout-s", type=float, default=None, help="decode workers")
    failures.add_argument("--blockstore-timeout-s", type=float, default=None, help="workers")
    failures.add_argument("--lease-ttl-s", type=float, default=None, help="workers")
    failures.add_argument(
        "--blockstore-put-expiry-s",
        type=float,
        default=None,
        help="block store: abort a put its writer left open this long (a killed worker's)",
    )
    up.add_argument(
        "--drain-grace-s",
        type=float,
        default=None,
        help="on SIGTERM, how long workers and the gateway let requests finish",
    )
    moe = up.add_argument_group("expert load (MoE models; see pdserve prefill --help)")
    moe.add_argument("--expert-load-interval-s", type=float, default=None, help="workers")
    moe.add_argument("--expert-load-window-s", type=float, default=None, help="workers")
    moe.add_argument("--expert-load-windows", type=int, default=None, help="workers")
    up.add_argument("--dtype", default=None)
    up.add_argument("--device", default=None)
    up.add_argument("--kv-cache-memory", default="512MiB", help="KV budget per worker")
    up.add_argument(
        "--threads-per-worker",
        type=int,
        default=None,
        help="CPU threads of each prefill and decode worker; default: this machine's cores "
        "shared out among the workers of each role (at least 1 each); 0 = torch's default",
    )
    up.add_argument("--num-kv-blocks", type=int, default=None)
    up.add_argument("--max-num-seqs", type=int, default=None)
    up.add_argument("--max-num-batched-tokens", type=int, default=None)
    up.add_argument("--max-model-len", type=int, default=None)
    up.add_argument("--block-size", type=int, default=None)
    up.add_argument("--attention-backend", default=None)
    up.add_argument("--prefill-attention", default=None, choices=["auto", "kernel", "sdpa"],
                    help="every engine worker's (see pdserve decode --help)")  # fmt: skip
    up.add_argument(
        "--kv-dtype",
        default=None,
        choices=KV_DTYPE_CHOICES,
        help="every worker's KV cache (see pdserve decode --help); int8 / fp8 blocks move "
        "between workers and through the block store with their scales",
    )
    up.add_argument(
        "--kv-prefault",
        action="store_true",
        default=None,
        help="every worker writes its KV pool at start (see pdserve worker --help)",
    )
    quant = up.add_argument_group("weight format (see pdserve prefill --help)")
    quant.add_argument("--quantization", default=None, choices=list(QUANTIZATIONS))
    quant.add_argument("--quant-group-size", type=int, default=None)
    quant.add_argument("--quant-kernel", default=None, choices=list(QUANT_KERNELS))
    quant.add_argument("--quant-act-bits", type=int, default=None, choices=[16, 8])
    up.add_argument(
        "--speculative-config",
        type=speculative_config_arg,
        default=None,
        help="decode workers speculate (see pdserve decode --help)",
    )
    add_eviction_args(up.add_argument_group("StreamingLLM on decode workers (pdserve decode)"))
    add_compression_args(up.add_argument_group("SnapKV on every engine worker"))
    up.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="Prometheus endpoints: the gateway's at this port, every other process's at the "
        "next ones in start order; 0 = off; default: free ports (pdserve status reads them)",
    )
    planner = up.add_argument_group(
        "planner: sets the prefill:decode split from live load (see pdserve planner --help)"
    )
    planner.add_argument(
        "--planner", action="store_true",
        help="start a planner that changes the workers' roles (and, up to --max-workers, "
        "starts and stops workers) to meet --ttft-ms and --itl-ms",
    )  # fmt: skip
    add_planner_args(planner)
    up.set_defaults(func=run_up)

    down = subparsers.add_parser("down", help="stop the stack started by pdserve up")
    down.set_defaults(func=run_down)


def _engine_flags(args: argparse.Namespace, names: tuple[str, ...] = _ENGINE_FLAGS) -> list[str]:
    flags: list[str] = []
    for name in names:
        value = getattr(args, name)
        if value is True:  # a switch
            flags.append(f"--{name.replace('_', '-')}")
        elif value is not None and value is not False:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


_PLANNER_FLAGS = ("ttft_ms", "itl_ms", "interval_s", "dwell_s", "min_workers", "max_workers")


def _planner_flags(args: argparse.Namespace) -> list[str]:
    targets_from_args(args)  # both targets given, or a clear error before anything starts
    return _engine_flags(args, _PLANNER_FLAGS)


def _store_flags(args: argparse.Namespace) -> list[str]:
    flags: list[str] = []
    for flag, value in (
        ("--put-expiry-s", args.blockstore_put_expiry_s),
        ("--capacity", args.blockstore_capacity),
        ("--disk-dir", args.blockstore_disk_dir and os.path.abspath(args.blockstore_disk_dir)),
        ("--disk-capacity", args.blockstore_disk_capacity),
    ):
        if value is not None:
            flags += [flag, str(value)]
    return flags


# Failure handling: gateway, every worker, and what decoding takes (every worker: roles change).
_FAILOVER_FLAGS = (
    "prefill_timeout_s", "decode_stall_timeout_s", "breaker_failures", "breaker_cooldown_s",
    "drain_grace_s",
)  # fmt: skip
_WORKER_FLAGS = (
    "blockstore_timeout_s", "lease_ttl_s", "drain_grace_s",
    "expert_load_interval_s", "expert_load_window_s", "expert_load_windows",
)  # fmt: skip
_DECODE_FLAGS = ("kv_load_failure", "kv_pull_timeout_s", "speculative_config", "kv_eviction",
                 "sink_tokens", "window_tokens")  # fmt: skip


# At most this many usable cores, ``pdserve up`` starts no prefill worker unless told: on 2
# cores a decode worker that prefills locally on both served more than a 1 + 1 split
# (loadtest/bench_llamacpp.py --topology default,decode-only, two runs: output tok/s at
# concurrency 16 2.59x against 2.21x of llama-server's, at concurrency 1 1.52x against
# 1.47x), and held half the memory.
LOCAL_PREFILL_MAX_CORES = 2


def usable_cores() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, cores or 1)


def num_prefill_workers(args: argparse.Namespace) -> int:
    """``--prefill``, or its default for this machine (LOCAL_PREFILL_MAX_CORES)."""
    if args.prefill is not None:
        return int(args.prefill)
    return 0 if usable_cores() <= LOCAL_PREFILL_MAX_CORES else 1


def threads_per_worker(args: argparse.Namespace) -> int | None:
    """Each worker's CPU threads, unless given (0 = leave it to torch, which takes every core
    in each): the cores this process may use, shared out among the workers of one role.
    The roles overlap rather than add up: while a prefill worker computes a prompt the
    decode worker mostly waits for it, and the decode worker's steps leave the prefill
    worker idle, so on 2 cores a 1 + 1 stack that gave each worker one core left a core
    idle in every step (measured against llama-server at concurrency 16: 0.97x with one
    thread each, 1.33x with two; issue 13's note). The C++ kernels' pool does not wait
    for a thread the OS has descheduled, so the rare overlap costs little."""
    if args.threads_per_worker is not None:
        return args.threads_per_worker or None
    return max(1, usable_cores() // max(1, num_prefill_workers(args), args.decode))


def gateway_ports(args: argparse.Namespace, i: int) -> tuple[int, int, int]:
    """Gateway i's gRPC, HTTP and KServe ports (-1: off; 0 given: a free port each). The
    gRPC ports follow --port; the HTTP and KServe ports follow theirs, two apart when the two
    are neighbours (the defaults, 8000 and 8001), so gateway 1 takes 8002 and 8003."""
    http, kserve = args.http_port, args.kserve_port
    stride = 2 if http > 0 and kserve > 0 and abs(http - kserve) == 1 else 1

    def nth(base: int) -> int:
        if base < 0:
            return -1
        return base + stride * i if base else free_port()

    return args.port + i, nth(http), nth(kserve)


def _metrics_ports(args: argparse.Namespace) -> Iterator[int]:
    """The metrics port of each process in start order (all 0 when off). With a base port
    the gateway, started last, takes the base and the others the ports after it."""
    if args.metrics_port is None:
        while True:
            yield free_port()
    if args.metrics_port == 0:
        while True:
            yield 0
    num_others = args.prefill + args.decode + (0 if args.no_blockstore else 1)
    num_others += bool(getattr(args, "planner", False))
    gateways = getattr(args, "gateways", 1)
    first_other = args.metrics_port + gateways
    yield from range(first_other, first_other + num_others)
    yield from range(args.metrics_port, args.metrics_port + gateways)


def run_up(args: argparse.Namespace) -> int:
    from common.models.default_model import resolve_model

    state_path = run_dir() / "stack.json"
    previous = StackState.load(state_path)
    if previous is not None and previous.alive():
        print(f"a stack is already running (gateway {previous.gateway}); run `pdserve down` first",
              file=sys.stderr)  # fmt: skip
        return 1
    args.prefill = num_prefill_workers(args)
    if args.planner:
        _planner_flags(args)
    model = resolve_model(args.model)  # converts the default model once, before any worker
    logs = run_dir() / "logs"
    python = [sys.executable, "-m", "pdserve", "--log-level", "INFO"]
    state = StackState(started_unix_s=time.time())
    processes: dict[str, subprocess.Popen[bytes] | None] = {}

    metrics_ports = _metrics_ports(args)
    pki = Pki(run_dir() / "tls") if args.mtls else None
    redis_security = RedisSecurity()
    redis_port = 0

    def launch(name: str, role: str, argv: list[str], address: str, env: Env = None) -> Child:
        """Under --mtls each process gets its own certificate, for gRPC and Redis alike;
        the Redis URL travels in the environment, so its password stays out of ps."""
        metrics_port = next(metrics_ports)
        argv = [*argv, "--metrics-port", str(metrics_port)]
        env = dict(env or {})
        tls = pki.issue(name) if args.mtls and pki is not None else None
        if tls is not None:
            argv += [
                "--tls-cert",
                str(tls.cert),
                "--tls-key",
                str(tls.key),
                "--tls-ca",
                str(tls.ca),
            ]
        env["PDSERVE_REDIS_URL"] = (
            redis_url(redis_port, redis_security, tls) if redis_port else state.redis_url
        )
        child, process = spawn(name, role, argv, address, logs, metrics_port, env)
        state.children.append(child)
        processes[name] = process
        state.save(state_path)
        return child

    try:
        if args.redis_url:
            state.redis_url = args.redis_url
        else:
            password = args.redis_password or (secrets.token_urlsafe(24) if args.mtls else None)
            redis_tls = pki.issue("redis") if pki is not None else None
            redis_security = RedisSecurity(password, redis_tls)
            redis_port = free_port()
            child, process = start_redis(redis_port, logs, redis_security)
            state.children.append(child)
            processes[child.name] = process
            state.redis_url = redis_url(redis_port, redis_security)
            wait_redis(state.redis_url, 30)
        workers: list[Child] = []
        store_flags: list[str] = []
        if not args.no_blockstore:
            port = free_port()
            workers.append(launch("blockstore", "blockstore",
                                  [*python, "blockstore", "--port", str(port), "--worker-id", "blockstore-0",
                                   *_store_flags(args)],
                                  f"127.0.0.1:{port}"))  # fmt: skip
            store_flags = ["--blockstore", f"127.0.0.1:{port}"]
        threads = threads_per_worker(args)
        thread_flags = ["--threads", str(threads)] if threads else []
        for role, count in (("prefill", args.prefill), ("decode", args.decode)):
            for i in range(count):
                port = free_port()
                # Every worker takes the decoding flags: its role may change to decode.
                argv = [*python, role, "--port", str(port), "--model", model,
                        "--worker-id", f"{role}-{i}", *store_flags, *_engine_flags(args),
                        *_engine_flags(args, _WORKER_FLAGS), *_engine_flags(args, _DECODE_FLAGS),
                        *thread_flags]  # fmt: skip
                workers.append(launch(f"{role}-{i}", role, argv, f"127.0.0.1:{port}"))
        public_ca: grpc.ChannelCredentials | None = None
        public: TlsConfig | None = None
        if args.public_tls:
            if pki is None:
                pki = Pki(run_dir() / "tls")
            public = pki.issue("gateway-public")
            public_ca = grpc.ssl_channel_credentials(public.ca.read_bytes())
        keys = {"PDSERVE_API_KEYS": ",".join(args.api_key)} if args.api_key else {}
        gateways: list[Child] = []
        for i in range(args.gateways):
            # The first is "gateway" (its log, `pdserve restart gateway`); the next ones
            # take the ports after the first's.
            name = "gateway" if i == 0 else f"gateway-{i}"
            port, http_port, kserve_port = gateway_ports(args, i)
            gateway_argv = [*python, "gateway", "--port", str(port), "--model", model,
                            "--worker-id", f"gateway-{i}", *_engine_flags(args, _GATEWAY_FLAGS),
                            *_engine_flags(args, _FAILOVER_FLAGS)]  # fmt: skip
            if public is not None:
                gateway_argv += ["--public-tls-cert", str(public.cert),
                                 "--public-tls-key", str(public.key)]  # fmt: skip
            endpoints = {"grpc": f"127.0.0.1:{port}", "http": "", "kserve": ""}
            if http_port >= 0:
                gateway_argv += ["--http-port", str(http_port)]
                scheme = "https" if args.public_tls else "http"
                endpoints["http"] = f"{scheme}://127.0.0.1:{http_port}/v1"
            else:
                gateway_argv += ["--http-port", "-1"]
            gateway_argv += ["--kserve-port", str(kserve_port)]
            if kserve_port >= 0:
                endpoints["kserve"] = f"127.0.0.1:{kserve_port}"
            gateways.append(launch(name, "gateway", gateway_argv, endpoints["grpc"], keys))
            state.gateway_endpoints.append(endpoints)
        gateway = gateways[0]
        state.gateway = gateway.address
        state.http = state.gateway_endpoints[0]["http"]
        state.kserve = state.gateway_endpoints[0]["kserve"]
        state.save(state_path)
        if args.planner:
            port = free_port()
            planner_argv = [*python, "planner", "--port", str(port), "--model", model,
                            "--connector", "local", "--stack-state", str(state_path),
                            *_planner_flags(args)]  # fmt: skip
            workers.append(launch("planner", "planner", planner_argv, f"127.0.0.1:{port}"))
        internal = pki.client_credentials() if args.mtls and pki is not None else None
        for child in [*workers, *gateways]:
            credentials = public_ca if child in gateways else internal
            wait_serving(
                child.address, processes.get(child.name), child, args.timeout_s, credentials
            )
            metrics = f", metrics {child.metrics_url}" if child.metrics_url else ""
            print(f"  {child.name:<12} {child.address:<22} SERVING (pid {child.pid}{metrics})",
                  flush=True)  # fmt: skip
    except BaseException as exc:
        print(f"pdserve up: {exc}; stopping what started", file=sys.stderr)
        stop_children(state.children)
        state_path.unlink(missing_ok=True)
        return 1

    security = ", mutual TLS inside" if args.mtls else ""
    http = f", OpenAI API {state.http}" if state.http else ""
    if state.kserve:
        http += f", KServe v2 gRPC {state.kserve}"
    if len(state.gateway_endpoints) > 1:
        others = ", ".join(e["grpc"] for e in state.gateway_endpoints[1:])
        http += f"; more gateways {others} (each with its HTTP and KServe ports)"
    print(
        f"pdserve stack up: gateway {state.gateway}{http}, redis {redact(state.redis_url)}, "
        f"logs {logs}{security}",
        flush=True,
    )
    if args.detach:
        return 0
    return _foreground(state, state_path)


def _foreground(state: StackState, state_path: Path) -> int:
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print("serving; Ctrl-C stops the stack", flush=True)
    while not stopping:
        # Re-read: a planner starts and stops workers (a worker it stopped is no longer listed).
        state = StackState.load(state_path) or state
        dead = [c for c in state.children if c not in state.alive()]
        if dead:
            print(
                f"pdserve up: {', '.join(c.name for c in dead)} exited; stopping", file=sys.stderr
            )
            break
        time.sleep(0.5)
    stop_children(state.children)
    state_path.unlink(missing_ok=True)
    return 0


def run_down(args: argparse.Namespace) -> int:
    state_path = run_dir() / "stack.json"
    state = StackState.load(state_path)
    if state is None:
        print("no stack is running (nothing recorded by pdserve up)", file=sys.stderr)
        return 0
    stop_children(state.children)
    state_path.unlink(missing_ok=True)
    print(f"stopped {len(state.children)} processes", flush=True)
    return 0
