"""Service overhead and KV transfer speed, measured in one run on this machine.

1. TTFT and TPOT (p50, p99) of the same workload through the whole stack (gateway ->
   prefill -> KV pull -> decode, every hop a gRPC call between processes) and through the
   in-process engine, at concurrency 1 and 16 (closed loop). The ratio is the service
   overhead.
2. KV transfer: GB/s of a KvTransferService.PullBlocks stream (chunks of up to 4 MiB with
   CRC-32C, reassembled and checked) against a raw loopback TCP socket moving the same bytes,
   and against the same stream between processes without pdserve's malloc tuning
   (common/heap.py).

    .venv/bin/python loadtest/bench_stack.py [--target HOST:PORT] [--model PATH]

Without --target it starts its own stack (1 prefill, 1 decode) with ``pdserve up``.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import common.openmp  # noqa: F401  (before torch, run as a script too: OpenMP's wait policy)

# isort: split
import torch


@dataclass
class Sample:
    ttft_ms: float
    tpot_ms: float


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summary(samples: list[Sample]) -> dict[str, float]:
    ttft = [s.ttft_ms for s in samples]
    tpot = [s.tpot_ms for s in samples]
    return {
        "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
        "tpot_p50": percentile(tpot, 50), "tpot_p99": percentile(tpot, 99),
    }  # fmt: skip


def workload(num: int, vocab: int, seed: int, prompt_len: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(prompt_len)] for _ in range(num)]


# -- through the stack -------------------------------------------------------------------------


async def stack_run(
    target: str, prompts: list[list[int]], max_tokens: int, concurrency: int
) -> list[Sample]:
    from common.contract.sampling import SamplingParams
    from pdserve.client import GatewayClient

    client = GatewayClient(target)
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    samples: list[Sample] = []
    queue = list(prompts)

    async def worker() -> None:
        while queue:
            prompt = queue.pop()
            start = time.perf_counter()
            first = last = None
            n = 0
            async for message in client.stream(token_ids=prompt, sampling=sampling):
                if message.token_ids:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    n += len(message.token_ids)
            assert first is not None and last is not None and n == max_tokens
            samples.append(Sample((first - start) * 1000, (last - first) * 1000 / max(1, n - 1)))

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await client.close()
    return samples


# -- in process ---------------------------------------------------------------------------------


def engine_run(
    engine: object, prompts: list[list[int]], max_tokens: int, concurrency: int
) -> list[Sample]:
    from common.contract.sampling import SamplingParams
    from common.engine.engine import Engine

    assert isinstance(engine, Engine)
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    queue = list(prompts)
    started: dict[str, float] = {}
    first: dict[str, float] = {}
    samples: list[Sample] = []
    counter = 0

    def admit() -> None:
        nonlocal counter
        while queue and len(started) - len(samples) < concurrency:
            rid = f"bench-{counter}"
            counter += 1
            engine.add_request(rid, queue.pop(), sampling)
            started[rid] = time.perf_counter()

    admit()
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                t0, t1 = started[out.request_id], first[out.request_id]
                samples.append(Sample((t1 - t0) * 1000, (now - t1) * 1000 / max(1, max_tokens - 1)))
        admit()
    return samples


# -- KV transfer --------------------------------------------------------------------------------


def _serve_kv(num_blocks: int, port_queue: mp.Queue, tuned: bool = True) -> None:
    if tuned:  # as every pdserve process does at start (pdserve/cli/main.py)
        from common.heap import tune_malloc

        tune_malloc()
    from common.kv.layout import KvLayout
    from common.kv.leases import LeaseTable
    from common.kv.transfer import KvTransferServicer
    from common.rpc.server import create_server
    from pdserve.kv.v1 import kv_transfer_pb2_grpc

    async def main() -> None:
        layout = KvLayout(30, 3, 64, 16, torch.float32)  # SmolLM2-135M
        data = torch.randn(num_blocks, *layout.block_shape)

        async def nothing(request_id: str) -> None:
            return None

        leases = LeaseTable(3600, nothing)
        lease = await leases.create("bench", num_blocks * 16, list(range(1, num_blocks + 1)), data)
        assert lease is not None
        server = await create_server(
            "127.0.0.1:0",
            lambda s: kv_transfer_pb2_grpc.add_KvTransferServiceServicer_to_server(
                KvTransferServicer(leases, layout), s
            ),
            ["pdserve.kv.v1.KvTransferService"],
        )
        port_queue.put((server.port, lease.lease_id))
        await server.grpc.wait_for_termination()

    asyncio.run(main())


def _serve_tcp(num_bytes: int, port_queue: mp.Queue) -> None:
    payload = os.urandom(num_bytes)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port_queue.put(listener.getsockname()[1])
        while True:
            conn, _ = listener.accept()
            with conn:
                conn.recv(1)
                conn.sendall(payload)


async def grpc_pull_gbps(
    port: int, lease_id: str, num_blocks: int, repeats: int
) -> tuple[float, int]:
    from common.kv.layout import KvLayout
    from common.kv.pull import pull_kv
    from common.rpc.channels import create_channel
    from pdserve.common.v1 import common_pb2

    layout = KvLayout(30, 3, 64, 16, torch.float32)
    channel = create_channel(f"127.0.0.1:{port}")
    handle = common_pb2.KvHandle(request_id="bench", lease_id=lease_id, num_tokens=num_blocks * 16)
    await pull_kv(channel, handle, layout, 60)  # warm-up
    start = time.perf_counter()
    total = 0
    for _ in range(repeats):
        total += (await pull_kv(channel, handle, layout, 60)).num_bytes
    elapsed = time.perf_counter() - start
    await channel.close()
    return total / elapsed / 1e9, total // repeats


def tcp_gbps(port: int, num_bytes: int, repeats: int) -> float:
    buffer = bytearray(num_bytes)
    start = time.perf_counter()
    for _ in range(repeats):
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(b"x")
            view, got = memoryview(buffer), 0
            while got < num_bytes:
                n = conn.recv_into(view[got:])
                if n == 0:
                    raise ConnectionError("short read")
                got += n
    return num_bytes * repeats / (time.perf_counter() - start) / 1e9


def _pull_client(
    port: int, lease_id: str, num_blocks: int, repeats: int, tuned: bool, out: mp.Queue
) -> None:
    if tuned:
        from common.heap import tune_malloc

        tune_malloc()
    out.put(asyncio.run(grpc_pull_gbps(port, lease_id, num_blocks, repeats)))


def grpc_pull_in_processes(num_blocks: int, repeats: int, tuned: bool) -> tuple[float, int]:
    """A producer and a consumer process, both with pdserve's malloc tuning or neither."""
    ctx = mp.get_context("spawn")
    queue: mp.Queue = ctx.Queue()
    server = ctx.Process(target=_serve_kv, args=(num_blocks, queue, tuned), daemon=True)
    server.start()
    try:
        port, lease_id = queue.get(timeout=120)
        client = ctx.Process(
            target=_pull_client, args=(port, lease_id, num_blocks, repeats, tuned, queue)
        )
        client.start()
        rate, num_bytes = queue.get(timeout=600)
        client.join()
    finally:
        server.terminate()
    return rate, num_bytes


