"""Circuit breakers: stop sending to a peer that keeps failing, and probe it again later.

One breaker per peer. CLOSED: calls flow; each failure adds to a count of consecutive
failures and each success clears it; ``failure_threshold`` consecutive failures OPEN it.
OPEN: ``allows`` is false for ``cooldown_s``, then the breaker is HALF_OPEN. HALF_OPEN:
one call (the probe) is let through per ``cooldown_s``; its success CLOSES the breaker, its
failure OPENS it again for another ``cooldown_s``. A probe whose outcome never arrives (its
caller went away) does not wedge the breaker: the next probe is let through a cool-down
later.

What counts as a failure is the caller's call: a peer that answers, even with an error
about the request, is healthy; a peer that cannot be reached, resets the connection or
misses a per-hop deadline is not.

Not thread-safe: use from one event loop.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable

import grpc


class CircuitState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(
        self,
        failure_threshold: int = 3,
        cooldown_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[CircuitState, CircuitState], None] | None = None,
    ) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        if cooldown_s <= 0:
            raise ValueError(f"cooldown_s must be positive, got {cooldown_s}")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._on_change = on_change
        self._state = CircuitState.CLOSED
        self.consecutive_failures = 0
        self.num_opened = 0
        self._opened_at = 0.0
        self._next_probe_at = 0.0

    @property
    def state(self) -> CircuitState:
        if self._state is CircuitState.OPEN and self._clock() >= self._opened_at + self.cooldown_s:
            self._set(CircuitState.HALF_OPEN)
            self._next_probe_at = self._opened_at + self.cooldown_s
        return self._state

    def allows(self) -> bool:
        """Whether a call may go to the peer now (does not take the half-open probe)."""
        state = self.state
        if state is CircuitState.CLOSED:
            return True
        return state is CircuitState.HALF_OPEN and self._clock() >= self._next_probe_at

    def acquire(self) -> bool:
        """``allows``, and when half-open takes the one probe of this cool-down."""
        if not self.allows():
            return False
        if self._state is CircuitState.HALF_OPEN:
            self._next_probe_at = self._clock() + self.cooldown_s
        return True

    def success(self) -> None:
        self.consecutive_failures = 0
        if self.state is not CircuitState.CLOSED:
            self._set(CircuitState.CLOSED)

    def failure(self) -> None:
        self.consecutive_failures += 1
        state = self.state
        if state is CircuitState.HALF_OPEN or (
            state is CircuitState.CLOSED and self.consecutive_failures >= self.failure_threshold
        ):
            self._opened_at = self._clock()
            self.num_opened += 1
            self._set(CircuitState.OPEN)

    def _set(self, state: CircuitState) -> None:
        previous, self._state = self._state, state
        if previous is not state and self._on_change is not None:
            self._on_change(previous, state)


class BreakerSet:
    """A breaker per peer id, made on first use. ``on_change(peer, old, new)`` reports every
    transition (metrics, logs)."""

    def __init__(
        self,
        failure_threshold: int,
        cooldown_s: float,
        on_change: Callable[[str, CircuitState, CircuitState], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._on_change = on_change
        self._clock = clock
        self._breakers: dict[str, CircuitBreaker] = {}

    def get(self, peer: str) -> CircuitBreaker:
        breaker = self._breakers.get(peer)
        if breaker is None:

            def changed(old: CircuitState, new: CircuitState) -> None:
                if self._on_change is not None:
                    self._on_change(peer, old, new)

            breaker = self._breakers[peer] = CircuitBreaker(
                self.failure_threshold, self.cooldown_s, self._clock, changed
            )
        return breaker

    def allows(self, peer: str) -> bool:
        breaker = self._breakers.get(peer)
        return breaker is None or breaker.allows()

    def acquire(self, peer: str) -> bool:
        breaker = self._breakers.get(peer)
        return breaker is None or breaker.acquire()

    def success(self, peer: str) -> None:
        breaker = self._breakers.get(peer)
        if breaker is not None:
            breaker.success()

    def failure(self, peer: str) -> None:
        self.get(peer).failure()

    def not_closed(self) -> dict[str, CircuitBreaker]:
        """The peers being avoided or probed, by id."""
        return {
            peer: breaker
            for peer, breaker in self._breakers.items()
            if breaker.state is not CircuitState.CLOSED
        }

    def keep_only(self, peers: Iterable[str]) -> None:
        """Forgets closed breakers of peers no longer around (an open one is kept: a peer
        that comes back under the same id is still probed before it gets traffic)."""
        keep = set(peers)
        for peer in list(self._breakers):
            if peer not in keep and self._breakers[peer].state is CircuitState.CLOSED:
                del self._breakers[peer]


# Statuses that say the peer itself is unwell (unreachable, reset, crashed mid-call), as
# opposed to an answer about the request. DEADLINE_EXCEEDED counts only when the caller's
# own per-hop timeout ran out, which the caller knows and this table cannot.
PEER_FAILURE_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
)
