"""A comparison at one fleet size: every fixed split of the same total and the planner, on
one workload, and the table that says how they did.

The best fixed split is chosen in hindsight: the one with the highest goodput per worker
(at a fixed total, the highest attainment). Splits are searched coarse to fine: eighths of
the fleet as prefill workers (and N - 1), then halving the step around the best so far
until it is one worker; ``exhaustive`` runs every split instead (small fleets).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from common.planner.types import Split
from loadtest.plan_sim.run import RunResult


def fixed_split_search(
    total: int, run: Callable[[Split], RunResult], exhaustive: bool = False
) -> dict[int, RunResult]:
    """Runs fixed splits of ``total`` workers; the results by prefill workers."""
    results: dict[int, RunResult] = {}

    def visit(prefill: int) -> None:
        if 0 <= prefill < total and prefill not in results:
            results[prefill] = run(Split(prefill, total - prefill))

    if exhaustive or total <= 9:
        for p in range(total):
            visit(p)
        return results
    for k in range(8):
        visit(round(k * total / 8))
    visit(total - 1)
    step = max(total // 16, 1)
    while True:
        best = max(results, key=lambda p: (results[p].goodput_per_worker_hour, -p))
        visit(best - step)
        visit(best + step)
        top = results[best].goodput_per_worker_hour
        around = [results[p].goodput_per_worker_hour for p in (best - step, best + step)
                  if p in results]  # fmt: skip
        # On a plateau (both neighbours as good to 0.1 %) finer steps find nothing better.
        if step == 1 or (len(around) == 2 and min(around) >= top * 0.999):
            break
        step = max(step // 2, 1)
    return results


def smaller_fleets(
    total: int, best: Split, fractions: list[float], run: Callable[[Split], RunResult]
) -> list[RunResult]:
    """Fixed fleets smaller than ``total``: for each fraction, colocated and the best
    split's share of prefill workers (a fixed fleet sized in hindsight, not only split)."""
    results: list[RunResult] = []
    seen = {best}
    share = best.prefill / best.total
    for f in fractions:
        size = max(1, round(f * total))
        prefill = min(round(share * size), size - 1)
        for split in (Split(0, size), Split(prefill, size - prefill)):
            if split not in seen:
                seen.add(split)
                results.append(run(split))
    return results


@dataclass
class Comparison:
    workload: str
    workers: int
    fixed: dict[int, RunResult]  # by prefill workers, all of ``workers`` in total
    planners: dict[str, RunResult] = field(default_factory=dict)
    smaller: list[RunResult] = field(default_factory=list)  # fixed fleets of fewer workers

    @property
    def best_fixed(self) -> RunResult:
        """The best fixed split of the same total, in hindsight."""
        return _best(self.fixed.values())

    @property
    def best_sized(self) -> RunResult:
        """The best fixed split of any size run, in hindsight."""
        return _best([*self.fixed.values(), *self.smaller])

    def ratio(self, planner: str, against: RunResult | None = None) -> float:
        best = (against or self.best_fixed).goodput_per_worker_hour
        mine = self.planners[planner].goodput_per_worker_hour
        return mine / best if best else math.inf

    def table(self) -> str:
        fixed = list(self.fixed.values())
        phases = list((fixed or [*self.planners.values()])[0].phase_attainment())
        show_phases = len(phases) > 1
        head = f"{'run':<22}{'attain':>8}"
        if show_phases:
            head += "".join(f"{'ph ' + p:>8}" for p in phases)
        head += (
            f"{'goodput/wkr-h':>15}{'wkr-s':>11}{'mean wkr':>10}"
            f"{'ttft p90':>10}{'itl p90':>9}{'role chg':>9}{'failed':>8}"
        )
        lines = [f"{self.workload}: {self.workers} workers", head]
        best = self.best_fixed if fixed else None
        sized = self.best_sized if self.smaller else None
        rows = [
            *(self.fixed[p] for p in sorted(self.fixed)),
            *sorted(self.smaller, key=lambda r: r.worker_seconds),
            *self.planners.values(),
        ]
        for r in rows:
            label = r.name + (" *" if r is best else "") + (" **" if r is sized else "")
            line = f"{label:<22}{r.attainment:>8.3f}"
            if show_phases:
                per_phase = r.phase_attainment()
                line += "".join(f"{per_phase.get(p, math.nan):>8.3f}" for p in phases)
            line += (
                f"{r.goodput_per_worker_hour:>15.0f}{r.worker_seconds:>11.0f}"
                f"{r.mean_workers:>10.1f}{r.percentile('ttft', 90):>10.0f}"
                f"{r.percentile('itl', 90):>9.1f}{r.num_role_changes:>9}{r.num_rejected:>8}"
            )
            lines.append(line)
        if best is not None:
            lines.append(f"* the best fixed split of {self.workers} in hindsight (goodput/worker)")
        if sized is not None:
            lines.append("** the best fixed split of any size run, in hindsight")
        for name in self.planners:
            if best is not None:
                lines.append(
                    f"{name}: goodput per worker {self.ratio(name):.2f}x the best fixed "
                    f"split's ({best.name})"
                    + (f", {self.ratio(name, sized):.2f}x {sized.name}'s" if sized else "")
                )
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        runs = [*self.fixed.values(), *self.smaller, *self.planners.values()]
        return {
            "workload": self.workload,
            "workers": self.workers,
            "best_fixed": self.best_fixed.name if self.fixed else None,
            "best_sized": self.best_sized.name if self.smaller else None,
            "runs": [_run_json(r) for r in runs],
            "ratios": {name: self.ratio(name) for name in self.planners} if self.fixed else {},
        }


def _best(runs: Iterable[RunResult]) -> RunResult:
    return max(runs, key=lambda r: (r.goodput_per_worker_hour, r.attainment))


def _run_json(r: RunResult) -> dict[str, Any]:
    return {
        "name": r.name,
        "requests": r.num_requests,
        "attainment": r.attainment,
        "phase_attainment": r.phase_attainment(),
        "goodput_per_worker_hour": r.goodput_per_worker_hour,
        "worker_seconds": r.worker_seconds,
        "mean_workers": r.mean_workers,
        "ttft_ms": {f"p{q}": r.percentile("ttft", q) for q in (50, 90, 99)},
        "itl_ms": {f"p{q}": r.percentile("itl", q) for q in (50, 90, 99)},
        "role_changes": r.num_role_changes,
        "migrations": r.num_migrations,
        "failed": r.num_rejected,
        "wall_s": r.wall_s,
        "decisions": [
            {"at_s": d.at_s, "split": str(d.split), "changed": d.changed, "reason": d.reason}
            for d in r.decisions
            if d.changed
        ],
    }


def dump(comparisons: list[Comparison]) -> str:
    return json.dumps([c.to_json() for c in comparisons], indent=1, default=float)
