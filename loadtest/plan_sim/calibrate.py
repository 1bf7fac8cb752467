"""``pdserve bench plan-sim --calibrate RUN.json``: the simulator against a recorded real run.

RUN.json (written from a real local run):

    {"cores": 2, "threads_per_worker": 2, "workers_per_host": 2,
     "profile": "profile.json",            # a WorkerProfile JSON (relative to RUN.json), or cpu
     "local_prefill_tokens": 512,
     "phases": [{"name": "A", "start_s": 0, "end_s": 120, "split": {"prefill": 1, "decode": 1}}],
     "changes": [{"at_s": 130.5, "split": {"prefill": 0, "decode": 2}}],   # or the planner's
     "kv_transfer_ms_per_token": 0.03,      # optional
     "requests": [{"arrival_s": 0.4, "prompt_tokens": 1500, "cached_tokens": 0,
                   "output_tokens": 8, "ttft_ms": 1900.0, "itl_ms": 14.2}]}
                   # ttft_ms / itl_ms null: the request failed (left out of percentiles)

Every request is replayed at its arrival with its lengths and its measured cached tokens;
the split of each phase (or each recorded change) is applied at its time. Printed: per phase
and overall, the simulated and measured TTFT and ITL (mean time per output token after the
first) at p50 / p90 / p99 and their relative difference; differences over 20 % are flagged.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from common.planner.hosting import Hosting
from common.planner.types import Split, Targets
from loadtest.plan_sim.cluster import ClusterConfig
from loadtest.plan_sim.profiles import load_profile
from loadtest.plan_sim.run import RunResult, simulate
from loadtest.plan_sim.scenarios import FLEETS
from loadtest.plan_sim.workload import Phase, SimRequest, Workload

PERCENTILES = (50, 90, 99)
TOLERANCE = 0.2  # the calibration bound


def _split(raw: dict[str, int]) -> Split:
    return Split(int(raw["prefill"]), int(raw["decode"]))


def load_run(path: Path) -> tuple[dict[str, Any], Workload, list[tuple[float, Split]], Split]:
    raw: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    phases = [Phase(p["name"], float(p["start_s"]), float(p["end_s"])) for p in raw["phases"]]
    changes = [(float(p["start_s"]), _split(p["split"])) for p in raw["phases"] if "split" in p]
    changes += [(float(c["at_s"]), _split(c["split"])) for c in raw.get("changes", ())]
    changes.sort(key=lambda c: c[0])
    if not changes:
        raise ValueError(f"{path}: no split given (phases[].split or changes[])")
    initial = changes[0][1]

    def phase_of(t: float) -> str:
        for p in phases:
            if p.start_s <= t < p.end_s:
                return p.name
        return phases[-1].name if phases else ""

    requests = sorted(raw["requests"], key=lambda r: float(r["arrival_s"]))
    specs = tuple(
        SimRequest(
            i, float(r["arrival_s"]), int(r["prompt_tokens"]), int(r["output_tokens"]),
            cached_tokens=int(r.get("cached_tokens", 0)), phase=phase_of(float(r["arrival_s"])),
        )
        for i, r in enumerate(requests)
    )  # fmt: skip
    end = max([p.end_s for p in phases] + [s.arrival_s for s in specs] + [0.0])
    workload = Workload(path.stem, specs, end, phases=tuple(phases))
    later = [(at, s) for at, s in changes[1:]]
    return raw, workload, later, initial


def print_calibration(path: Path, args: argparse.Namespace) -> int:
    raw, workload, changes, initial = load_run(path)
    profile_ref = str(raw.get("profile", "cpu"))
    if profile_ref not in ("cpu", "gpu") and not Path(profile_ref).is_absolute():
        profile_ref = str(path.parent / profile_ref)
    profile = load_profile(profile_ref)
    fleet = FLEETS["cpu"]
    config = ClusterConfig(
        local_prefill_tokens=int(raw.get("local_prefill_tokens", args.local_prefill_tokens)),
        kv_transfer_base_ms=float(raw.get("kv_transfer_base_ms", fleet.kv_transfer_base_ms)),
        kv_transfer_ms_per_token=float(
            raw.get("kv_transfer_ms_per_token", fleet.kv_transfer_ms_per_token)
        ),
        switch_s=float(raw.get("switch_s", fleet.switch_s)),
        startup_s=float(raw.get("startup_s", fleet.startup_s)),
        hosting=Hosting(
            cores_per_host=int(raw.get("cores", 0)),
            threads_per_worker=int(raw.get("threads_per_worker", 1)),
            workers_per_host=int(raw.get("workers_per_host", 1)),
        ),
    )
    targets = Targets(args.ttft_ms or 1e9, args.itl_ms or 1e9)
    result = simulate(workload, profile, config, targets, initial, changes=changes)
    measured_ttft = np.array([_ms(r.get("ttft_ms")) for r in _sorted(raw)])
    measured_itl = np.array([_ms(r.get("itl_ms")) for r in _sorted(raw)])
    print(f"{path}: {len(workload.requests)} requests, profile {profile.key.slug()}, "
          f"{config.hosting}")  # fmt: skip
    print(f"{'phase':<10}{'metric':<8}" + "".join(
        f"{'p' + str(q) + ' sim':>11}{'real':>9}{'diff':>8}" for q in PERCENTILES))  # fmt: skip
    flagged = 0
    names = [p.name for p in workload.phases] + ["all"]
    for name in dict.fromkeys(names):
        mask = np.array([name in ("all", p) for p in result.phase])
        for metric, measured in (("ttft", measured_ttft), ("itl", measured_itl)):
            row, off = _row(result, metric, measured, mask)
            flagged += off
            print(f"{name:<10}{metric:<8}{row}")
    print(f"diff = (simulated - measured) / measured; ! marks more than {TOLERANCE:.0%}"
          f" ({flagged} of them)")  # fmt: skip
    return 0


def _ms(value: float | None) -> float:
    """A measured latency; null (a failed request) is left out of the percentiles."""
    return float("nan") if value is None else float(value)


def _sorted(raw: dict[str, Any]) -> list[dict[str, Any]]:
    return sorted(raw["requests"], key=lambda r: float(r["arrival_s"]))


def _row(result: RunResult, metric: str, measured: np.ndarray, mask: np.ndarray) -> tuple[str, int]:
    simulated = result.ttft_ms if metric == "ttft" else result.itl_ms
    sim = simulated[mask & ~np.isnan(simulated)]
    real = measured[mask & ~np.isnan(measured)]
    cells, off = [], 0
    for q in PERCENTILES:
        if not len(sim) or not len(real):
            cells.append(f"{'-':>11}{'-':>9}{'-':>8}")
            continue
        s, m = float(np.percentile(sim, q)), float(np.percentile(real, q))
        diff = (s - m) / m if m else 0.0
        mark = "!" if abs(diff) > TOLERANCE else " "
        off += mark == "!"
        cells.append(f"{s:>11.1f}{m:>9.1f}{diff:>+7.0%}{mark}")
    return "".join(cells), off
