"""Scenarios: each one command that starts what it needs, runs its arms, writes its report.

    pdserve bench scenario NAME [--small] [--result-dir DIR] [--model DIR]

This module stays light (``pdserve`` builds its parser from it); a scenario's code is
imported when it runs.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loadtest.scenarios.cluster import ClusterPool
    from loadtest.scenarios.common import ScenarioOptions, ScenarioReport

# name -> module with ``run(options, model_dir, pool) -> ScenarioReport``
SCENARIOS = {
    "disagg-vs-colocated": "loadtest.scenarios.disagg_colocated",
    "routing": "loadtest.scenarios.routing",
    "prefix-caching": "loadtest.scenarios.prefix_caching",
    "rate-sweep": "loadtest.scenarios.rate_sweep",
}


def run_scenarios(
    names: list[str], options: ScenarioOptions, model_dir: str, pool: ClusterPool | None = None
) -> list[ScenarioReport]:
    from loadtest.scenarios.cluster import ClusterPool

    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario {unknown}; one of {', '.join(SCENARIOS)}")
    runners = [importlib.import_module(SCENARIOS[name]).run for name in names]
    options.result_dir.mkdir(parents=True, exist_ok=True)
    if pool is not None or not options.small:
        return [run(options, model_dir, pool) for run in runners]
    # CI size: every scenario runs on the one small cluster, started once.
    shared = ClusterPool(model_dir, options.result_dir / "run", exclusive=False)
    try:
        return [run(options, model_dir, shared) for run in runners]
    finally:
        shared.close()


def default_result_dir(small: bool) -> Path:
    return Path("loadtest") / "results" / ("small" if small else "full")
