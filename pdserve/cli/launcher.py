"""Starts and stops the processes of a one-machine stack (``pdserve up`` / ``pdserve down``)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import quote, urlencode, urlsplit, urlunsplit

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.models.default_model import cache_dir
from common.rpc.tls import TlsConfig


def run_dir() -> Path:
    return Path(os.environ.get("PDSERVE_RUN_DIR") or cache_dir() / "run")


_GIVEN_PORTS: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, never one this process was handed before: the OS may give a port
    it just handed out again, and pdserve up picks several before any is bound (two of its
    processes were once given the same one)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _GIVEN_PORTS:
            _GIVEN_PORTS.add(port)
            return port


@dataclass
class Child:
    name: str
    role: str
    pid: int
    address: str
    log: str
    metrics_port: int = 0  # its Prometheus endpoint on the address's host; 0 = none
    argv: list[str] = field(default_factory=list)  # its command line, to restart it
    # What spawn added to its environment (the Redis URL, key lists): the state file that
    # records it is 0600.
    env: dict[str, str] = field(default_factory=dict)

    @property
    def metrics_url(self) -> str | None:
        if not self.metrics_port:
            return None
        host = self.address.rsplit(":", 1)[0]
        return f"http://{host}:{self.metrics_port}/metrics"


@dataclass
class StackState:
    children: list[Child] = field(default_factory=list)
    redis_url: str = ""
    gateway: str = ""
    started_unix_s: float = 0.0
    http: str = ""  # the gateway's OpenAI-compatible API, "" when off
    kserve: str = ""  # the gateway's KServe v2 gRPC port, host:port, "" when off
    # Every gateway's public endpoints, the first's first: {"grpc", "http", "kserve"}, each
    # "" when off (gateway, http and kserve above are the first's).
    gateway_endpoints: list[dict[str, str]] = field(default_factory=list)

    def save(self, path: Path) -> None:
        """Written 0600: the Redis URL may carry a password."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600, exist_ok=True)
        os.chmod(path, 0o600)
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> StackState | None:
        if not path.is_file():
            return None
        raw = json.loads(path.read_text())
        return cls(
            children=[Child(**c) for c in raw["children"]],
            redis_url=raw["redis_url"],
            gateway=raw["gateway"],
            started_unix_s=raw["started_unix_s"],
            http=raw.get("http", ""),
            kserve=raw.get("kserve", ""),
            gateway_endpoints=raw.get("gateway_endpoints", []),
        )

    def alive(self) -> list[Child]:
        return [c for c in self.children if pid_alive(c.pid)]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours counts as dead.
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


def spawn(
    name: str,
    role: str,
    argv: list[str],
    address: str,
    logs: Path,
    metrics_port: int = 0,
    env: dict[str, str] | None = None,
) -> tuple[Child, subprocess.Popen[bytes]]:
    """``env``: added to this process's environment (secrets go there, not into argv)."""
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{name}.log"
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(
            argv,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # survives the launcher with --detach; not hit by its ^C
            env={**os.environ, **env} if env else None,
        )
    child = Child(
        name, role, process.pid, address, str(log_path), metrics_port, argv, dict(env or {})
    )
    return child, process


@dataclass(frozen=True)
class RedisSecurity:
    """How ``pdserve up`` locks its redis-server: a password, and with ``tls`` TLS only,
    clients presenting a certificate from the stack's CA."""

    password: str | None = None
    tls: TlsConfig | None = None


