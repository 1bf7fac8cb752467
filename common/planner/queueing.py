"""Queueing formulas the performance model is built from.

A wait is described by ``Wait``: with probability ``1 - p_wait`` none; otherwise
exponential with mean ``mean_if_waiting_ms``; everything shifted by ``fixed_ms`` (the queue
an overloaded pool builds over the planning horizon). M/M/c waits are exactly this shape;
for general service times the Allen-Cunneen approximation scales the M/M/c wait by
``(1 + cs^2) / 2`` (cs: the coefficient of variation of service times), which is what lets a
few long prompts lengthen every prompt's queue.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Wait:
    p_wait: float = 0.0
    mean_if_waiting_ms: float = 0.0
    fixed_ms: float = 0.0

    @property
    def mean_ms(self) -> float:
        return self.fixed_ms + self.p_wait * self.mean_if_waiting_ms

    def cdf(self, t_ms: np.ndarray) -> np.ndarray:
        """P(wait <= t) for each t."""
        shifted = t_ms - self.fixed_ms
        if self.p_wait <= 0 or self.mean_if_waiting_ms <= 0:
            return np.where(shifted >= 0, 1.0, 0.0)
        tail = self.p_wait * np.exp(-np.maximum(shifted, 0.0) / self.mean_if_waiting_ms)
        return np.where(shifted >= 0, 1.0 - tail, 0.0)


def erlang_b(servers: int, offered: float) -> float:
    """Erlang's loss formula: the probability that all ``servers`` are busy in M/G/c/c with
    ``offered = lambda x mean holding time`` (insensitive to the holding time's law)."""
    b = 1.0
    for k in range(1, servers + 1):
        b = offered * b / (k + offered * b)
    return b


def erlang_c(servers: int, offered: float) -> float:
    """The probability that an arrival waits in M/M/c with ``offered = lambda / mu``
    (requires offered < servers); Erlang B by its stable recursion, then C from B."""
    if offered <= 0:
        return 0.0
    assert offered < servers, f"erlang_c needs offered < servers, got {offered} >= {servers}"
    b = 1.0
    for k in range(1, servers + 1):
        b = offered * b / (k + offered * b)
    return servers * b / (servers - offered * (1 - b))


def mgc_wait(
    rate_per_s: float, mean_service_ms: float, scv: float, servers: int, horizon_s: float
) -> tuple[Wait, float]:
    """The queueing delay before service in an M/G/c queue, and its utilization.

    ``scv``: squared coefficient of variation of service times. At utilization >= 1 the
    queue grows through the horizon: arrivals wait on average ``(rho - 1) * horizon / 2``
    more than they would at the edge of stability (a fixed delay, so overload is priced by
    how far over it is, not as infinity)."""
    if rate_per_s <= 0 or mean_service_ms <= 0:
        return Wait(), 0.0
    offered = rate_per_s * mean_service_ms / 1000
    rho = offered / servers
    if rho >= 1:
        edge, _ = mgc_wait(rate_per_s / rho * 0.98, mean_service_ms, scv, servers, horizon_s)
        overload_ms = (rho - 1) / rho * horizon_s * 1000 / 2
        return Wait(edge.p_wait, edge.mean_if_waiting_ms, edge.fixed_ms + overload_ms), rho
    p_wait = erlang_c(servers, offered)
    # Conditional M/M/c wait: exponential with mean 1 / (c mu - lambda).
    mean_if_waiting_ms = 1000 / (servers * 1000 / mean_service_ms - rate_per_s)
    return Wait(p_wait, mean_if_waiting_ms * (1 + scv) / 2), rho


def binomial_cdf_table(n: int, p: float) -> np.ndarray:
    """[n + 1] P(X <= k) for X ~ Binomial(n, p), k = 0..n: exact for n <= 400, else the
    normal law with continuity correction."""
    ks = np.arange(n + 1, dtype=float)
    if p <= 0:
        return np.ones(n + 1)
    if p >= 1:
        return np.where(ks >= n, 1.0, 0.0)
    if n <= 400:
        log_pmf = (
            np.array([math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) for k in ks])
            + ks * math.log(p)
            + (n - ks) * math.log1p(-p)
        )
        return np.minimum(np.cumsum(np.exp(log_pmf)), 1.0)
    mean, sd = n * p, math.sqrt(n * p * (1 - p))
    z = (ks + 0.5 - mean) / (sd * math.sqrt(2))
    return 0.5 * (1 + np.array([math.erf(x) for x in z]))


def table_at(table: np.ndarray, k: np.ndarray) -> np.ndarray:
    """P(X <= k) from ``binomial_cdf_table``'s table, for real k (floored; < 0 gives 0)."""
    index = np.floor(np.minimum(k, len(table) - 1)).astype(int)
    return np.where(index < 0, 0.0, table[np.maximum(index, 0)])
