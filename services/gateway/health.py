"""What the gateway knows about the health of what it depends on.

``IndexHealth``: whether Redis (the prefix index and the worker registry) answers. While it
does not, routing goes by load alone on the last worker list read, Redis is tried again at
most every ``retry_s`` (not on every request), and ``pdserve:index_available`` is 0;
``pdserve status`` shows it (GetClusterStatus ``routing_index``).

``WorkerBreakers``: a circuit breaker per worker (common/rpc/breaker.py) with its metrics:
``pdserve:circuit_breaker_open{worker_id}`` (1 while the gateway avoids or probes the
worker) and ``pdserve:circuit_breaker_trips_total{worker_id}``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable

from common.index.registry import WorkerInfo
from common.rpc.breaker import BreakerSet, CircuitState
from services.gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)

INDEX_RETRY_S = 1.0


class IndexHealth:
    def __init__(
        self,
        metrics: GatewayMetrics,
        retry_s: float = INDEX_RETRY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
        self.metrics = metrics
        self.retry_s = retry_s
        self.available = True
        self.error = ""
        self.unavailable_since_unix_ms = 0
        self._retry_at = 0.0
        metrics.index_available.set(1)

    def should_try(self) -> bool:
        """Whether to call Redis now: always while it answers, else once per retry_s."""
        return self.available or self.clock() >= self._retry_at

    def ok(self) -> None:
        self.metrics.redis.ok()
        if not self.available:
            log.info(
                "Redis answers again after %.1f s: routing uses the prefix index again",
                time.time() - self.unavailable_since_unix_ms / 1000,
            )
            self.available = True
            self.error = ""
            self.unavailable_since_unix_ms = 0
            self.metrics.index_available.set(1)

    def failed(self, operation: str, exc: BaseException) -> None:
        self.metrics.redis.failed(operation)
        self._retry_at = self.clock() + self.retry_s
        self.error = f"{operation}: {type(exc).__name__}: {exc}"
        if self.available:
            log.warning(
                "Redis is unreachable (%s); routing by load only on the last known workers",
                self.error,
            )
            self.available = False
            self.unavailable_since_unix_ms = int(time.time() * 1000)
            self.metrics.index_available.set(0)


class WorkerBreakers(BreakerSet):
    def __init__(
        self,
        metrics: GatewayMetrics,
        failure_threshold: int,
        cooldown_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.metrics = metrics
        super().__init__(failure_threshold, cooldown_s, clock=clock, on_change=self._changed)

    def _changed(self, worker_id: str, old: CircuitState, new: CircuitState) -> None:
        self.metrics.circuit_open.labels(worker_id).set(0 if new is CircuitState.CLOSED else 1)
        if new is CircuitState.OPEN:
            if old is CircuitState.CLOSED:
                self.metrics.circuit_trips.labels(worker_id).inc()
            log.warning(
                "worker %s failed %d calls in a row: not sending to it for %.1f s",
                worker_id,
                self.get(worker_id).consecutive_failures,
                self.cooldown_s,
            )
        elif new is CircuitState.CLOSED:
            log.info("worker %s answers again: sending to it again", worker_id)

    def usable(self, workers: list[WorkerInfo]) -> list[WorkerInfo]:
        """The workers whose circuit breaker lets a call through now."""
        return [w for w in workers if self.allows(w.worker_id)]

    def keep_only(self, peers: Iterable[str]) -> None:
        before = set(self._breakers)
        super().keep_only(peers)
        for worker_id in before - set(self._breakers):
            with contextlib.suppress(KeyError):
                self.metrics.circuit_open.remove(worker_id)
