"""The gateway's Prometheus metrics: requests as the client sees them, routing, and the
health of what routing depends on (Redis, each worker's circuit breaker, prefill
failovers)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common.planner.types import LENGTH_BUCKETS
from common.telemetry.metrics import ITL_BUCKETS_S, RedisHealth, RequestMetrics, metric_name
from services.gateway import migration
from services.gateway.routing import REASONS


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.registry = registry
        self.requests = RequestMetrics(registry, model_name)
        self.num_requests_running = Gauge(
            metric_name("num_requests_running"),
            "Requests in flight through this gateway.",
            ["model_name"], registry=registry,
        ).labels(model_name)  # fmt: skip
        # The cluster-wide prefix cache, as the workers report each request's cached tokens.
        self.prefix_cache_queries = Counter(
            metric_name("prefix_cache_queries"),
            "Prompt tokens of the requests routed (each looked up in the prefix caches).",
            ["model_name"], registry=registry,
        ).labels(model_name)  # fmt: skip
        self.prefix_cache_hits = Counter(
            metric_name("prefix_cache_hits"),
            "Prompt tokens served from a prefix cache (a worker's own or the block store).",
            ["model_name"], registry=registry,
        ).labels(model_name)  # fmt: skip
        self._routing = Counter(
            metric_name("routing_decisions"),
            "Requests routed, by the reason for the route.",
            ["reason"], registry=registry,
        )  # fmt: skip
        for reason in REASONS:  # every series exists from the start, at 0
            self._routing.labels(reason)
        self._migrations = Counter(
            metric_name("request_migrations"),
            "Decode streams that broke mid-way and continued on another decode worker, by why "
            "they broke.",
            ["reason"], registry=registry,
        )  # fmt: skip
        for reason in migration.REASONS:
            self._migrations.labels(reason)
        # vLLM's per-request length histograms, and time per output token per request (the
        # planner reads the load's shape and its SLA attainment from these).
        self.request_prompt_tokens = Histogram(
            metric_name("request_prompt_tokens"),
            "Prompt tokens of each request routed (counted at its arrival).",
            ["model_name"], registry=registry, buckets=LENGTH_BUCKETS,
        ).labels(model_name)  # fmt: skip
        self.request_generation_tokens = Histogram(
            metric_name("request_generation_tokens"),
            "Tokens generated for each request that ended.",
            ["model_name"], registry=registry, buckets=LENGTH_BUCKETS,
        ).labels(model_name)  # fmt: skip
        self.request_time_per_output_token = Histogram(
            metric_name("request_time_per_output_token_seconds"),
            "Each request's mean time per output token after its first.",
            ["model_name"], registry=registry, buckets=ITL_BUCKETS_S,
        ).labels(model_name)  # fmt: skip
        self.redis = RedisHealth(registry)
        self.index_available = Gauge(
            metric_name("index_available"),
            "1 while routing uses the prefix index and registry in Redis; 0 while Redis is "
            "unreachable and requests are routed by load on the last known workers.",
            registry=registry,
        )
        self.routed_without_index = Counter(
            metric_name("routing_without_index"),
            "Requests routed by load only because the prefix index could not be read.",
            registry=registry,
        )
        self.circuit_open = Gauge(
            metric_name("circuit_breaker_open"),
            "1 while the gateway avoids a worker that failed repeatedly (open or probing).",
            ["worker_id"], registry=registry,
        )  # fmt: skip
        self.circuit_trips = Counter(
            metric_name("circuit_breaker_trips"),
            "Times a worker's circuit breaker opened after consecutive failures.",
            ["worker_id"], registry=registry,
        )  # fmt: skip
        self.prefill_failovers = Counter(
            metric_name("prefill_failovers"),
            "Prefill calls that failed (worker unreachable, reset, timed out, overloaded) and "
            "moved on, by where to: another prefill worker, or the decode worker.",
            ["to"], registry=registry,
        )  # fmt: skip
        for to in ("prefill", "decode"):
            self.prefill_failovers.labels(to)
        self._admission_rejections = Counter(
            metric_name("admission_rejections"),
            "Requests refused RESOURCE_EXHAUSTED by admission control, by the bound that was "
            "full (in_flight_requests, queued_prompt_tokens) and its scope (global, tenant).",
            ["bound", "scope"], registry=registry,
        )  # fmt: skip
        for bound in ("in_flight_requests", "queued_prompt_tokens"):
            for scope in ("global", "tenant"):
                self._admission_rejections.labels(bound, scope)
        self.queued_prompt_tokens = Gauge(
            metric_name("admission_queued_prompt_tokens"),
            "Prompt tokens admitted and not yet prefilled (estimates until tokenized).",
            registry=registry,
        )
        self._auth_rejections = Counter(
            metric_name("auth_rejections"),
            "Calls refused UNAUTHENTICATED (no API key, or an unknown one).",
            registry=registry,
        )

        self._http_requests = Counter(
            metric_name("http_requests"),
            "Requests on the OpenAI-compatible HTTP port, by endpoint and HTTP status (their "
            "generations count in the request metrics as the gRPC API's do).",
            ["endpoint", "status"], registry=registry,
        )  # fmt: skip

    def http_request(self, endpoint: str, status: int) -> None:
        self._http_requests.labels(endpoint, str(status)).inc()

    def admission_rejected(self, bound: str, scope: str) -> None:
        self._admission_rejections.labels(bound, scope).inc()

    def auth_rejected(self) -> None:
        self._auth_rejections.inc()

    def routed(self, reason: str) -> None:
        self._routing.labels(reason).inc()

    def migrated(self, reason: str) -> None:
        self._migrations.labels(reason).inc()
