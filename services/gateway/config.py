"""GatewayConfig: one frozen, validated description of a gateway, read once from flags/env."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.rpc.tls import PublicTls, TlsConfig
from services.gateway.admission import AdmissionLimits
from services.gateway.auth import ApiKeys

MiB = 1024 * 1024


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
    # A cached prompt token is worth this many tokens of queued work when picking a prefill
    # worker (services/gateway/routing.py).
    overlap_weight: float = 1.0
    routing_policy: str = "prefix-aware"  # or "load", "round-robin" (baselines)
    # Admission (services/gateway/admission.py): beyond a bound, RESOURCE_EXHAUSTED at once.
    # A per-tenant bound of 0 is the global one.
    max_in_flight: int = 1024
    max_in_flight_per_tenant: int = 0
    max_queued_prompt_tokens: int = 262_144
    max_queued_prompt_tokens_per_tenant: int = 0
    # Largest request message the public port reads; larger ones get grpc's
    # RESOURCE_EXHAUSTED before any parsing.
    max_request_bytes: int = 4 * MiB
    api_keys: ApiKeys | None = None  # None: authentication off, no tenants
    # Tenants whose keys may call AdminService (role changes); with keys off, anyone may.
    admin_tenants: frozenset[str] = frozenset()
    tls: TlsConfig | None = None  # mutual TLS towards workers (internal hops)
    public_tls: PublicTls | None = None  # TLS on the public port
    # A request whose decode stream breaks continues on another decode worker this many times.
    max_migrations: int = 3
    registry_refresh_s: float = 0.25
    # Per-hop limit of a prefill call (0 = only the client's deadline): past it the prompt
    # moves to another prefill worker, or to the decode worker when none is left.
    prefill_timeout_s: float = 60.0
    # Per-hop limit of a decode stream's silence (0 = only the client's deadline): a Decode
    # call that sends nothing for this long (a hung worker) breaks, and the request
    # migrates. The first message may take --prefill-timeout-s longer (the worker may be
    # prefilling or pulling the KV).
    decode_stall_timeout_s: float = 30.0
    # A worker failing this many calls in a row gets none for breaker_cooldown_s; then one
    # probe call per cool-down until one succeeds.
    breaker_failure_threshold: int = 3
    breaker_cooldown_s: float = 5.0
    drain_grace_s: float = 10.0
    # How long after its last message a streamed request can be resumed on any gateway
    # (services/gateway/resume.py: its record in Redis lives that long); 0 = no records.
    resume_ttl_s: float = 300.0
    worker_id: str | None = None
    metrics_port: int = 0  # Prometheus /metrics on host:metrics_port; 0 = off
    # The OpenAI-compatible HTTP API on host:http_port (0: a free port); None = off.
    http_port: int | None = None
    # The KServe v2 / Triton gRPC protocol on host:kserve_port (0: a free port); None = off.
    kserve_port: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("http_port", "kserve_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port < 65536:
                raise ValueError(f"{name} must be in [0, 65535], got {port}")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        for name in (
            "max_in_flight_per_tenant",
            "max_queued_prompt_tokens_per_tenant",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = the global bound)")
        _ = self.admission_limits  # validates the bounds
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if self.local_prefill_tokens < 0:
            raise ValueError("local_prefill_tokens must be >= 0")
        if self.resume_ttl_s < 0:
            raise ValueError(f"resume_ttl_s must be >= 0 (0 = off), got {self.resume_ttl_s}")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")
        if self.prefill_timeout_s < 0:
            raise ValueError(f"prefill_timeout_s must be >= 0, got {self.prefill_timeout_s}")
        if self.decode_stall_timeout_s < 0:
            raise ValueError(
                f"decode_stall_timeout_s must be >= 0, got {self.decode_stall_timeout_s}"
            )
        if self.breaker_failure_threshold < 1:
            raise ValueError("breaker_failure_threshold must be >= 1")
        if self.breaker_cooldown_s <= 0:
            raise ValueError("breaker_cooldown_s must be positive")

    @property
    def admission_limits(self) -> AdmissionLimits:
        return AdmissionLimits(
            max_in_flight=self.max_in_flight,
            max_queued_prompt_tokens=self.max_queued_prompt_tokens,
            max_in_flight_per_tenant=self.max_in_flight_per_tenant or self.max_in_flight,
            max_queued_prompt_tokens_per_tenant=(
                self.max_queued_prompt_tokens_per_tenant or self.max_queued_prompt_tokens
            ),
        )

    @property
    def served_model_name(self) -> str:
        return self.model_name or Path(self.model).name
