"""One simulated run: a workload through a fleet, at a fixed split or with the planner in the
loop (every ``interval_s`` it is handed the interval's window and the split in force, and
its decision is applied), and what came of it.

Definitions (the report's columns):
- SLA attainment: the share of the workload's requests that finished with time to first
  token <= the TTFT target and mean time per output token after the first <= the ITL
  target (a request unfinished when the simulation ends misses);
- worker-seconds: every worker's time from its start (start-up included) to its stop or
  the workload's end (the last arrival's window; draining after it is not charged);
- goodput per worker: requests meeting the SLA per worker-second, scaled to per worker-hour
  (``good requests / worker-hours``); for a fixed fleet of N over T seconds it is
  attainment x arrival rate x 3600 / N.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from common.planner.policy import Planner
from common.planner.profile import WorkerProfile
from common.planner.types import DECODE, PREFILL, Split, Targets
from loadtest.plan_sim.cluster import Cluster, ClusterConfig, Request
from loadtest.plan_sim.events import EventLoop
from loadtest.plan_sim.workload import SimRequest, Workload


@dataclass(frozen=True)
class DecisionRecord:
    at_s: float
    split: Split
    changed: bool
    targets_met: bool
    predicted_ttft_ms: float
    predicted_itl_ms: float
    reason: str


@dataclass
class RunResult:
    name: str
    targets: Targets
    duration_s: float
    worker_seconds: float
    arrival_s: np.ndarray  # [R]
    ttft_ms: np.ndarray  # [R] nan: no first token
    itl_ms: np.ndarray  # [R] nan: unfinished
    phase: list[str]
    decisions: list[DecisionRecord] = field(default_factory=list)
    fixed_split: Split | None = None  # the split throughout; None when it changed
    num_role_changes: int = 0
    num_migrations: int = 0
    num_rejected: int = 0
    wall_s: float = 0.0

    @property
    def met(self) -> np.ndarray:
        t = self.targets
        with np.errstate(invalid="ignore"):
            return (self.ttft_ms <= t.ttft_ms) & (self.itl_ms <= t.itl_ms)

    @property
    def num_requests(self) -> int:
        return len(self.ttft_ms)

    @property
    def attainment(self) -> float:
        return float(self.met.mean()) if self.num_requests else 0.0

    @property
    def goodput_per_worker_hour(self) -> float:
        return float(self.met.sum()) / (self.worker_seconds / 3600) if self.worker_seconds else 0.0

    @property
    def mean_workers(self) -> float:
        return self.worker_seconds / self.duration_s

    def phase_attainment(self) -> dict[str, float]:
        met = self.met
        out: dict[str, float] = {}
        for name in dict.fromkeys(self.phase):
            mask = np.array([p == name for p in self.phase])
            out[name] = float(met[mask].mean()) if mask.any() else math.nan
        return out

    def percentile(self, what: str, q: float) -> float:
        values = self.ttft_ms if what == "ttft" else self.itl_ms
        values = values[~np.isnan(values)]
        return float(np.percentile(values, q)) if len(values) else math.nan


def simulate(
    workload: Workload,
    profile: WorkerProfile,
    config: ClusterConfig,
    targets: Targets,
    split: Split,
    *,
    planner: Planner | None = None,
    interval_s: float = 30.0,
    drain_s: float = 600.0,
    name: str = "",
    changes: list[tuple[float, Split]] | None = None,
) -> RunResult:
    """``changes``: splits applied at given times (a recorded run's), instead of a planner."""
    began = time.perf_counter()
    loop = EventLoop()
    cluster = Cluster(profile, config, workload.block_tokens, loop)
    for role, n in ((PREFILL, split.prefill), (DECODE, split.decode)):
        for _ in range(n):
            cluster.add_worker(role, 0.0)
    requests: list[Request] = []
    specs = workload.requests

    def arrive(i: int) -> None:
        requests.append(cluster.arrive(specs[i]))
        if i + 1 < len(specs):
            loop.at(specs[i + 1].arrival_s, arrive, i + 1)

    if specs:
        loop.at(specs[0].arrival_s, arrive, 0)
    decisions: list[DecisionRecord] = []
    if planner is not None:

        def plan(at: float) -> None:
            window = cluster.recorder.window(at, cluster.num_waiting())
            decision = planner.decide(window, cluster.split(), at)
            decisions.append(DecisionRecord(
                at, decision.split, decision.changed, decision.targets_met,
                decision.predicted_ttft_ms, decision.predicted_itl_ms, decision.reason,
            ))  # fmt: skip
            if decision.changed:
                cluster.apply(decision.split)
            if at + interval_s < workload.duration_s:
                loop.at(at + interval_s, plan, at + interval_s)

        loop.at(interval_s, plan, interval_s)
    for at, target in changes or ():
        loop.at(at, lambda s: cluster.apply(s), target)
    loop.run_until(workload.duration_s)
    worker_seconds = cluster.worker_seconds(workload.duration_s)
    loop.run_until(workload.duration_s + drain_s)
    result = _result(
        name or str(split), workload, targets, requests, worker_seconds, decisions, cluster,
        time.perf_counter() - began,
    )  # fmt: skip
    if planner is None and not changes:
        result.fixed_split = split
    return result


def _result(
    name: str,
    workload: Workload,
    targets: Targets,
    requests: list[Request],
    worker_seconds: float,
    decisions: list[DecisionRecord],
    cluster: Cluster,
    wall_s: float,
) -> RunResult:
    n = len(requests)
    arrival = np.empty(n)
    ttft = np.full(n, np.nan)
    itl = np.full(n, np.nan)
    for i, r in enumerate(requests):
        spec: SimRequest = r.spec
        arrival[i] = spec.arrival_s
        if r.first_s >= 0:
            ttft[i] = (r.first_s - spec.arrival_s) * 1000
        if r.finish_s >= 0 and r.first_s >= 0:
            steps = spec.output_tokens - 1
            itl[i] = (r.finish_s - r.first_s) * 1000 / steps if steps > 0 else 0.0
    return RunResult(
        name=name,
        targets=targets,
        duration_s=workload.duration_s,
        worker_seconds=worker_seconds,
        arrival_s=arrival,
        ttft_ms=ttft,
        itl_ms=itl,
        phase=[r.spec.phase for r in requests],
        decisions=decisions,
        num_role_changes=cluster.num_role_changes,
        num_migrations=sum(r.migrations for r in requests),
        num_rejected=sum(r.rejected for r in requests),
        wall_s=wall_s,
    )
