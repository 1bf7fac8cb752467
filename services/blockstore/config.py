"""BlockStoreConfig: what a block store process is told, read once from flags and environment."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import psutil

from common.engine.config import parse_memory_budget
from common.rpc.tls import TlsConfig

DEFAULT_PORT = 50060
MIN_DISK_BYTES = 1 << 20


@dataclass(frozen=True)
class BlockStoreConfig:
    capacity_bytes: int
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    advertise: str | None = None  # address others use to reach us; default host:port
    worker_id: str | None = None
    redis_url: str | None = None  # None: no prefix index, no registry
    put_expiry_s: float = 30.0  # an open put neither committed nor aborted by then is aborted
    heartbeat_s: float = 1.0
    index_ttl_s: int = 600  # TTL of the store's prefix-index entries; refreshed every ttl / 2
    drain_grace_s: float = 10.0
    metrics_port: int = 0  # Prometheus /metrics on host:metrics_port; 0 = off
    tls: TlsConfig | None = None  # mutual TLS: only peers with a certificate from tls.ca
    disk_dir: str | None = None  # the disk tier's directory; None: memory only
    disk_capacity_bytes: int = 0  # bound on the disk tier's files (with disk_dir)
    disk_fsync: bool = True  # each spilled batch reaches the disk before it is indexed

    def __post_init__(self) -> None:
        if self.capacity_bytes < 1:
            raise ValueError(f"capacity must be at least 1 byte, got {self.capacity_bytes}")
        for name in ("port", "metrics_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} must be in [0, 65535], got {getattr(self, name)}")
        for name in ("put_expiry_s", "heartbeat_s", "drain_grace_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.index_ttl_s < 2:
            raise ValueError(f"index_ttl_s must be at least 2, got {self.index_ttl_s}")
        if self.disk_dir and self.disk_capacity_bytes < MIN_DISK_BYTES:
            raise ValueError(
                f"disk capacity must be at least {MIN_DISK_BYTES >> 20} MiB, "
                f"got {self.disk_capacity_bytes} bytes"
            )

    @property
    def disk_segment_bytes(self) -> int:
        """Segments of 64 MiB, or an eighth of a small disk (the bound deletes whole ones)."""
        return min(64 << 20, self.disk_capacity_bytes // 8)

    @classmethod
    def from_env(
        cls, capacity: str | None = None, disk_capacity: str | None = None, **overrides: object
    ) -> BlockStoreConfig:
        """Flags win over ``PDSERVE_*`` environment variables, which win over defaults.

        ``capacity`` is bytes (``"2GiB"``, ``"512MB"``) or a fraction of host memory (``"0.25"``);
        ``disk_capacity`` bytes or a fraction of the disk directory's file system.
        """
        capacity = capacity or os.environ.get("PDSERVE_BLOCKSTORE_CAPACITY") or "1GiB"
        env = {
            "redis_url": os.environ.get("PDSERVE_REDIS_URL"),
            "disk_dir": os.environ.get("PDSERVE_BLOCKSTORE_DISK_DIR"),
        }
        values: dict[str, object] = {k: v for k, v in env.items() if v}
        values.update({k: v for k, v in overrides.items() if v is not None})
        capacity_bytes = parse_memory_budget(capacity, psutil.virtual_memory().total)
        if values.get("disk_dir"):
            disk = disk_capacity or os.environ.get("PDSERVE_BLOCKSTORE_DISK_CAPACITY") or "0.5"
            values["disk_capacity_bytes"] = parse_memory_budget(
                disk, _file_system_bytes(str(values["disk_dir"]))
            )
        return cls(capacity_bytes=capacity_bytes, **values)  # type: ignore[arg-type]

    @property
    def bind_address(self) -> str:
        return f"{self.host}:{self.port}"

    def resolved_worker_id(self, port: int) -> str:
        return self.worker_id or f"blockstore-{socket.gethostname()}-{port}-{os.getpid()}"

    def advertised_address(self, port: int) -> str:
        if self.advertise:
            return self.advertise
        wildcard = self.host in ("0.0.0.0", "[::]", "::", "")
        return f"{socket.gethostname() if wildcard else self.host}:{port}"


def _file_system_bytes(directory: str) -> int:
    """The size of the file system that holds (or will hold) ``directory``."""
    path = os.path.abspath(directory)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return psutil.disk_usage(path).total
