"""The gateway's Prometheus metrics: requests as the client sees them, and routing."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from common.telemetry.metrics import RedisHealth, RequestMetrics, metric_name
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
        self.redis = RedisHealth(registry)

    def routed(self, reason: str) -> None:
        self._routing.labels(reason).inc()

    def migrated(self, reason: str) -> None:
        self._migrations.labels(reason).inc()
