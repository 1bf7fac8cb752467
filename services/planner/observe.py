"""What the planner sees of the live fleet each interval: the gateways' own Prometheus
metrics, differenced between two reads, and the worker registry in Redis.

From every gateway in the registry (its ``metrics_port``), per interval:

| LoadWindow field | from |
|---|---|
| num_arrivals, prompt_tokens | ``pdserve:request_prompt_tokens`` (a histogram observed as each request is routed) |
| output_tokens | ``pdserve:request_generation_tokens`` (observed as each request ends) |
| prefix_hit_rate | ``pdserve:prefix_cache_hits_total`` / ``pdserve:prefix_cache_queries_total`` |
| ttft_ms | ``pdserve:time_to_first_token_seconds`` |
| itl_ms | ``pdserve:request_time_per_output_token_seconds`` (each request's mean) |

and num_waiting from the engine workers' registry entries. A histogram's interval is its
buckets' differences, read as a distribution whose mean is the exact ``_sum / _count``
(``Distribution.with_mean``). A gateway whose counters went down restarted: its whole
count is the interval's. Gateways summed: several serve one fleet.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from common.index.registry import WorkerInfo, WorkerRegistry
from common.planner.types import ENGINE_ROLES, PREFILL, Distribution, LoadWindow, Split
from common.telemetry.metrics import Samples, scrape

log = logging.getLogger(__name__)

PROMPT_TOKENS = "pdserve:request_prompt_tokens"
OUTPUT_TOKENS = "pdserve:request_generation_tokens"
TTFT = "pdserve:time_to_first_token_seconds"
TPOT = "pdserve:request_time_per_output_token_seconds"
HITS = "pdserve:prefix_cache_hits_total"
QUERIES = "pdserve:prefix_cache_queries_total"
COUNTERS = (HITS, QUERIES)
HISTOGRAMS = (PROMPT_TOKENS, OUTPUT_TOKENS, TTFT, TPOT)

Scrape = Callable[[str], Awaitable[Samples]]


async def scrape_async(url: str) -> Samples:
    return await asyncio.to_thread(scrape, url)


@dataclass(frozen=True)
class Histogram:
    """One histogram's totals: bucket upper bounds with their cumulative counts, sum, count."""

    bounds: tuple[float, ...] = ()
    cumulative: tuple[float, ...] = ()
    total: float = 0.0
    count: float = 0.0

    @classmethod
    def read(cls, samples: Samples, name: str) -> Histogram:
        """Summed over every label set but ``le``."""
        buckets: dict[float, float] = {}
        for sample_name, labels, value in samples.samples:
            if sample_name == f"{name}_bucket":
                bound = float(labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + value
        bounds = tuple(sorted(buckets))
        return cls(
            bounds,
            tuple(buckets[b] for b in bounds),
            samples.sum(f"{name}_sum"),
            samples.sum(f"{name}_count"),
        )

    def since(self, before: Histogram | None) -> Histogram:
        """This interval's part: the difference with ``before`` (all of it after a restart
        or a change of buckets)."""
        if before is None or before.bounds != self.bounds or self.count < before.count:
            return self
        return Histogram(
            self.bounds,
            tuple(a - b for a, b in zip(self.cumulative, before.cumulative, strict=True)),
            self.total - before.total,
            self.count - before.count,
        )

    def distribution(self, scale: float = 1.0) -> Distribution:
        """Per-bucket counts as a distribution (values times ``scale``: seconds to ms)."""
        if self.count <= 0:
            return Distribution()
        per_bucket = [
            c - (self.cumulative[i - 1] if i else 0.0) for i, c in enumerate(self.cumulative)
        ]
        bounds = [b * scale if not math.isinf(b) else b for b in self.bounds]
        return Distribution.from_buckets(bounds, per_bucket).with_mean(
            scale * self.total / self.count
        )


@dataclass
class _GatewayReading:
    histograms: dict[str, Histogram]
    counters: dict[str, float]


@dataclass
class Fleet:
    """The engine workers serving the model, as the registry lists them."""

    workers: list[WorkerInfo] = field(default_factory=list)

    @property
    def split(self) -> Split | None:
        """Prefill workers, and decode workers (those in both count as decode: they take
        decode calls and prefill what they decode); None with no decode worker."""
        live = [w for w in self.workers if not w.draining]
        prefill = sum(w.role == PREFILL for w in live)
        decode = sum(w.role != PREFILL for w in live)
        return Split(prefill, decode) if decode else None

    @property
    def num_waiting(self) -> int:
        return sum(w.num_waiting for w in self.workers)


class LoadObserver:
    def __init__(
        self,
        registry: WorkerRegistry,
        model: str,
        scrape_metrics: Scrape = scrape_async,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry
        self.model = model
        self.scrape = scrape_metrics
        self.clock = clock
        self._last: dict[str, _GatewayReading] = {}  # gateway id -> its last reading
        self._last_at: float | None = None

    async def fleet(self) -> Fleet:
        return self._fleet(await self.registry.list())

    def _fleet(self, workers: list[WorkerInfo]) -> Fleet:
        engine = [w for w in workers if w.role in ENGINE_ROLES and w.model == self.model]
        return Fleet(sorted(engine, key=lambda w: w.worker_id))

    async def observe(self) -> tuple[LoadWindow | None, Fleet]:
        """The interval since the last call (None on the first: there is nothing to
        difference yet), and the fleet now."""
        workers = await self.registry.list()
        now = self.clock()
        gateways = [w for w in workers if w.role == "gateway" and w.metrics_port]
        readings = await asyncio.gather(*(self._read(g) for g in gateways))
        fleet = self._fleet(workers)
        window = None
        if self._last_at is not None:
            window = self._window(self._last_at, now, gateways, readings, fleet)
        self._last = {
            g.worker_id: r for g, r in zip(gateways, readings, strict=True) if r is not None
        }
        self._last_at = now
        return window, fleet

    async def _read(self, gateway: WorkerInfo) -> _GatewayReading | None:
        url = f"http://{gateway.host}:{gateway.metrics_port}/metrics"
        try:
            samples = await self.scrape(url)
        except (OSError, ValueError) as exc:
            log.warning("cannot read gateway %s's metrics at %s: %s", gateway.worker_id, url, exc)
            return None
        return _GatewayReading(
            {name: Histogram.read(samples, name) for name in HISTOGRAMS},
            {name: samples.sum(name) for name in COUNTERS},
        )

    def _window(
        self,
        start: float,
        end: float,
        gateways: list[WorkerInfo],
        readings: list[_GatewayReading | None],
        fleet: Fleet,
    ) -> LoadWindow:
        parts: dict[str, list[Histogram]] = {name: [] for name in HISTOGRAMS}
        hits = queries = 0.0
        for gateway, reading in zip(gateways, readings, strict=True):
            if reading is None:
                continue
            before = self._last.get(gateway.worker_id)
            for name in HISTOGRAMS:
                parts[name].append(
                    reading.histograms[name].since(before.histograms[name] if before else None)
                )
            counted = reading.counters
            if before is not None and counted[QUERIES] >= before.counters[QUERIES]:
                counted = {n: counted[n] - before.counters[n] for n in COUNTERS}
            hits += counted[HITS]
            queries += counted[QUERIES]
        merged = {name: _merge(hs) for name, hs in parts.items()}
        return LoadWindow(
            start_s=start,
            end_s=end,
            num_arrivals=round(merged[PROMPT_TOKENS].count),
            prompt_tokens=merged[PROMPT_TOKENS].distribution(),
            output_tokens=merged[OUTPUT_TOKENS].distribution(),
            prefix_hit_rate=hits / queries if queries > 0 else 0.0,
            num_waiting=fleet.num_waiting,
            ttft_ms=merged[TTFT].distribution(scale=1000.0),
            itl_ms=merged[TPOT].distribution(scale=1000.0),
        )


def _merge(histograms: list[Histogram]) -> Histogram:
    """Several gateways' intervals of one histogram (same buckets: the same code)."""
    present = [h for h in histograms if h.bounds]
    if not present:
        return Histogram()
    bounds = present[0].bounds
    same = [h for h in present if h.bounds == bounds]
    return Histogram(
        bounds,
        tuple(sum(h.cumulative[i] for h in same) for i in range(len(bounds))),
        sum(h.total for h in same),
        sum(h.count for h in same),
    )
