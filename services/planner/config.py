"""PlannerServiceConfig: what the planner process is told, read once from flags/env."""

from __future__ import annotations

from dataclasses import dataclass

from common.planner.types import Targets
from common.rpc.tls import TlsConfig

CONNECTORS = ("local", "kubernetes", "metrics")


@dataclass(frozen=True)
class PlannerServiceConfig:
    targets: Targets
    model: str  # the served model name the planner sizes (workers and profiles of it)
    redis_url: str
    connector: str = "local"
    interval_s: float = 10.0
    dwell_s: float = 60.0
    min_workers: int = 1
    max_workers: int = 0  # 0: the engine workers registered at start (roles change only)
    # kubernetes
    namespace: str = "default"
    prefill_deployment: str = ""
    decode_deployment: str = ""
    kubeconfig: str | None = None
    host: str = "127.0.0.1"
    port: int = 0  # gRPC health, for probes; 0 = a free port
    metrics_port: int = 0
    worker_id: str = "planner-0"
    tls: TlsConfig | None = None

    def __post_init__(self) -> None:
        if self.connector not in CONNECTORS:
            raise ValueError(
                f"connector must be one of {', '.join(CONNECTORS)}, got {self.connector!r}"
            )
        if self.interval_s <= 0 or self.dwell_s < 0:
            raise ValueError("interval_s must be positive and dwell_s not negative")
        if self.min_workers < 1 or (self.max_workers and self.max_workers < self.min_workers):
            raise ValueError(
                f"need 1 <= min_workers <= max_workers, got {self.min_workers}, "
                f"{self.max_workers}"
            )
        if self.connector == "kubernetes" and not (
            self.prefill_deployment and self.decode_deployment
        ):
            raise ValueError(
                "the kubernetes connector needs --prefill-deployment and --decode-deployment"
            )
