"""Circuit breakers: open after N consecutive failures, one probe per cool-down, close on a
probe's success; the gateway's set of them forgets closed breakers of departed workers."""

from __future__ import annotations

import pytest

from common.rpc.breaker import BreakerSet, CircuitBreaker, CircuitState


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_consecutive_failures_only() -> None:
    clock = Clock()
    breaker = CircuitBreaker(failure_threshold=3, cooldown_s=5.0, clock=clock)
    breaker.failure()
    breaker.failure()
    breaker.success()  # the run is broken: counting starts again
    breaker.failure()
    breaker.failure()
    assert breaker.state is CircuitState.CLOSED and breaker.allows()
    breaker.failure()
    assert breaker.state is CircuitState.OPEN
    assert not breaker.allows() and not breaker.acquire()
    assert breaker.num_opened == 1


def test_half_open_lets_one_probe_per_cooldown_and_its_success_closes() -> None:
    clock = Clock()
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=5.0, clock=clock)
    breaker.failure()
    clock.now += 4.9
    assert not breaker.allows()
    clock.now += 0.2
    assert breaker.state is CircuitState.HALF_OPEN
    assert breaker.acquire()  # the probe
    assert not breaker.allows() and not breaker.acquire()  # one at a time
    clock.now += 5.0  # the probe's outcome never came: another one may go
    assert breaker.acquire()
    breaker.success()
    assert breaker.state is CircuitState.CLOSED and breaker.allows()
    assert breaker.consecutive_failures == 0


def test_a_failed_probe_opens_it_again() -> None:
    clock = Clock()
    changes: list[tuple[CircuitState, CircuitState]] = []
    breaker = CircuitBreaker(2, 1.0, clock=clock, on_change=lambda a, b: changes.append((a, b)))
    breaker.failure()
    breaker.failure()
    clock.now += 1.0
    assert breaker.acquire()
    breaker.failure()
    assert breaker.state is CircuitState.OPEN and not breaker.allows()
    assert changes == [
        (CircuitState.CLOSED, CircuitState.OPEN),
        (CircuitState.OPEN, CircuitState.HALF_OPEN),
        (CircuitState.HALF_OPEN, CircuitState.OPEN),
    ]


def test_rejects_nonsense_settings() -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(failure_threshold=0)
    with pytest.raises(ValueError):
        CircuitBreaker(cooldown_s=0)


def test_breaker_set_per_peer_and_forgets_closed_departed_peers() -> None:
    clock = Clock()
    seen: list[tuple[str, CircuitState]] = []
    breakers = BreakerSet(
        1, 2.0, on_change=lambda peer, old, new: seen.append((peer, new)), clock=clock
    )
    assert breakers.allows("a") and breakers.acquire("a")  # unknown peers are fine
    breakers.success("a")  # no breaker made for a success
    breakers.failure("b")
    breakers.failure("c")
    breakers.success("c")
    assert not breakers.allows("b") and breakers.allows("c")
    assert set(breakers.not_closed()) == {"b"}
    assert seen == [("b", CircuitState.OPEN), ("c", CircuitState.OPEN), ("c", CircuitState.CLOSED)]
    breakers.keep_only([])  # b stays: it is still open, and must be probed if it returns
    assert set(breakers.not_closed()) == {"b"}
    clock.now += 2.0
    breakers.success("b")
    breakers.keep_only([])
    assert breakers.not_closed() == {} and breakers.allows("b")
