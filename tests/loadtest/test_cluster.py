"""Scenario plumbing that needs no processes: pinning, descriptions, the command's parsing."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from loadtest import scenarios
from loadtest.scenarios.cluster import ClusterSpec, GatewaySpec, pinned
from pdserve.cli.commands import bench


def test_pinned_runs_on_the_named_cpus_with_as_many_threads() -> None:
    argv = ["python", "-m", "pdserve", "decode"]
    assert pinned(argv, None) == argv
    assert pinned(argv, "1") == ["taskset", "-c", "1", "env", "OMP_NUM_THREADS=1", *argv]
    assert pinned(argv, "0,2-3")[:5] == ["taskset", "-c", "0,2-3", "env", "OMP_NUM_THREADS=3"]


def test_specs_describe_the_topology() -> None:
    spec = ClusterSpec(prefill_cpus=("0",), decode_cpus=("1", None), prefix_caching=False)
    assert spec.describe() == "prefill-0@cpu0 decode-0@cpu1 decode-1 no-prefix-caching"
    assert (
        GatewaySpec(0.0, 99).describe()
        == "gateway(routing_policy=prefix-aware, overlap_weight=0, local_prefill_tokens=99)"
    )


def test_scenario_command_parses_and_runs_the_named_scenarios(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, smollm_dir: Path
) -> None:
    seen: dict[str, object] = {}

    def fake_run(
        names: list[str], options: scenarios.ScenarioOptions, model_dir: str
    ) -> list[object]:
        seen.update(
            names=names, small=options.small, result_dir=options.result_dir, model=model_dir
        )
        return []

    monkeypatch.setattr(scenarios, "run_scenarios", fake_run)
    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    args = parser.parse_args(["bench", "scenario", "all", "--small", "--result-dir", str(tmp_path),
                              "--model", str(smollm_dir)])  # fmt: skip
    assert args.func(args) == 0
    assert seen == {"names": list(scenarios.SCENARIOS), "small": True, "result_dir": tmp_path,
                    "model": str(smollm_dir)}  # fmt: skip
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "scenario", "no-such-scenario"])
