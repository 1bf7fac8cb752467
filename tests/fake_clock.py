"""A monotonic clock a test moves by hand. Code that takes ``clock=`` (the circuit breakers,
the gateway's index health and worker directory, the block store's put expiry) reads it, so
a test steps over a cool-down or a retry interval instead of sleeping through it."""

from __future__ import annotations


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
