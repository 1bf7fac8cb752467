"""WorkerConfig: what an engine worker process is told, read once from flags/env."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from common.engine.config import EngineConfig
from common.planner.types import ENGINE_ROLES
from common.rpc.tls import TlsConfig

KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
# At start: reuse the profile of this model, weights, threads and device from Redis or the
# local cache and measure only when there is none (auto), always measure, or hold none.
PROFILE_MODES = ("auto", "measure", "off")


@dataclass(frozen=True)
class WorkerConfig:
    role: str  # the role it starts in: prefill | decode | both (it may change: roles.py)
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 0
    advertise: str | None = None  # address others use to reach us; default host:port
    worker_id: str | None = None
    model_name: str | None = None  # served name; default: the checkpoint directory's name
    redis_url: str | None = None
    blockstore: str | None = None  # block store address, optional
    lease_ttl_s: float = 30.0
    heartbeat_s: float = 1.0
    drain_grace_s: float = 10.0
    index_ttl_s: int = 600
    metrics_port: int = 0  # Prometheus /metrics on host:metrics_port; 0 = off
    # Decoding: what to do when a request's KV can be loaded neither from its producer nor
    # (all its full blocks) from the block store: recompute it here, or fail the request.
    kv_load_failure: str = "recompute"
    kv_pull_timeout_s: float = 60.0  # most a pull from a producer may take before falling back
    # Most a block store read on a request's path may take (it is skipped when it fails).
    blockstore_timeout_s: float = 5.0
    # MoE models: expert load read from the engine and published to Redis every interval,
    # into windows of window_s (the last ``expert_load_windows`` kept); the Prometheus
    # imbalance gauges cover the trailing window_s.
    expert_load_interval_s: float = 5.0
    expert_load_window_s: float = 60.0
    expert_load_windows: int = 60
    expert_metrics_per_expert: bool = False  # also a counter per (layer, expert, phase)
    tls: TlsConfig | None = None  # mutual TLS on every gRPC hop, served and dialled
    profile: str = "off"  # one of PROFILE_MODES (the CLI's default is auto)
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.role not in ENGINE_ROLES:
            raise ValueError(f"role must be one of {', '.join(ENGINE_ROLES)}, got {self.role!r}")
        for name in ("port", "metrics_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} must be in [0, 65535], got {getattr(self, name)}")
        if self.lease_ttl_s <= 0 or self.heartbeat_s <= 0:
            raise ValueError("lease_ttl_s and heartbeat_s must be positive")
        if self.kv_load_failure not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(
                f"kv_load_failure must be one of {', '.join(KV_LOAD_FAILURE_POLICIES)}, "
                f"got {self.kv_load_failure!r}"
            )
        if self.kv_pull_timeout_s <= 0 or self.blockstore_timeout_s <= 0:
            raise ValueError("kv_pull_timeout_s and blockstore_timeout_s must be positive")
        if self.expert_load_interval_s <= 0 or self.expert_load_window_s <= 0:
            raise ValueError("expert_load_interval_s and expert_load_window_s must be positive")
        if self.profile not in PROFILE_MODES:
            raise ValueError(f"profile must be one of {', '.join(PROFILE_MODES)}, got {self.profile!r}")
        if self.expert_load_windows < 1:
            raise ValueError(f"expert_load_windows must be >= 1, got {self.expert_load_windows}")

    @property
    def served_model_name(self) -> str:
        return self.model_name or Path(self.engine.model).name

    def resolved_worker_id(self, port: int) -> str:
        return self.worker_id or f"{self.role}-{socket.gethostname()}-{port}-{os.getpid()}"

    def advertised_address(self, port: int) -> str:
        return self.advertise or f"{self.host}:{port}"
