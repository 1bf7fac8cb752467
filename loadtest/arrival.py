"""When each request is sent: an open-loop schedule of send offsets (seconds from the start).

Gaps between sends are gamma-distributed with shape ``burstiness`` and mean ``1 / rate``
(burstiness 1 is a Poisson process; below 1 burstier, above 1 more even, infinity a
fixed gap). The gaps are then rescaled so that the last send lands exactly at N / R: the
offered load of a run is the configured one, not the one a short random draw happened to
give, so runs with different seeds compare.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(
    num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Send offsets in seconds, non-decreasing, the last one at ``num_requests / rate``
    (all zero for an infinite rate)."""
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (or inf), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if num_requests == 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if math.isinf(burstiness):
        gaps = np.full(num_requests, 1.0 / request_rate)
    else:
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(
            shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests
        )
    offsets = np.cumsum(gaps)
    target_s = num_requests / request_rate
    if offsets[-1] > 0:
        offsets *= target_s / offsets[-1]
    return [float(t) for t in offsets]


def trace_offsets(timestamps_ms: list[float], speedup_ratio: float = 1.0) -> list[float]:
    """A recorded trace's send offsets: its timestamps relative to the first, divided by the
    clock speed-up."""
    if not speedup_ratio > 0:
        raise ValueError(f"speedup ratio must be > 0, got {speedup_ratio}")
    if not timestamps_ms:
        return []
    start = timestamps_ms[0]
    return [(t - start) / 1000.0 / speedup_ratio for t in timestamps_ms]
