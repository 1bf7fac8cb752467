"""The processes a scenario needs, started on this machine and stopped after it.

A cluster is redis-server, optionally the block store, and prefill and decode workers,
each pinned to the CPUs its spec names (``taskset``; its torch threads follow the count).
Gateways are cheap (no model), so a cluster starts one per routing configuration asked
for. A pool keeps clusters by spec so that scenarios needing the same workers share them:
the CI-size runs all use one.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.cli.launcher import (
    Child,
    free_port,
    spawn,
    start_redis,
    stop_children,
    wait_redis,
    wait_serving,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterSpec:
    """CPUs per worker, e.g. ``prefill_cpus=("0",), decode_cpus=("1",)``; None = unpinned."""

    prefill_cpus: tuple[str | None, ...]
    decode_cpus: tuple[str | None, ...]
    prefix_caching: bool = True
    kv_cache_memory: str = "256MiB"
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None  # the prefill chunk: bounds how long a step runs
    blockstore: bool = True

    def describe(self) -> str:
        def workers(role: str, cpus: tuple[str | None, ...]) -> list[str]:
            return [f"{role}-{i}@cpu{c}" if c else f"{role}-{i}" for i, c in enumerate(cpus)]

        parts = workers("prefill", self.prefill_cpus) + workers("decode", self.decode_cpus)
        if not self.prefix_caching:
            parts.append("no-prefix-caching")
        if self.max_num_batched_tokens is not None:
            parts.append(f"max-num-batched-tokens={self.max_num_batched_tokens}")
        return " ".join(parts)


@dataclass(frozen=True)
class GatewaySpec:
    overlap_weight: float = 1.0
    local_prefill_tokens: int = 16
    routing_policy: str = "prefix-aware"

    def describe(self) -> str:
        return (
            f"gateway(routing_policy={self.routing_policy}, overlap_weight={self.overlap_weight:g}, "
            f"local_prefill_tokens={self.local_prefill_tokens})"
        )


def pinned(argv: list[str], cpus: str | None) -> list[str]:
    """``argv`` run on ``cpus`` with as many torch threads as CPUs; as is if None."""
    if cpus is None:
        return argv
    if shutil.which("taskset") is None:
        raise FileNotFoundError("taskset (util-linux) is needed to pin workers to CPUs")
    num = sum(
        len(range(int(a), int(b or a) + 1))
        for a, _, b in (p.partition("-") for p in cpus.split(","))
    )
    return ["taskset", "-c", cpus, "env", f"OMP_NUM_THREADS={num}", *argv]


@dataclass
class Cluster:
    spec: ClusterSpec
    model_dir: str
    logs: Path
    children: list[Child] = field(default_factory=list)
    redis_url: str = ""
    gateways: dict[GatewaySpec, str] = field(default_factory=dict)
    _processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def _python(self) -> list[str]:
        return [sys.executable, "-m", "pdserve", "--log-level", "WARNING"]

    def _launch(self, name: str, role: str, argv: list[str], address: str) -> Child:
        child, process = spawn(name, role, argv, address, self.logs)
        self.children.append(child)
        self._processes[name] = process
        return child

    def start(self, timeout_s: float = 600.0) -> None:
        try:
            redis_port = free_port()
            child, process = start_redis(redis_port, self.logs)
            self.children.append(child)
            self._processes[child.name] = process
            self.redis_url = f"redis://127.0.0.1:{redis_port}/0"
            wait_redis(self.redis_url, 30)
            common = ["--redis-url", self.redis_url]
            workers: list[Child] = []
            if self.spec.blockstore:
                port = free_port()
                workers.append(self._launch("blockstore", "blockstore", [*self._python(), "blockstore",
                               "--port", str(port), "--worker-id", "blockstore-0", *common],
                               f"127.0.0.1:{port}"))  # fmt: skip
                common += ["--blockstore", f"127.0.0.1:{port}"]
            engine = ["--kv-cache-memory", self.spec.kv_cache_memory]
            if self.spec.max_num_seqs is not None:
                engine += ["--max-num-seqs", str(self.spec.max_num_seqs)]
            if self.spec.max_num_batched_tokens is not None:
                engine += ["--max-num-batched-tokens", str(self.spec.max_num_batched_tokens)]
            if not self.spec.prefix_caching:
                engine.append("--no-prefix-caching")
            for role, cpus_list in (
                ("prefill", self.spec.prefill_cpus),
                ("decode", self.spec.decode_cpus),
            ):
                for i, cpus in enumerate(cpus_list):
                    port = free_port()
                    argv = [*self._python(), role, "--port", str(port), "--model", self.model_dir,
                            "--worker-id", f"{role}-{i}", *common, *engine]  # fmt: skip
                    workers.append(
                        self._launch(f"{role}-{i}", role, pinned(argv, cpus), f"127.0.0.1:{port}")
                    )
            for child in workers:
                wait_serving(child.address, self._processes[child.name], child, timeout_s)
        except BaseException:
            self.stop()
            raise

    def gateway(self, spec: GatewaySpec, timeout_s: float = 120.0) -> str:
        """The address of a gateway with this routing configuration (started on first use)."""
        if spec in self.gateways:
            return self.gateways[spec]
        port = free_port()
        name = f"gateway-{len(self.gateways)}"
        argv = [*self._python(), "gateway", "--port", str(port), "--http-port", "0", "--kserve-port", "0",
                "--model", self.model_dir,
                "--worker-id", name, "--redis-url", self.redis_url,
                "--overlap-weight", str(spec.overlap_weight),
                "--routing-policy", spec.routing_policy,
                "--local-prefill-tokens", str(spec.local_prefill_tokens)]  # fmt: skip
        child = self._launch(name, "gateway", argv, f"127.0.0.1:{port}")
        wait_serving(child.address, self._processes[name], child, timeout_s)
        wait_workers_registered(
            child.address, len(self.spec.prefill_cpus) + len(self.spec.decode_cpus)
        )
        self.gateways[spec] = child.address
        return child.address

    def stop(self) -> None:
        stop_children(self.children)
        self.children.clear()
        self.gateways.clear()


def wait_workers_registered(target: str, num_workers: int, timeout_s: float = 30.0) -> None:
    """Until the gateway sees every engine worker in the registry."""
    import asyncio

    from pdserve.cli.commands.status import fetch

    deadline = time.monotonic() + timeout_s
    while True:
        workers = asyncio.run(fetch(target))
        if sum(w["role"] in ("prefill", "decode") for w in workers) >= num_workers:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"gateway {target} sees {len(workers)} processes, wants {num_workers} workers"
            )
        time.sleep(0.25)


@dataclass
class HttpServer:
    """A baseline server process speaking OpenAI HTTP."""

    name: str
    url: str
    children: list[Child]

    def stop(self) -> None:
        stop_children(self.children)


def wait_http(url: str, process: subprocess.Popen[bytes], log_path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = Path(log_path).read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{url}: server exited with code {process.returncode}:\n{tail}")
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(f"{url}/v1/models", timeout=2) as reply,
        ):
            if reply.status == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{url} not answering after {timeout_s:.0f}s")


def start_hf_server(
    model_dir: str, logs: Path, cpus: str | None, max_batch_size: int = 8
) -> HttpServer:
    port = free_port()
    argv = [sys.executable, "-m", "loadtest.baselines.hf_server", "--model", model_dir,
            "--port", str(port), "--max-batch-size", str(max_batch_size)]  # fmt: skip
    child, process = spawn(
        "transformers", "baseline", pinned(argv, cpus), f"127.0.0.1:{port}", logs
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url, process, child.log, 300)
    except BaseException:
        stop_children([child])
        raise
    return HttpServer("transformers", url, [child])


def llama_cpp_command(port: int, cpus: str | None) -> list[str] | None:
    """How to start llama.cpp's server on the default model's GGUF, or None when neither
    ``llama-server`` nor ``llama-cpp-python[server]`` is installed."""
    import importlib.util

    from common.models.default_model import gguf_path

    try:
        gguf = str(gguf_path())
    except (FileNotFoundError, OSError):
        return None
    threads = ["--threads", str(len(cpus.split(",")))] if cpus else []
    if shutil.which("llama-server"):
        argv = ["llama-server", "-m", gguf, "--port", str(port), "--host", "127.0.0.1", *threads]
    elif importlib.util.find_spec("llama_cpp") and importlib.util.find_spec("llama_cpp.server"):
        argv = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--port", str(port),
                "--host", "127.0.0.1", *threads]  # fmt: skip
    else:
        return None
    return pinned(argv, cpus)


LLAMA_CPP_MISSING = (
    "llama.cpp baseline skipped: neither `llama-server` nor `llama-cpp-python[server]` is "
    "installed (`pip install 'llama-cpp-python[server]'` builds it on this machine)"
)


def start_llama_cpp(logs: Path, cpus: str | None) -> HttpServer | None:
    port = free_port()
    argv = llama_cpp_command(port, cpus)
    if argv is None:
        return None
    child, process = spawn("llama.cpp", "baseline", argv, f"127.0.0.1:{port}", logs)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url, process, child.log, 300)
    except BaseException:
        stop_children([child])
        raise
    return HttpServer("llama.cpp", url, [child])


class ClusterPool:
    """Started clusters and baseline servers, by spec. ``exclusive``: at most one cluster
    runs at a time (full-size runs, so arms do not share the CPUs); otherwise they are kept
    until ``close`` (CI, where starting is the expensive part)."""

    def __init__(self, model_dir: str, run_dir: Path, exclusive: bool = True) -> None:
        self.model_dir = model_dir
        self.logs = run_dir / "logs"
        self.exclusive = exclusive
        self.clusters: dict[ClusterSpec, Cluster] = {}
        self.servers: dict[tuple[str, str | None], HttpServer | None] = {}

    def cluster(self, spec: ClusterSpec) -> Cluster:
        if spec in self.clusters:
            return self.clusters[spec]
        if self.exclusive:
            self.stop_all()
        log.info("starting cluster: %s", spec.describe())
        cluster = Cluster(spec, self.model_dir, self.logs)
        cluster.start()
        self.clusters[spec] = cluster
        return cluster

    def baseline(self, name: str, cpus: str | None) -> HttpServer | None:
        """``transformers`` or ``llama.cpp``; None when that server is not installed."""
        key = (name, cpus)
        if key not in self.servers:
            if self.exclusive:
                self.stop_all()
            if name == "transformers":
                self.servers[key] = start_hf_server(self.model_dir, self.logs, cpus)
            else:
                self.servers[key] = start_llama_cpp(self.logs, cpus)
        return self.servers[key]

    def stop_all(self) -> None:
        for cluster in self.clusters.values():
            cluster.stop()
        self.clusters.clear()
        for server in self.servers.values():
            if server is not None:
                server.stop()
        self.servers.clear()

    close = stop_all
