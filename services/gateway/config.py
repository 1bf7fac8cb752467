"""GatewayConfig: one frozen, validated description of a gateway, read once from flags/env."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class GatewayConfig:
    model: str  # checkpoint directory: tokenizer, chat template and config are read from it
    redis_url: str
    host: str = "127.0.0.1"
    port: int = 50051
    model_name: str | None = None
    block_size: int = 16
    hash_seed: str = ""
    max_model_len: int | None = None
    # Prompts whose uncached part is shorter than this are prefilled on the decode worker.
    local_prefill_tokens: int = 16
    # One block of prefix overlap is worth this much queued load when picking a prefill worker.
    overlap_weight: float = 1.0
    max_in_flight: int = 1024  # admission bound: beyond it, RESOURCE_EXHAUSTED at once
    # A request whose decode stream breaks continues on another decode worker this many times.
    max_migrations: int = 3
    registry_refresh_s: float = 0.25
    drain_grace_s: float = 10.0
    worker_id: str | None = None
    metrics_port: int = 0  # Prometheus /metrics on host:metrics_port; 0 = off

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        if self.local_prefill_tokens < 0:
            raise ValueError("local_prefill_tokens must be >= 0")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")

    @property
    def served_model_name(self) -> str:
        return self.model_name or Path(self.model).name
