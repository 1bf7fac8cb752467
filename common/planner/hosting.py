"""How workers share a host's cores.

A profile is measured on an otherwise idle host. When ``workers_per_host`` workers of
``threads_per_worker`` threads each share ``cores_per_host`` cores and k of them compute at
once, each gets its share of the cores (processor sharing): its speed, relative to running
alone, is ``min(1, cores / (k * threads)) / min(1, cores / threads)``. This machine: 2 cores,
2 workers of 2 threads: a worker computing alongside another runs at half speed. At cluster
scale every worker has cores of its own (``cores_per_host = 0``) and nothing is shared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Hosting:
    cores_per_host: int = 0  # 0: every worker has its own cores
    threads_per_worker: int = 1
    workers_per_host: int = 1

    def __post_init__(self) -> None:
        if self.cores_per_host < 0 or self.threads_per_worker < 1 or self.workers_per_host < 1:
            raise ValueError(
                f"hosting needs cores >= 0, threads >= 1 and workers per host >= 1, got {self}"
            )

    @property
    def shared(self) -> bool:
        """True when workers busy at once slow each other down."""
        return (
            self.cores_per_host > 0
            and self.workers_per_host > 1
            and self.workers_per_host * self.threads_per_worker > self.cores_per_host
        )

    def speed(self, num_busy: int) -> float:
        """Speed of each of ``num_busy`` workers computing at once on one host, relative to
        one computing alone."""
        if not self.shared or num_busy <= 1:
            return 1.0
        alone = min(1.0, self.cores_per_host / self.threads_per_worker)
        return min(1.0, self.cores_per_host / (num_busy * self.threads_per_worker)) / alone

    def mean_speed(self, busy_share_of_others: float, num_workers: int) -> float:
        """A busy worker's expected speed when each of its host mates is busy with
        probability ``busy_share_of_others`` (independently); ``num_workers`` caps the mates
        when the whole fleet is smaller than a host."""
        if not self.shared:
            return 1.0
        mates = min(self.workers_per_host, max(num_workers, 1)) - 1
        p = min(max(busy_share_of_others, 0.0), 1.0)
        total = 0.0
        for k in range(mates + 1):
            total += math.comb(mates, k) * p**k * (1 - p) ** (mates - k) * self.speed(1 + k)
        return total
