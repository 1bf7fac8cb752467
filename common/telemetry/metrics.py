"""Prometheus metrics: names, buckets, the request-level families, the HTTP endpoint.

Names follow vLLM's (``vllm:time_to_first_token_seconds`` -> ``pdserve:time_to_first_token_
seconds``) so existing dashboards work by swapping the prefix. Counters are declared
without ``_total``; the exposition adds it. Every process serves its own registry (never
the library's global one), so several services can share a test process.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref
from collections.abc import Iterable
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)

log = logging.getLogger(__name__)

PREFIX = "pdserve:"

# Seconds. Time to first token spans a warm GPU prefill (ms) to a long CPU prefill (minutes).
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
# Time per output token: a few ms on a GPU, up to seconds under load on a CPU.
ITL_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
E2E_BUCKETS_S = (
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
    20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
)  # fmt: skip
QUEUE_BUCKETS_S = (
    0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
# A KV transfer: a few blocks on loopback (sub-ms) to gigabytes across hosts (seconds).
TRANSFER_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
RPC_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip


def metric_name(name: str) -> str:
    return PREFIX + name


class RequestMetrics:
    """The per-request families every request-serving process exposes, for one model.

    Gateway: what the client sees. Workers: what their engine did with the requests it
    was handed (a prefill worker generates each request's first token only).
    """

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name"]
        self.model_name = model_name
        self.time_to_first_token = Histogram(
            metric_name("time_to_first_token_seconds"),
            "Time from a request's arrival here to its first token.",
            labels, registry=registry, buckets=TTFT_BUCKETS_S,
        ).labels(model_name)  # fmt: skip
        self.inter_token_latency = Histogram(
            metric_name("inter_token_latency_seconds"),
            "Time per output token after the first.",
            labels, registry=registry, buckets=ITL_BUCKETS_S,
        ).labels(model_name)  # fmt: skip
        self.e2e_request_latency = Histogram(
            metric_name("e2e_request_latency_seconds"),
            "Time from a request's arrival here to its last response.",
            labels, registry=registry, buckets=E2E_BUCKETS_S,
        ).labels(model_name)  # fmt: skip
        self.request_queue_time = Histogram(
            metric_name("request_queue_time_seconds"),
            "Time a request waited before its first model step.",
            labels, registry=registry, buckets=QUEUE_BUCKETS_S,
        ).labels(model_name)  # fmt: skip
        self.prompt_tokens = Counter(
            metric_name("prompt_tokens"), "Prompt tokens of the requests served.",
            labels, registry=registry,
        ).labels(model_name)  # fmt: skip
        self.generation_tokens = Counter(
            metric_name("generation_tokens"), "Tokens generated.", labels, registry=registry
        ).labels(model_name)
        self._success = Counter(
            metric_name("request_success"), "Requests finished, by finish reason.",
            [*labels, "finished_reason"], registry=registry,
        )  # fmt: skip

    def finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def observe_tokens(self, gap_s: float, num_tokens: int) -> None:
        """``num_tokens`` arrived ``gap_s`` after the previous ones: time per output token."""
        for _ in range(num_tokens):
            self.inter_token_latency.observe(gap_s / num_tokens)


class TokenTimes:
    """When one request's tokens came out, as its process records them: the first tokens
    as time to first token (from ``arrival``), every later one as time per output token
    (a burst of n after a gap g: n observations of g / n), and all in the token count. The
    gateway's relay and both workers record through this."""

    def __init__(self, metrics: RequestMetrics, arrival: float) -> None:
        self.metrics = metrics
        self.arrival = arrival
        self.first_at: float | None = None
        self.last_at = 0.0

    def tokens(self, count: int, now: float) -> None:
        if count <= 0:
            return
        if self.first_at is None:
            self.first_at = now
            self.metrics.time_to_first_token.observe(now - self.arrival)
        else:
            self.metrics.observe_tokens(now - self.last_at, count)
        self.last_at = now
        self.metrics.generation_tokens.inc(count)

    def ttft_ms(self, now: float) -> float:
        """Milliseconds to the first token (to ``now`` while none came)."""
        return ((self.first_at or now) - self.arrival) * 1000


class RedisHealth:
    """``redis_up`` (1 after the last call to Redis succeeded, 0 after it failed) and
    failures by operation."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.up = Gauge(
            metric_name("redis_up"), "1 when the last call to Redis succeeded.", registry=registry
        )
        self.errors = Counter(
            metric_name("redis_errors"), "Failed calls to Redis, by operation.",
            ["operation"], registry=registry,
        )  # fmt: skip

    def ok(self) -> None:
        self.up.set(1)

    def failed(self, operation: str) -> None:
        self.up.set(0)
        self.errors.labels(operation).inc()


# A collection of a few new objects (microseconds) to a full one over a large heap (100s of ms).
GC_BUCKETS_S = (
    0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip


# Every gc_pause_seconds histogram of this process; one gc callback feeds them all.
_gc_pause_histograms: weakref.WeakSet[Histogram] = weakref.WeakSet()
_gc_started_at: list[float] = []  # perf_counter() of the collection under way


def _on_gc(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _gc_started_at[:] = [time.perf_counter()]
    elif _gc_started_at:
        elapsed = time.perf_counter() - _gc_started_at.pop()
        for histogram in list(_gc_pause_histograms):
            histogram.labels(str(info["generation"])).observe(elapsed)


def gc_pause_histogram(registry: CollectorRegistry) -> Histogram:
    """``gc_pause_seconds`` by generation: how long each garbage collection held the GIL,
    which stops every thread of the process (the engine's too)."""
    histogram = Histogram(
        metric_name("gc_pause_seconds"),
        "Time each garbage collection stopped the process, by generation.",
        ["generation"], registry=registry, buckets=GC_BUCKETS_S,
    )  # fmt: skip
    _gc_pause_histograms.add(histogram)
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)
    return histogram


def process_registry() -> CollectorRegistry:
    """The registry a service process serves: its own metrics plus CPU, memory, file
    descriptors, GC (with pause times) and Python version, as every exporter shows. Turns
    off the ``*_created`` series process-wide (as vLLM does): they double the page for
    nothing."""
    disable_created_metrics()
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    gc_pause_histogram(registry)
    return registry


class MetricsServer:
    """The ``/metrics`` HTTP endpoint (prometheus_client's, on a thread of its own)."""

    def __init__(self, server: WSGIServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self.port = int(server.server_port)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(host: str, port: int, registry: CollectorRegistry) -> MetricsServer:
    """Serves ``registry`` at http://host:port/metrics; port 0 picks a free port.

    ``host`` may be bracketed IPv6 (``[::]``). Raises OSError when it cannot bind.
    """
    addr = host.strip("[]") or "0.0.0.0"
    server, thread = start_http_server(port, addr=addr, registry=registry)
    metrics = MetricsServer(server, thread)
    log.info("metrics at http://%s:%d/metrics", host, metrics.port)
    return metrics


class Samples:
    """A scraped ``/metrics`` page: every sample, queried like a PromQL ``sum``."""

    def __init__(self, samples: Iterable[tuple[str, dict[str, str], float]]) -> None:
        self.samples = list(samples)

    def sum(self, name: str, **labels: str) -> float:
        """Sum of ``name``'s samples whose labels include ``labels``; 0 when none."""
        return sum(
            value
            for sample_name, sample_labels, value in self.samples
            if sample_name == name and all(sample_labels.get(k) == v for k, v in labels.items())
        )

    def has(self, name: str) -> bool:
        return any(sample_name == name for sample_name, _, _ in self.samples)

    @classmethod
    def parse(cls, text: str) -> Samples:
        from prometheus_client.parser import text_string_to_metric_families

        return cls(
            (sample.name, dict(sample.labels), sample.value)
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        )


def scrape(url: str, timeout_s: float = 2.0) -> Samples:
    """Reads a ``/metrics`` page (for ``pdserve status`` and the tests)."""
    from urllib.request import urlopen

    with urlopen(url, timeout=timeout_s) as response:
        return Samples.parse(response.read().decode())
