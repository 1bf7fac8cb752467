"""The planner process's parts against fakes: the load it reads from gateway metrics (two
scrapes differenced, restarts, several gateways), the local connector's choice of which
workers change role and what it starts and stops, and one interval end to end (observe,
decide, apply, record) including a connector that fails."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from common.index.registry import WorkerInfo
from common.planner.profile import ProfileKey, WorkerProfile
from common.planner.types import Split, Targets
from common.rpc.channels import ChannelPool
from common.telemetry.metrics import Samples
from loadtest.plan_sim.profiles import cpu_profile
from services.gateway.metrics import GatewayMetrics
from services.planner.config import PlannerServiceConfig
from services.planner.connectors import ConnectorError
from services.planner.connectors.local import LocalConnector
from services.planner.loop import PlannerLoop
from services.planner.metrics import PlannerMetrics
from services.planner.observe import Fleet, LoadObserver
from tests.fake_clock import FakeClock


class FakeRegistry:
    def __init__(self, workers: list[WorkerInfo]) -> None:
        self.workers = workers

    async def list(self, role: str | None = None) -> list[WorkerInfo]:
        return list(self.workers)


def gateway(worker_id: str, metrics_port: int) -> WorkerInfo:
    return WorkerInfo(worker_id, "gateway", "127.0.0.1:1", "m", metrics_port=metrics_port)


def engine(worker_id: str, role: str, running: int = 0, since: int = 0, **kw: Any) -> WorkerInfo:
    return WorkerInfo(
        worker_id, role, f"{worker_id}:1", "m", num_running=running, role_since_unix_ms=since,
        **kw,
    )  # fmt: skip


class Gateways:
    """Real gateway metrics (GatewayMetrics), scraped as text, per metrics port."""

    def __init__(self) -> None:
        self.metrics: dict[int, GatewayMetrics] = {}

    def add(self, port: int) -> GatewayMetrics:
        self.metrics[port] = GatewayMetrics(CollectorRegistry(), "m")
        return self.metrics[port]

    def serve(self, prompt: int, output: int, ttft_s: float, tpot_s: float, port: int) -> None:
        m = self.metrics[port]
        m.request_prompt_tokens.observe(prompt)
        m.request_generation_tokens.observe(output)
        m.requests.time_to_first_token.observe(ttft_s)
        m.request_time_per_output_token.observe(tpot_s)
        m.prefix_cache_queries.inc(prompt)
        m.prefix_cache_hits.inc(prompt // 2)

    async def scrape(self, url: str) -> Samples:
        port = int(url.split(":")[2].split("/")[0])
        if port not in self.metrics:
            raise OSError("connection refused")
        return Samples.parse(generate_latest(self.metrics[port].registry).decode())


@pytest.fixture
def synthetic_profile() -> WorkerProfile:
    """This machine's figures (loadtest/plan_sim/profiles.py), as the fleet's (float) key."""
    return dataclasses.replace(cpu_profile(), key=ProfileKey("m"))


def observer(workers: list[WorkerInfo], gateways: Gateways, clock: FakeClock) -> LoadObserver:
    return LoadObserver(FakeRegistry(workers), "m", gateways.scrape, clock)  # type: ignore[arg-type]


def test_a_window_is_the_difference_of_two_scrapes_summed_over_gateways() -> None:
    clock = FakeClock()
    gateways = Gateways()
    gateways.add(9001)
    gateways.add(9002)
    workers = [gateway("g1", 9001), gateway("g2", 9002),
               engine("d0", "decode", num_waiting=3), engine("p0", "prefill", num_waiting=2)]  # fmt: skip
    obs = observer(workers, gateways, clock)

    async def body() -> None:
        gateways.serve(4000, 4000, 9.0, 1.0, 9001)  # before the first reading: not counted
        first, fleet = await obs.observe()
        assert first is None and fleet.split == Split(1, 1)
        clock.advance(10.0)
        for _ in range(6):
            gateways.serve(1500, 8, 0.8, 0.05, 9001)
        for _ in range(2):
            gateways.serve(50, 256, 0.1, 0.02, 9002)
        window, _ = await obs.observe()
        assert window is not None
        assert window.num_arrivals == 8 and window.seconds == 10.0
        assert window.arrival_rate == pytest.approx(0.8)
        # Bucket middles corrected to the exact mean (sum / count).
        assert window.prompt_tokens.mean() == pytest.approx((6 * 1500 + 2 * 50) / 8)
        assert window.prompt_tokens.quantile(0.9) > 1000 > window.prompt_tokens.quantile(0.1)
        assert window.output_tokens.mean() == pytest.approx((6 * 8 + 2 * 256) / 8)
        assert window.prefix_hit_rate == pytest.approx(0.5)
        assert window.ttft_ms.mean() == pytest.approx((6 * 800 + 2 * 100) / 8)
        assert window.itl_ms.mean() == pytest.approx((6 * 50 + 2 * 20) / 8)
        assert window.num_waiting == 5

    asyncio.run(body())


def test_a_restarted_gateway_counts_whole_and_an_unreadable_one_is_skipped() -> None:
    clock = FakeClock()
    gateways = Gateways()
    gateways.add(9001)
    obs = observer([gateway("g1", 9001), gateway("g2", 9999), engine("d0", "decode")],
                   gateways, clock)  # fmt: skip

    async def body() -> None:
        for _ in range(5):
            gateways.serve(100, 10, 0.1, 0.01, 9001)
        await obs.observe()
        gateways.add(9001)  # restarted: its counters begin again
        gateways.serve(100, 10, 0.1, 0.01, 9001)
        clock.advance(5.0)
        window, _ = await obs.observe()
        assert window is not None and window.num_arrivals == 1
        assert window.prefix_hit_rate == pytest.approx(0.5)

    asyncio.run(body())


def test_the_fleet_counts_both_as_decode_and_leaves_draining_workers_out() -> None:
    fleet = Fleet([engine("p0", "prefill"), engine("b0", "both"), engine("d0", "decode"),
                   engine("d1", "decode", draining=True)])  # fmt: skip
    assert fleet.split == Split(1, 2)
    assert Fleet([engine("p0", "prefill")]).split is None


@dataclass
class FakeProcesses:
    started: list[str] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)

    def start(self, role: str) -> str:
        self.started.append(role)
        return f"new-{len(self.started)}"

    def stop(self, worker_id: str) -> None:
        self.stopped.append(worker_id)


class RecordingConnector(LocalConnector):
    """The local connector with its SetRole calls recorded instead of sent."""

    def __init__(self, fleet: Fleet, processes: FakeProcesses | None = None) -> None:
        self.fleet = fleet

        async def read() -> Fleet:
            return self.fleet

        super().__init__(read, ChannelPool(), processes, FakeClock())
        self.flips: list[tuple[str, str]] = []

    async def _set_role(self, worker: WorkerInfo, role: str) -> None:
        self.flips.append((worker.worker_id, role))


def test_roles_flip_on_the_workers_with_least_to_move() -> None:
    fleet = Fleet([engine("d0", "decode", running=5, since=1), engine("d1", "decode", running=1, since=3),
                   engine("d2", "decode", running=1, since=2), engine("p0", "prefill")])  # fmt: skip
    connector = RecordingConnector(fleet)

    async def body() -> None:
        assert await connector.current() == Split(1, 3)
        await connector.apply(Split(2, 2))
        assert connector.flips == [("d2", "prefill")]  # fewest streams, then longest in role
        connector.flips.clear()
        await connector.apply(Split(1, 3))  # the fleet did not change: nothing to do
        assert connector.flips == []
        fleet.workers = [engine("p0", "prefill", num_pending_tokens=900),
                         engine("p1", "prefill", num_pending_tokens=10), engine("d0", "decode")]  # fmt: skip
        await connector.apply(Split(0, 3))
        assert sorted(connector.flips) == [("p0", "decode"), ("p1", "decode")]

    asyncio.run(body())


def test_missing_workers_start_and_surplus_ones_stop_once() -> None:
    processes = FakeProcesses()
    fleet = Fleet([engine("d0", "decode", running=3), engine("d1", "decode", running=0)])
    connector = RecordingConnector(fleet, processes)

    async def body() -> None:
        await connector.apply(Split(1, 3))
        # Growing: no stream moves, the missing roles start.
        assert connector.flips == []
        assert sorted(processes.started) == ["decode", "prefill"]
        # They count while they start: applying again starts nothing more.
        assert await connector.current() == Split(1, 3)
        await connector.apply(Split(1, 3))
        assert len(processes.started) == 2
        # Registered, then fewer wanted: the least loaded surplus decode worker stops.
        new_decode = f"new-{processes.started.index('decode') + 1}"
        new_prefill = f"new-{processes.started.index('prefill') + 1}"
        fleet.workers += [engine(new_decode, "decode", running=1), engine(new_prefill, "prefill")]
        await connector.apply(Split(1, 2))
        assert processes.stopped == ["d1"] and connector.flips == []  # d1 runs nothing

    asyncio.run(body())


class FakeStore:
    def __init__(self, profiles: list[Any]) -> None:
        self.profiles = profiles

    async def list(self, model: str) -> list[Any]:
        return self.profiles


class ScriptedConnector:
    def __init__(self, split: Split, fail: bool = False) -> None:
        self.split = split
        self.fail = fail
        self.applied: list[Split] = []

    async def current(self) -> Split:
        return self.split

    async def apply(self, split: Split) -> None:
        if self.fail:
            raise ConnectorError("the API server cannot be reached (scripted)")
        self.applied.append(split)
        self.split = split


def planner_loop(
    profiles: list[Any], connector: ScriptedConnector, gateways: Gateways, clock: FakeClock
) -> tuple[PlannerLoop, CollectorRegistry]:
    workers = [gateway("g1", 9001), engine("p0", "prefill"), engine("d0", "decode")]
    config = PlannerServiceConfig(
        targets=Targets(ttft_ms=3000, itl_ms=25), model="m", redis_url="redis://unused",
        connector="local", dwell_s=0.0,
    )  # fmt: skip
    registry = CollectorRegistry()
    loop = PlannerLoop(
        config, observer(workers, gateways, clock), FakeStore(profiles),  # type: ignore[arg-type]
        connector, PlannerMetrics(registry), clock,
    )  # fmt: skip
    return loop, registry


def test_without_a_profile_nothing_is_planned_and_it_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock, gateways = FakeClock(), Gateways()
    gateways.add(9001)
    connector = ScriptedConnector(Split(1, 1))
    loop, registry = planner_loop([], connector, gateways, clock)

    async def body() -> None:
        await loop.observer.observe()
        clock.advance(10)
        assert await loop.step() is None

    asyncio.run(body())
    assert registry.get_sample_value("pdserve:planner_decisions_total", {"outcome": "no_profile"}) == 1
    assert "no profile" in caplog.text and connector.applied == []


def test_an_interval_decides_applies_and_records(synthetic_profile: Any) -> None:
    clock, gateways = FakeClock(), Gateways()
    gateways.add(9001)
    connector = ScriptedConnector(Split(1, 1))
    loop, registry = planner_loop([synthetic_profile], connector, gateways, clock)

    async def body() -> None:
        await loop.observer.observe()
        # Short prompts, long outputs at 4 req/s: decode work that one decode worker cannot
        # keep within 25 ms a token (1P+1D misses), two can.
        for _ in range(40):
            gateways.serve(50, 256, 0.1, 0.03, 9001)
        clock.advance(10)
        decision = await loop.step()
        assert decision is not None
        return decision

    decision = asyncio.run(body())
    assert decision.split == Split(0, 2), decision.reason  # colocated serves it better
    assert "misses the targets" in decision.reason
    assert connector.applied == [Split(0, 2)]
    value = registry.get_sample_value
    assert value("pdserve:planner_desired_workers", {"role": "prefill"}) == 0
    assert value("pdserve:planner_desired_workers", {"role": "decode"}) == 2
    assert value("pdserve:planner_current_workers", {"role": "prefill"}) == 1
    assert value("pdserve:planner_predicted_itl_seconds") == pytest.approx(
        decision.predicted_itl_ms / 1000
    )
    assert value("pdserve:planner_targets_met") == float(decision.targets_met)
    assert value("pdserve:planner_decisions_total", {"outcome": "change"}) == 1
    assert value("pdserve:planner_observed_arrival_rate") == pytest.approx(4.0)


def test_a_connector_that_fails_is_logged_and_the_next_interval_tries_again(
    synthetic_profile: Any, caplog: pytest.LogCaptureFixture
) -> None:
    clock, gateways = FakeClock(), Gateways()
    gateways.add(9001)
    connector = ScriptedConnector(Split(1, 1), fail=True)
    loop, registry = planner_loop([synthetic_profile], connector, gateways, clock)

    async def body() -> None:
        await loop.observer.observe()
        for _ in range(40):
            gateways.serve(50, 256, 0.1, 0.03, 9001)
        clock.advance(10)
        await loop.step()

    asyncio.run(body())
    outcome = {"outcome": "apply_failed"}
    assert registry.get_sample_value("pdserve:planner_decisions_total", outcome) == 1
    assert "cannot be reached (scripted)" in caplog.text


def test_targets_no_split_can_meet_are_said_and_the_best_plan_is_kept(
    synthetic_profile: WorkerProfile, caplog: pytest.LogCaptureFixture
) -> None:
    clock, gateways = FakeClock(), Gateways()
    gateways.add(9001)
    connector = ScriptedConnector(Split(1, 1))
    loop, registry = planner_loop([synthetic_profile], connector, gateways, clock)
    loop.config = dataclasses.replace(loop.config, targets=Targets(ttft_ms=1, itl_ms=0.1))

    async def body() -> None:
        await loop.observer.observe()
        for _ in range(30):
            gateways.serve(1500, 64, 2.0, 0.05, 9001)
        clock.advance(10)
        return await loop.step()

    decision = asyncio.run(body())
    assert decision is not None and not decision.targets_met
    assert "misses" in decision.reason
    assert registry.get_sample_value("pdserve:planner_targets_met") == 0
    assert "NO SPLIT MEETS THE TARGETS" in caplog.text
    assert connector.split == decision.split  # the best it has is in force
