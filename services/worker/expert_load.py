"""A MoE worker's view of its expert load between the engine and Redis / Prometheus.

Every publish interval the runtime reads the engine's cumulative counts once (the only
device-to-host copy) and hands them to ``ExpertLoadTracker``, which keeps what has not yet
reached Redis (so a failed publish is retried with the next one, not lost) and the load of
the trailing window behind the Prometheus gauges.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common.experts.counts import PHASES, ExpertCounts
from common.experts.stats import coefficient_of_variation, imbalance
from common.telemetry.metrics import metric_name


class ExpertLoadTracker:
    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.latest: ExpertCounts | None = None  # cumulative, as of the last observe
        self.published: ExpertCounts | None = None  # cumulative, as of the last publish
        self.window: ExpertCounts | None = None  # routed during the trailing window
        self._history: deque[tuple[float, ExpertCounts]] = deque()

    def observe(self, counts: ExpertCounts, now_s: float) -> None:
        """Records a cumulative snapshot taken at ``now_s`` (monotonic seconds)."""
        self.latest = counts
        self._history.append((now_s, counts))
        # The window starts at the newest snapshot at least window_s old; before the
        # worker has run that long, at its start (everything counted so far).
        start = now_s - self.window_s
        while len(self._history) > 1 and self._history[1][0] <= start:
            self._history.popleft()
        oldest_time, oldest = self._history[0]
        self.window = counts.minus(oldest if oldest_time <= start else None)

    def pending(self) -> ExpertCounts | None:
        """Tokens routed since the last successful publish."""
        return None if self.latest is None else self.latest.minus(self.published)

    def mark_published(self, counts: ExpertCounts) -> None:
        self.published = counts

    def layer_figures(self) -> list[tuple[int, float, float]]:
        """(layer, imbalance = max/mean, coefficient of variation) over the trailing window,
        both phases together; 0.0 for a layer that routed nothing in it."""
        window = self.window
        if window is None:
            return []
        return [
            (layer, imbalance(row), coefficient_of_variation(row))
            for slot, layer in enumerate(window.layers)
            for row in (window.layer_total(slot),)
        ]


class ExpertLoadCollector(Collector):
    """``pdserve:expert_load_imbalance`` and ``pdserve:expert_load_cv``, one series per
    MoE layer (bounded: layers, never experts). With ``per_expert``, also the counter
    ``pdserve:expert_tokens_routed_total{layer,expert,phase}`` (layers x experts x 2
    series: opt-in, for small models or short investigations)."""

    def __init__(self, model_name: str, tracker: ExpertLoadTracker, per_expert: bool) -> None:
        self.model_name = model_name
        self.tracker = tracker
        self.per_expert = per_expert

    def describe(self) -> Iterator[Metric]:
        return iter(self._families(describe=True))

    def collect(self) -> Iterator[Metric]:
        return iter(self._families(describe=False))

    def _families(self, describe: bool) -> list[Metric]:
        labels = ["model_name", "layer"]
        imbalance_family = GaugeMetricFamily(
            metric_name("expert_load_imbalance"),
            "Max over mean of the tokens routed per expert in this MoE layer over the "
            "trailing expert-load window (1 = even; 0 = nothing routed).",
            labels=labels,
        )
        cv_family = GaugeMetricFamily(
            metric_name("expert_load_cv"),
            "Coefficient of variation of the tokens routed per expert in this MoE layer over "
            "the trailing expert-load window.",
            labels=labels,
        )
        families: list[Metric] = [imbalance_family, cv_family]
        routed = None
        if self.per_expert:
            routed = CounterMetricFamily(
                metric_name("expert_tokens_routed"),
                "Tokens routed to each expert, by layer and phase (prefill, decode).",
                labels=["model_name", "layer", "expert", "phase"],
            )
            families.append(routed)
        if describe:
            return families
        for layer, ratio, cv in self.tracker.layer_figures():
            imbalance_family.add_metric([self.model_name, str(layer)], ratio)
            cv_family.add_metric([self.model_name, str(layer)], cv)
        latest = self.tracker.latest
        if routed is not None and latest is not None:
            for phase, name in enumerate(PHASES):
                for slot, layer in enumerate(latest.layers):
                    for expert, count in enumerate(latest.counts[phase][slot]):
                        routed.add_metric([self.model_name, str(layer), str(expert), name], count)
        return families
