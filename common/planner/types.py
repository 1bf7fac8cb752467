"""The planner's vocabulary, shared by the planner process (services/planner), its policy
(common/planner) and the simulator (``pdserve bench plan-sim``).

- ``Targets``: the SLA: a request meets it when its time to first token is within
  ``ttft_ms`` and its mean time per output token after the first within ``itl_ms``.
- ``Split``: how many engine workers hold each role. ``prefill == 0`` is colocated: every
  decode worker prefills the prompts it decodes.
- ``Distribution``: a weighted sample of a length or a latency (request values in the
  simulator, Prometheus histogram buckets in the live planner), so the policy sees the
  shape of the load, not only its mean.
- ``LoadWindow``: what one planning interval observed.
- ``Decision``: what the policy wants next, with what it predicts and why.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

# Prometheus bucket bounds (le) for the histograms of prompt and output lengths in tokens
# that the planner reads (the gateway's, and the simulator's windows): powers of two with
# their 1.5x between, so a bucket's middle is within 20 % of any length in it.
LENGTH_BUCKETS = (
    1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536,
    2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768, 49152, 65536, 98304, 131072,
    math.inf,
)  # fmt: skip

PREFILL = "prefill"
DECODE = "decode"
BOTH = "both"
ENGINE_ROLES = (PREFILL, DECODE, BOTH)


@dataclass(frozen=True)
class Targets:
    ttft_ms: float
    itl_ms: float

    def __post_init__(self) -> None:
        if not (self.ttft_ms > 0 and self.itl_ms > 0):
            raise ValueError(
                f"SLA targets must be positive, got ttft {self.ttft_ms} ms, itl {self.itl_ms} ms"
            )

    def met(self, ttft_ms: float, itl_ms: float) -> bool:
        return ttft_ms <= self.ttft_ms and itl_ms <= self.itl_ms


@dataclass(frozen=True, order=True)
class Split:
    prefill: int
    decode: int

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 1:
            raise ValueError(f"a split needs prefill >= 0 and decode >= 1, got {self}")

    @property
    def total(self) -> int:
        return self.prefill + self.decode

    @property
    def colocated(self) -> bool:
        return self.prefill == 0

    def __str__(self) -> str:
        return f"{self.prefill}P+{self.decode}D"


@dataclass(frozen=True)
class Distribution:
    """Values with weights (counts), kept sorted by value."""

    values: tuple[float, ...] = ()
    weights: tuple[float, ...] = ()

    @classmethod
    def of(cls, values: Iterable[float], weights: Iterable[float] | None = None) -> Distribution:
        vs = list(values)
        ws = [1.0] * len(vs) if weights is None else list(weights)
        if len(ws) != len(vs):
            raise ValueError("one weight per value")
        pairs = sorted((v, w) for v, w in zip(vs, ws, strict=True) if w > 0)
        return cls(tuple(v for v, _ in pairs), tuple(w for _, w in pairs))

    @classmethod
    def from_buckets(cls, upper_bounds: Iterable[float], counts: Iterable[float]) -> Distribution:
        """A Prometheus histogram's per-bucket counts (not cumulative) as values: each bucket
        at the middle of its bounds, the open last bucket (+Inf) at its lower bound."""
        values, weights = [], []
        lower = 0.0
        for upper, count in zip(upper_bounds, counts, strict=True):
            if count > 0:
                values.append(lower if math.isinf(upper) else (lower + upper) / 2)
                weights.append(count)
            if not math.isinf(upper):
                lower = upper
        return cls.of(values, weights)

    def compact(self, max_values: int = 0) -> Distribution:
        """Equal values merged; with ``max_values``, at most that many values: runs of
        neighbouring values of about equal weight, each at its weighted mean (the mean is
        kept exactly)."""
        merged: dict[float, float] = {}
        for v, w in zip(self.values, self.weights, strict=True):
            merged[v] = merged.get(v, 0.0) + w
        values, weights = list(merged), list(merged.values())
        if not max_values or len(values) <= max_values:
            return Distribution(tuple(values), tuple(weights))
        share = sum(weights) / max_values
        groups: list[tuple[float, float]] = []
        mass = moment = 0.0
        for v, w in zip(values, weights, strict=True):
            mass += w
            moment += v * w
            if mass >= share * (1 - 1e-9):
                groups.append((moment / mass, mass))
                mass = moment = 0.0
        if mass > 0:
            groups.append((moment / mass, mass))
        return Distribution(tuple(v for v, _ in groups), tuple(w for _, w in groups))

    def with_mean(self, mean: float) -> Distribution:
        """The values scaled so that their mean is ``mean``: a histogram's bucket middles
        corrected by its exact ``_sum / _count``."""
        current = self.mean()
        if current <= 0 or mean <= 0:
            return self
        factor = mean / current
        return Distribution(tuple(v * factor for v in self.values), self.weights)

    @property
    def total_weight(self) -> float:
        return float(sum(self.weights))

    @property
    def empty(self) -> bool:
        return not self.values

    def mean(self) -> float:
        total = self.total_weight
        if not total:
            return 0.0
        return sum(v * w for v, w in zip(self.values, self.weights, strict=True)) / total

    def quantile(self, q: float) -> float:
        if not self.values:
            return 0.0
        cumulative = []
        running = 0.0
        for w in self.weights:
            running += w
            cumulative.append(running)
        index = bisect.bisect_left(cumulative, q * running)
        return self.values[min(index, len(self.values) - 1)]

    def blend(self, other: Distribution, weight_of_other: float) -> Distribution:
        """This distribution and ``other`` mixed, ``other`` making up ``weight_of_other`` of
        the mass (an exponential moving average over windows)."""
        if self.empty:
            return other
        if other.empty:
            return self
        mine, theirs = self.total_weight, other.total_weight
        keep = (1 - weight_of_other) / mine
        take = weight_of_other / theirs
        return Distribution.of(
            [*self.values, *other.values],
            [*(w * keep for w in self.weights), *(w * take for w in other.weights)],
        )


@dataclass(frozen=True)
class LoadWindow:
    """One planning interval's observations."""

    start_s: float
    end_s: float
    num_arrivals: int
    prompt_tokens: Distribution = field(default_factory=Distribution)
    output_tokens: Distribution = field(default_factory=Distribution)
    prefix_hit_rate: float = 0.0  # share of prompt tokens served from a prefix cache
    num_waiting: int = 0  # requests queued on the engine workers at the end
    ttft_ms: Distribution = field(default_factory=Distribution)  # as the gateways measured
    itl_ms: Distribution = field(default_factory=Distribution)

    @property
    def seconds(self) -> float:
        return max(self.end_s - self.start_s, 1e-9)

    @property
    def arrival_rate(self) -> float:
        return self.num_arrivals / self.seconds


@dataclass(frozen=True)
class Decision:
    split: Split  # what the policy wants now (the current split when it holds)
    predicted_ttft_ms: float
    predicted_itl_ms: float
    targets_met: bool  # the split is predicted to meet both targets
    reason: str  # why this split, in words (logged and put on the span)
    changed: bool = False  # differs from the split in force
