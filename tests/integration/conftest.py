"""Real stacks for the integration tests, all as processes on loopback: ``stack`` is
``pdserve up`` with redis-server, the block store, 2 prefill and 2 decode workers and the
gateway; ``observed_stack`` a smaller one whose traces and metrics the tests read."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest

from pdserve.cli.launcher import (
    Child,
    StackState,
    free_port,
    spawn,
    stop_children,
    wait_serving,
)
from tests.polling import settle
from tests.telemetry.otlp_receiver import OtlpReceiver


@dataclass
class Stack:
    target: str
    run_dir: Path
    env: dict[str, str]
    model_dir: Path

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pdserve", *args],
            capture_output=True, text=True, env=self.env, timeout=timeout, check=False,
        )  # fmt: skip

    def workers(self) -> list[dict]:
        from pdserve.cli.commands.status import fetch

        return asyncio.run(fetch(self.target))

    def children(self) -> dict[str, Child]:
        """The processes ``pdserve up`` recorded, by name (as restarted since)."""
        state = StackState.load(self.run_dir / "stack.json")
        assert state is not None, "pdserve up recorded no stack"
        return {c.name: c for c in state.children}

    def http_url(self) -> str:
        """The gateway's OpenAI-compatible API, ``http://127.0.0.1:PORT/v1``."""
        state = StackState.load(self.run_dir / "stack.json")
        assert state is not None and state.http, "pdserve up recorded no HTTP API"
        return state.http

    def log_of(self, name: str) -> str:
        return Path(self.children()[name].log).read_text(errors="replace")

    def wait_all_free(self, timeout_s: float = 20.0) -> list[dict]:
        """Polls until every worker's KV pool is entirely free again (or times out)."""
        return settle(
            lambda: [w for w in self.workers() if w["role"] in ("prefill", "decode")],
            lambda workers: all(w["kv_blocks_free"] == w["kv_blocks_total"] for w in workers),
            timeout_s,
        )


S = TypeVar("S", bound=Stack)


def free_ports_in_a_row(count: int) -> int:
    """The first of ``count`` consecutive ports, each free now (pdserve's free_port for the
    first, so no later free_port hands it out)."""
    while True:
        first = free_port()
        if count == 1:
            return first
        try:
            for port in range(first + 1, first + count):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first


@contextlib.contextmanager
def up_stack(
    smollm_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    *up_args: str,
    kind: type[S] = Stack,  # type: ignore[assignment]
    env_drop: tuple[str, ...] = (),
    env_extra: dict[str, str] | None = None,
) -> Iterator[S]:
    """``pdserve up --detach`` with 2 prefill and 2 decode workers in a run directory of its
    own, plus ``up_args`` (and ``env_extra`` in its environment); ``pdserve down`` at the
    end."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: run scripts/setup_system.sh")
    run_dir = tmp_path_factory.mktemp(name)
    env = {**os.environ, "PDSERVE_RUN_DIR": str(run_dir), "PDSERVE_LOG_LEVEL": "INFO"}
    for key in env_drop:
        env.pop(key, None)
    env.update(env_extra or {})
    # --gateways N takes N ports in a row from --port.
    gateways = int(up_args[up_args.index("--gateways") + 1]) if "--gateways" in up_args else 1
    port = free_ports_in_a_row(gateways)
    stack = kind(f"127.0.0.1:{port}", run_dir, env, smollm_dir)
    started = stack.cli(
        "up", "--detach", "--port", str(port), "--http-port", "0", "--kserve-port", "0", "--prefill", "2", "--decode", "2",
        "--model", str(smollm_dir), *up_args, timeout=900,
    )  # fmt: skip
    if started.returncode != 0:
        pytest.fail(f"pdserve up failed:\n{started.stdout}\n{started.stderr}")
    try:
        yield stack
    finally:
        stopped = stack.cli("down", timeout=120)
        assert stopped.returncode == 0, stopped.stderr


@dataclass
class ExtraGateway:
    """A gateway process of a test's own on a stack's workers and Redis."""

    child: Child
    process: subprocess.Popen[bytes]
    http_port: int
    kserve_port: int


@contextlib.contextmanager
def extra_gateway(
    stack: Stack, tmp_path_factory: pytest.TempPathFactory, name: str, *flags: str,
    timeout_s: float = 60.0,
) -> Iterator[ExtraGateway]:  # fmt: skip
    """``pdserve gateway`` with ``flags`` (keys, bounds, grace) beside the stack's own, its
    HTTP and KServe ports free ones; stopped at the end."""
    state = StackState.load(stack.run_dir / "stack.json")
    assert state is not None
    port, http_port, kserve_port = free_port(), free_port(), free_port()
    argv = [
        sys.executable, "-m", "pdserve", "--log-level", "INFO", "gateway", "--port", str(port),
        "--http-port", str(http_port), "--kserve-port", str(kserve_port),
        "--model", str(stack.model_dir), "--worker-id", name, "--redis-url", state.redis_url,
        *flags,
    ]  # fmt: skip
    child, process = spawn(name, "gateway", argv, f"127.0.0.1:{port}", tmp_path_factory.mktemp(name))
    try:
        wait_serving(child.address, process, child, timeout_s)
        yield ExtraGateway(child, process, http_port, kserve_port)
    finally:
        stop_children([child])


@pytest.fixture(scope="session")
def stack(smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # Two gateways, as a fleet runs them: tests use the first (target); the second takes
    # the next port.
    with up_stack(smollm_dir, tmp_path_factory, "stack", "--kv-cache-memory", "256MiB",
                  "--gateways", "2") as up:  # fmt: skip
        yield up


@dataclass
class ObservedStack(Stack):
    """A small stack (1 prefill, 1 decode, block store, gateway) exporting its spans to an
    OTLP receiver in this test process, every process with a metrics endpoint."""

    receiver: OtlpReceiver


@pytest.fixture(scope="session")
def observed_stack(
    smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ObservedStack]:
    """Configured only through OTEL_* variables, as a user would."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: run scripts/setup_system.sh")
    receiver = OtlpReceiver()
    endpoint = receiver.start()
    run_dir = tmp_path_factory.mktemp("observed")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("OTEL_") and k != "PDSERVE_METRICS_PORT"
    }
    env.update(
        PDSERVE_RUN_DIR=str(run_dir),
        PDSERVE_LOG_LEVEL="INFO",
        OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
        OTEL_BSP_SCHEDULE_DELAY="100",  # ms: spans reach the receiver soon after they end
    )
    port = free_port()
    stack = ObservedStack(f"127.0.0.1:{port}", run_dir, env, smollm_dir, receiver)
    started = stack.cli(
        "up", "--detach", "--port", str(port), "--http-port", "0", "--kserve-port", "0", "--prefill", "1", "--decode", "1",
        "--model", str(smollm_dir), "--kv-cache-memory", "128MiB", timeout=900,
    )  # fmt: skip
    if started.returncode != 0:
        receiver.stop()
        pytest.fail(f"pdserve up failed:\n{started.stdout}\n{started.stderr}")
    try:
        yield stack
    finally:
        stopped = stack.cli("down", timeout=120)
        receiver.stop()
        assert stopped.returncode == 0, stopped.stderr