def start_redis(
    port: int, logs: Path, security: RedisSecurity = RedisSecurity()
) -> tuple[Child, subprocess.Popen[bytes]]:
    """Configured by a 0600 file in the logs' folder, so no password shows in ``ps``."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError(
            "redis-server is not installed (apt-get install redis-server), or pass --redis-url"
        )
    lines = ["bind 127.0.0.1", 'save ""', "appendonly no"]
    if security.tls is None:
        lines.append(f"port {port}")
    else:
        lines += [
            "port 0",
            f"tls-port {port}",
            f"tls-cert-file {security.tls.cert}",
            f"tls-key-file {security.tls.key}",
            f"tls-ca-cert-file {security.tls.ca}",
            "tls-auth-clients yes",
        ]
    if security.password:
        lines.append(f"requirepass {security.password}")
    config = logs / "redis.conf"
    logs.mkdir(parents=True, exist_ok=True)
    config.touch(mode=0o600, exist_ok=True)
    os.chmod(config, 0o600)
    config.write_text("\n".join(lines) + "\n")
    return spawn("redis", "redis", [binary, str(config)], f"127.0.0.1:{port}", logs)


def redis_url(port: int, security: RedisSecurity, client_tls: TlsConfig | None = None) -> str:
    """The URL a process of the stack connects with: ``rediss://`` and its own certificate
    (``client_tls``) under TLS, the password in the user-info part."""
    auth = f":{quote(security.password, safe='')}@" if security.password else ""
    if security.tls is None:
        return f"redis://{auth}127.0.0.1:{port}/0"
    tls = client_tls or security.tls
    query = urlencode(
        {
            "ssl_ca_certs": str(tls.ca),
            "ssl_certfile": str(tls.cert),
            "ssl_keyfile": str(tls.key),
            "ssl_cert_reqs": "required",
        }
    )
    return f"rediss://{auth}127.0.0.1:{port}/0?{query}"


def redact(url: str) -> str:
    """A Redis URL fit to print: no password, no query."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"***@{host}" if parts.password else host
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def wait_redis(url: str, timeout_s: float) -> None:
    import redis

    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1) as client:
                if client.ping():
                    return
        except redis.AuthenticationError:
            raise
        except (redis.RedisError, OSError) as exc:
            last = exc
        time.sleep(0.05)
    raise TimeoutError(f"Redis at {redact(url)} did not answer PING in {timeout_s:.0f}s: {last}")


def wait_serving(
    address: str,
    process: subprocess.Popen[bytes] | None,
    child: Child,
    timeout_s: float,
    credentials: grpc.ChannelCredentials | None = None,
) -> None:
    """Polls grpc.health.v1 until SERVING; fails fast if the process exits. With
    ``credentials`` over TLS (a ``--mtls`` stack's workers)."""
    deadline = time.monotonic() + timeout_s
    channel = (
        grpc.insecure_channel(address)
        if credentials is None
        else grpc.secure_channel(address, credentials)
    )
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise RuntimeError(
                    f"{child.name} exited with code {process.returncode}:\n{tail(child.log)}"
                )
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(
        f"{child.name} at {address} not SERVING after {timeout_s:.0f}s:\n{tail(child.log)}"
    )


def tail(path: str, lines: int = 20) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# The planner first (it changes nothing while the stack stops), the gateway (no new
# requests), then workers (drain), then the store and Redis.
_STOP_ORDER = {"planner": 0, "gateway": 1, "prefill": 2, "decode": 2, "both": 2,
               "blockstore": 3, "redis": 4}  # fmt: skip


def stop_children(children: list[Child], timeout_s: float = 20.0) -> None:
    groups: dict[int, list[Child]] = {}
    for child in children:
        groups.setdefault(_STOP_ORDER.get(child.role, 2), []).append(child)
    for _, group in sorted(groups.items()):
        for child in group:
            signal_child(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(pid_alive(c.pid) for c in group):
            time.sleep(0.1)
        for child in group:
            if pid_alive(child.pid):
                print(f"{child.name} ignored SIGTERM; killing", file=sys.stderr)
                signal_child(child.pid, signal.SIGKILL)


def signal_child(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def restart_child(
    state_path: Path, name: str, timeout_s: float = 600.0, stop_timeout_s: float = 60.0
) -> Child:
    """Restarts one process of the stack recorded at ``state_path``: SIGTERM (a worker drains:
    its requests finish, or move on when its grace period ends), then the same command line
    again, on the same address and log; returns once it serves again."""
    state = StackState.load(state_path)
    if state is None:
        raise FileNotFoundError("no stack is running (nothing recorded by pdserve up)")
    index = next((i for i, c in enumerate(state.children) if c.name == name), None)
    if index is None:
        names = ", ".join(c.name for c in state.children)
        raise ValueError(f"no process named {name!r} in the stack (it has {names})")
    child = state.children[index]
    if not child.argv:
        raise ValueError(f"{name} was started without a recorded command line; cannot restart")
    stop_children([child], stop_timeout_s)
    restarted, process = spawn(
        child.name, child.role, child.argv, child.address, Path(child.log).parent,
        child.metrics_port, child.env,
    )  # fmt: skip
    state.children[index] = restarted
    state.save(state_path)
    if child.role == "redis":
        wait_redis(state.redis_url, timeout_s)
    else:
        wait_serving(restarted.address, process, restarted, timeout_s)
    return restarted
