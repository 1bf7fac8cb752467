"""The event loop: a heap of (time, sequence, callback, argument); the sequence keeps events
at equal times in the order they were scheduled, so a run is deterministic."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from itertools import count
from typing import Any


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._seq = count()

    def at(self, when: float, callback: Callable[[Any], None], arg: Any = None) -> None:
        assert when >= self.now - 1e-9, f"event at {when} scheduled in the past ({self.now})"
        heapq.heappush(self._heap, (max(when, self.now), next(self._seq), callback, arg))

    def run_until(self, end: float) -> None:
        """Runs every event at or before ``end``; the clock then reads ``end``."""
        heap = self._heap
        while heap and heap[0][0] <= end:
            when, _, callback, arg = heapq.heappop(heap)
            self.now = when
            callback(arg)
        self.now = max(self.now, end)

    @property
    def pending(self) -> int:
        return len(self._heap)
