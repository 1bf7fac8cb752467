"""A real stack for the integration tests: ``pdserve up`` with redis-server, the block store,
2 prefill and 2 decode workers and the gateway, all as processes on loopback."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdserve.launcher import free_port


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
        from pdserve.commands.status import fetch

        return asyncio.run(fetch(self.target))

    def wait_all_free(self, timeout_s: float = 20.0) -> list[dict]:
        """Polls until every worker's KV pool is entirely free again (or times out)."""
        deadline = time.monotonic() + timeout_s
        while True:
            workers = [w for w in self.workers() if w["role"] in ("prefill", "decode")]
            if (
                all(w["kv_blocks_free"] == w["kv_blocks_total"] for w in workers)
                or time.monotonic() > deadline
            ):
                return workers
            time.sleep(0.25)


@pytest.fixture(scope="session")
def stack(smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: run scripts/setup_system.sh")
    run_dir = tmp_path_factory.mktemp("stack")
    env = {**os.environ, "PDSERVE_RUN_DIR": str(run_dir), "PDSERVE_LOG_LEVEL": "INFO"}
    port = free_port()
    stack = Stack(f"127.0.0.1:{port}", run_dir, env, smollm_dir)
    started = stack.cli(
        "up", "--detach", "--port", str(port), "--prefill", "2", "--decode", "2",
        "--model", str(smollm_dir), "--kv-cache-memory", "256MiB", timeout=900,
    )  # fmt: skip
    if started.returncode != 0:
        pytest.fail(f"pdserve up failed:\n{started.stdout}\n{started.stderr}")
    try:
        yield stack
    finally:
        stopped = stack.cli("down", timeout=120)
        assert stopped.returncode == 0, stopped.stderr