def kv_transfer(num_blocks: int, repeats: int) -> None:
    baseline, num_bytes = grpc_pull_in_processes(num_blocks, repeats, tuned=False)
    grpc_rate, _ = grpc_pull_in_processes(num_blocks, repeats, tuned=True)
    ctx = mp.get_context("spawn")
    ports: mp.Queue = ctx.Queue()
    tcp_server = ctx.Process(target=_serve_tcp, args=(num_bytes, ports), daemon=True)
    tcp_server.start()
    tcp_rate = tcp_gbps(ports.get(timeout=60), num_bytes, repeats)
    tcp_server.terminate()
    print(
        f"KV transfer, {num_bytes / 2**20:.0f} MiB per pull ({num_blocks} SmolLM2 blocks), {repeats} pulls:"
    )
    print(f"  KvTransferService.PullBlocks  {grpc_rate:6.2f} GB/s")
    print(f"  ... glibc malloc defaults     {baseline:6.2f} GB/s (without common/heap.py's tuning)")
    print(f"  raw loopback TCP socket       {tcp_rate:6.2f} GB/s")
    print(f"  malloc tuning                 {grpc_rate / baseline:6.2f}x")
    print(f"  gRPC / raw TCP                {grpc_rate / tcp_rate:6.2f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default=None, help="an already running gateway")
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--requests", type=int, default=32, help="per concurrency level")
    parser.add_argument("--kv-blocks", type=int, default=64, help="blocks per KV pull")
    parser.add_argument("--kv-repeats", type=int, default=10)
    parser.add_argument("--skip-latency", action="store_true")
    args = parser.parse_args()

    from common.engine.config import EngineConfig
    from common.engine.engine import Engine
    from common.models.default_model import resolve_model

    kv_transfer(args.kv_blocks, args.kv_repeats)
    if args.skip_latency:
        return
    model = resolve_model(args.model)
    run_dir = tempfile.mkdtemp(prefix="pdserve-bench-")
    env = {**os.environ, "PDSERVE_RUN_DIR": run_dir}
    target = args.target
    if target is None:
        from pdserve.cli.launcher import free_port

        port = free_port()
        subprocess.run([sys.executable, "-m", "pdserve", "up", "--detach", "--port", str(port), "--http-port", "0", "--kserve-port", "0",
                        "--model", model, "--kv-cache-memory", "512MiB"], env=env, check=True)  # fmt: skip
        target = f"127.0.0.1:{port}"
    try:
        prompts = workload(args.requests, 49152, 0, args.prompt_len)
        results = {}
        for concurrency in (1, 16):
            n = args.requests if concurrency > 1 else max(4, args.requests // 4)
            asyncio.run(stack_run(target, prompts[:2], args.max_tokens, 1))  # warm-up
            results[("stack", concurrency)] = summary(
                asyncio.run(stack_run(target, prompts[:n], args.max_tokens, concurrency))
            )
            print(f"stack     c={concurrency:<2} {results[('stack', concurrency)]}", flush=True)
    finally:
        if args.target is None:
            subprocess.run([sys.executable, "-m", "pdserve", "down"], env=env, check=False)
    engine = Engine(EngineConfig(model=model, kv_cache_memory="512MiB"))
    for concurrency in (1, 16):
        n = args.requests if concurrency > 1 else max(4, args.requests // 4)
        engine_run(engine, prompts[:2], args.max_tokens, 1)
        results[("engine", concurrency)] = summary(
            engine_run(engine, prompts[:n], args.max_tokens, concurrency)
        )
        print(f"in-process c={concurrency:<2} {results[('engine', concurrency)]}", flush=True)

    print("\nservice overhead (stack / in-process engine):")
    print(
        f"{'':>6} {'TTFT p50 ms':>22} {'TTFT p99 ms':>22} {'TPOT p50 ms':>22} {'TPOT p99 ms':>22}"
    )
    for concurrency in (1, 16):
        stack, local = results[("stack", concurrency)], results[("engine", concurrency)]
        cells = [f"{stack[k]:7.1f}/{local[k]:7.1f}={stack[k] / local[k]:4.2f}x"
                 for k in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")]  # fmt: skip
        print(f"c={concurrency:<4} " + " ".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    main()
