"""The gateway's worker directory when Redis fails: the last list read keeps serving,
Redis is retried at most every retry_s, and right after it returns (empty until every
worker heartbeats again) the workers known before stay listed for the recovery grace."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from common.errors import UnavailableError
from common.index.registry import WorkerInfo
from services.gateway.directory import WorkerDirectory
from services.gateway.health import IndexHealth
from services.gateway.metrics import GatewayMetrics
from tests.fake_clock import FakeClock


class FlakyRegistry:
    def __init__(self) -> None:
        self.workers: list[WorkerInfo] = []
        self.down = False
        self.reads = 0

    async def list(self, role: str | None = None) -> list[WorkerInfo]:
        self.reads += 1
        if self.down:
            raise ConnectionError("Redis is down")
        return list(self.workers)


def worker(worker_id: str, role: str = "decode") -> WorkerInfo:
    return WorkerInfo(worker_id, role, f"{worker_id}:1", "m")


def ids(workers: list[WorkerInfo]) -> list[str]:
    return sorted(w.worker_id for w in workers)


def make(
    retry_s: float = 0.05, grace_s: float = 0.3, clock: FakeClock | None = None
) -> tuple[FlakyRegistry, WorkerDirectory, GatewayMetrics]:
    clock = clock or FakeClock()
    registry = FlakyRegistry()
    metrics = GatewayMetrics(CollectorRegistry(), "m")
    health = IndexHealth(metrics, retry_s=retry_s, clock=clock)
    directory = WorkerDirectory(registry, 0.0, health, recovery_grace_s=grace_s, clock=clock)  # type: ignore[arg-type]
    return registry, directory, metrics


def gauge(metrics: GatewayMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name)
    assert value is not None
    return value


def test_never_read_is_unavailable() -> None:
    registry, directory, _ = make()
    registry.down = True
    with pytest.raises(UnavailableError, match="cannot be read"):
        asyncio.run(directory.workers())


def test_outage_serves_the_last_list_and_retries_sparingly() -> None:
    async def body() -> None:
        clock = FakeClock()
        registry, directory, metrics = make(retry_s=0.2, clock=clock)
        registry.workers = [worker("d0"), worker("p0", "prefill")]
        assert ids(await directory.workers()) == ["d0", "p0"]
        assert gauge(metrics, "pdserve:index_available") == 1
        registry.down = True
        assert ids(await directory.workers()) == ["d0", "p0"]
        assert gauge(metrics, "pdserve:index_available") == 0
        assert directory.health is not None and not directory.health.available
        assert "Redis is down" in directory.health.error
        reads = registry.reads
        for _ in range(20):  # many requests within retry_s: Redis is not asked again
            assert ids(await directory.by_role("decode", "m")) == ["d0"]
        assert registry.reads == reads
        clock.advance(0.25)
        await directory.workers()
        assert registry.reads == reads + 1

    asyncio.run(body())


def test_after_recovery_known_workers_stay_for_the_grace() -> None:
    async def body() -> None:
        clock = FakeClock()
        registry, directory, metrics = make(retry_s=0.0, grace_s=0.3, clock=clock)
        registry.workers = [worker("d0"), worker("d1")]
        await directory.workers()
        registry.down = True
        await directory.workers()
        registry.down = False
        registry.workers = [worker("d1")]  # Redis restarted: d0 has not heartbeated yet
        assert ids(await directory.workers()) == ["d0", "d1"]
        assert gauge(metrics, "pdserve:index_available") == 1
        clock.advance(0.35)
        assert ids(await directory.workers()) == ["d1"]  # d0 never came back: it is gone

    asyncio.run(body())


def test_a_worker_that_stops_heartbeating_leaves_at_once_without_an_outage() -> None:
    async def body() -> None:
        registry, directory, _ = make()
        registry.workers = [worker("d0"), worker("d1")]
        await directory.workers()
        registry.workers = [worker("d1")]  # d0's entry expired
        assert ids(await directory.workers()) == ["d1"]

    asyncio.run(body())


def test_by_role_lists_workers_in_both_roles_for_either_call() -> None:
    registry, directory, _ = make()
    registry.workers = [worker("p0", "prefill"), worker("d0", "decode"), worker("b0", "both"),
                        worker("s0", "blockstore")]  # fmt: skip
    registry.workers.append(WorkerInfo("b1", "both", "b1:1", "m", draining=True))

    async def body() -> None:
        assert ids(await directory.by_role("prefill", "m")) == ["b0", "p0"]
        assert ids(await directory.by_role("decode", "m")) == ["b0", "d0"]
        assert await directory.by_role("decode", "other-model") == []

    asyncio.run(body())
