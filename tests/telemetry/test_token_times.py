"""TokenTimes (common/telemetry/metrics.py): the one place a process turns its request's
token arrivals into time to first token, time per output token and the token count."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from common.telemetry.metrics import RequestMetrics, TokenTimes


def sample(registry: CollectorRegistry, name: str, suffix: str) -> float:
    value = registry.get_sample_value(f"pdserve:{name}{suffix}", {"model_name": "m"})
    return 0.0 if value is None else value


def test_first_tokens_are_ttft_and_a_burst_shares_its_gap() -> None:
    registry = CollectorRegistry()
    times = TokenTimes(RequestMetrics(registry, "m"), arrival=10.0)
    times.tokens(0, 10.1)  # nothing came: nothing recorded, the first token is still ahead
    assert times.first_at is None and times.ttft_ms(10.2) == pytest.approx(200.0)
    times.tokens(1, 10.5)
    times.tokens(3, 10.8)  # a burst of 3 (speculation) 0.3 s later: 3 x 0.1 s per token
    times.tokens(1, 10.9)
    assert sample(registry, "time_to_first_token_seconds", "_count") == 1
    assert sample(registry, "time_to_first_token_seconds", "_sum") == pytest.approx(0.5)
    assert sample(registry, "inter_token_latency_seconds", "_count") == 4
    assert sample(registry, "inter_token_latency_seconds", "_sum") == pytest.approx(0.4)
    assert sample(registry, "generation_tokens", "_total") == 5
    assert times.ttft_ms(99.0) == pytest.approx(500.0)
