"""What the live planner would read from Prometheus over one interval, built from the
simulated requests: histograms with the real bucket bounds (TTFT and time per output token
from common/telemetry/metrics.py, lengths from ``LENGTH_BUCKETS``) and their exact sums, so
the planner sees the same resolution it sees live.

Observed as the gateway observes: a prompt's length and the cached part of it when it is
routed, its time to first token when that comes, its output length and its time per
output token after the first when it finishes (the token gaps of a request counted at
their mean: the histogram's mean, which is what the feedback reads, is the same).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from common.planner.types import LENGTH_BUCKETS, Distribution, LoadWindow
from common.telemetry.metrics import ITL_BUCKETS_S, TTFT_BUCKETS_S

TTFT_BUCKETS_MS = (*(b * 1000 for b in TTFT_BUCKETS_S), float("inf"))
ITL_BUCKETS_MS = (*(b * 1000 for b in ITL_BUCKETS_S), float("inf"))


class Histogram:
    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0.0] * len(self.bounds)
        self.sum = 0.0
        self.count = 0.0

    def observe(self, value: float, weight: float = 1.0) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += weight
        self.sum += value * weight
        self.count += weight

    def distribution(self) -> Distribution:
        if not self.count:
            return Distribution()
        return Distribution.from_buckets(self.bounds, self.counts).with_mean(self.sum / self.count)


class WindowRecorder:
    def __init__(self, start_s: float) -> None:
        self._reset(start_s)

    def _reset(self, start_s: float) -> None:
        self.start_s = start_s
        self.num_arrivals = 0
        self.prompt = Histogram(LENGTH_BUCKETS)
        self.output = Histogram(LENGTH_BUCKETS)
        self.ttft = Histogram(TTFT_BUCKETS_MS)
        self.itl = Histogram(ITL_BUCKETS_MS)
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def routed(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.num_arrivals += 1
        self.prompt.observe(prompt_tokens)
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens

    def first_token(self, ttft_ms: float) -> None:
        self.ttft.observe(ttft_ms)

    def finished(self, output_tokens: int, itl_ms: float) -> None:
        self.output.observe(output_tokens)
        if output_tokens > 1:
            self.itl.observe(itl_ms, output_tokens - 1)

    def window(self, end_s: float, num_waiting: int) -> LoadWindow:
        """This interval's window; the recorder starts the next one."""
        window = LoadWindow(
            start_s=self.start_s,
            end_s=end_s,
            num_arrivals=self.num_arrivals,
            prompt_tokens=self.prompt.distribution(),
            output_tokens=self.output.distribution(),
            prefix_hit_rate=self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            num_waiting=num_waiting,
            ttft_ms=self.ttft.distribution(),
            itl_ms=self.itl.distribution(),
        )
        self._reset(end_s)
        return window
