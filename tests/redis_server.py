"""A throwaway redis-server for tests: its own port and directory, nothing persisted.
``redis_server(directory)`` for a test's lifetime; ``RedisServer`` where a test kills it and
starts it again on the same port (a Redis restart that lost everything)."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.polling import until


class RedisServer:
    def __init__(self, directory: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed: run scripts/setup_system.sh")
        self.binary = binary
        self.directory = directory
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.directory)]  # fmt: skip
        process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.process = process

        def listening() -> bool:
            if process.poll() is not None:
                pytest.fail(f"redis-server exited at start on port {self.port}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
            except OSError:
                return False
            return True

        until(f"redis-server listening on port {self.port}", listening, 10.0, every_s=0.05)

    def kill(self) -> None:
        """As a crash: SIGKILL, nothing saved."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None


@contextlib.contextmanager
def redis_server(directory: Path) -> Iterator[str]:
    """Starts redis-server on a free loopback port; yields its URL; stops it."""
    server = RedisServer(directory)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()
