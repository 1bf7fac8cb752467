"""``pdserve up`` starts the whole stack on this machine; ``pdserve down`` stops it."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from pdserve.launcher import (
    Child,
    StackState,
    free_port,
    run_dir,
    spawn,
    start_redis,
    stop_children,
    wait_redis,
    wait_serving,
)

# Engine flags forwarded to every worker as given.
_ENGINE_FLAGS = (
    "dtype", "device", "kv_cache_memory", "num_kv_blocks", "max_num_seqs",
    "max_num_batched_tokens", "max_model_len", "attention_backend", "block_size",
)  # fmt: skip


def register(subparsers: argparse._SubParsersAction) -> None:
    up = subparsers.add_parser("up", help="start redis, block store, workers and gateway here")
    up.add_argument("--port", type=int, default=50051, help="gateway port")
    up.add_argument("--prefill", type=int, default=1, help="prefill workers")
    up.add_argument("--decode", type=int, default=1, help="decode workers")
    up.add_argument("--redis-url", default=None, help="use this Redis instead of a private one")
    up.add_argument("--no-blockstore", action="store_true", help="run without the block store")
    up.add_argument("--model", default=None)
    up.add_argument("--detach", action="store_true", help="return once SERVING; stop with down")
    up.add_argument("--timeout-s", type=float, default=600.0, help="start-up limit per process")
    up.add_argument("--local-prefill-tokens", type=int, default=None)
    up.add_argument(
        "--drain-grace-s",
        type=float,
        default=None,
        help="on SIGTERM, how long workers and the gateway let requests finish",
    )
    up.add_argument("--dtype", default=None)
    up.add_argument("--device", default=None)
    up.add_argument("--kv-cache-memory", default="512MiB", help="KV budget per worker")
    up.add_argument("--num-kv-blocks", type=int, default=None)
    up.add_argument("--max-num-seqs", type=int, default=None)
    up.add_argument("--max-num-batched-tokens", type=int, default=None)
    up.add_argument("--max-model-len", type=int, default=None)
    up.add_argument("--block-size", type=int, default=None)
    up.add_argument("--attention-backend", default=None)
    up.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="Prometheus endpoints: the gateway's at this port, every other process's at the "
        "next ones in start order; 0 = off; default: free ports (pdserve status reads them)",
    )
    up.set_defaults(func=run_up)

    down = subparsers.add_parser("down", help="stop the stack started by pdserve up")
    down.set_defaults(func=run_down)


def _engine_flags(args: argparse.Namespace) -> list[str]:
    flags: list[str] = []
    for name in _ENGINE_FLAGS:
        value = getattr(args, name)
        if value is not None:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


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
    yield from range(args.metrics_port + 1, args.metrics_port + 1 + num_others)
    yield args.metrics_port


def run_up(args: argparse.Namespace) -> int:
    from common.models.default_model import resolve_model

    state_path = run_dir() / "stack.json"
    previous = StackState.load(state_path)
    if previous is not None and previous.alive():
        print(f"a stack is already running (gateway {previous.gateway}); run `pdserve down` first",
              file=sys.stderr)  # fmt: skip
        return 1
    model = resolve_model(args.model)  # converts the default model once, before any worker
    logs = run_dir() / "logs"
    python = [sys.executable, "-m", "pdserve", "--log-level", "INFO"]
    state = StackState(started_unix_s=time.time())
    processes: dict[str, subprocess.Popen[bytes] | None] = {}

    metrics_ports = _metrics_ports(args)

    def launch(name: str, role: str, argv: list[str], address: str) -> Child:
        metrics_port = next(metrics_ports)
        argv = [*argv, "--metrics-port", str(metrics_port)]
        child, process = spawn(name, role, argv, address, logs, metrics_port)
        state.children.append(child)
        processes[name] = process
        state.save(state_path)
        return child

    try:
        if args.redis_url:
            state.redis_url = args.redis_url
        else:
            redis_port = free_port()
            child, process = start_redis(redis_port, logs)
            state.children.append(child)
            processes[child.name] = process
            wait_redis(redis_port, 30)
            state.redis_url = f"redis://127.0.0.1:{redis_port}/0"
        common = ["--redis-url", state.redis_url]
        grace = [] if args.drain_grace_s is None else ["--drain-grace-s", str(args.drain_grace_s)]
        workers: list[Child] = []
        store_flags: list[str] = []
        if not args.no_blockstore:
            port = free_port()
            workers.append(launch("blockstore", "blockstore",
                                  [*python, "blockstore", "--port", str(port), "--worker-id", "blockstore-0", *common],
                                  f"127.0.0.1:{port}"))  # fmt: skip
            store_flags = ["--blockstore", f"127.0.0.1:{port}"]
        for role, count in (("prefill", args.prefill), ("decode", args.decode)):
            for i in range(count):
                port = free_port()
                argv = [*python, role, "--port", str(port), "--model", model,
                        "--worker-id", f"{role}-{i}", *common, *store_flags, *grace,
                        *_engine_flags(args)]  # fmt: skip
                workers.append(launch(f"{role}-{i}", role, argv, f"127.0.0.1:{port}"))
        gateway_argv = [*python, "gateway", "--port", str(args.port), "--model", model,
                        "--worker-id", "gateway-0", *common, *grace]  # fmt: skip
        if args.local_prefill_tokens is not None:
            gateway_argv += ["--local-prefill-tokens", str(args.local_prefill_tokens)]
        if args.block_size is not None:
            gateway_argv += ["--block-size", str(args.block_size)]
        gateway = launch("gateway", "gateway", gateway_argv, f"127.0.0.1:{args.port}")
        state.gateway = gateway.address
        state.save(state_path)
        for child in [*workers, gateway]:
            wait_serving(child.address, processes.get(child.name), child, args.timeout_s)
            metrics = f", metrics {child.metrics_url}" if child.metrics_url else ""
            print(f"  {child.name:<12} {child.address:<22} SERVING (pid {child.pid}{metrics})",
                  flush=True)  # fmt: skip
    except BaseException as exc:
        print(f"pdserve up: {exc}; stopping what started", file=sys.stderr)
        stop_children(state.children)
        state_path.unlink(missing_ok=True)
        return 1

    print(
        f"pdserve stack up: gateway {state.gateway}, redis {state.redis_url}, logs {logs}",
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
