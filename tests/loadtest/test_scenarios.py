"""Every scenario at CI size on real processes, sharing one cluster (started once for the
module), and ``bench serve`` against it. Seconds each once the workers are up."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.scenarios import SCENARIOS, run_scenarios
from loadtest.scenarios.cluster import LLAMA_CPP_MISSING, ClusterPool, llama_cpp_command
from loadtest.scenarios.common import SMALL_CLUSTER, ScenarioOptions
from pdserve.cli.commands import bench

pytestmark = [pytest.mark.slow, pytest.mark.redis]

SUMMARY_KEYS = (
    "date", "backend", "label", "num_prompts", "request_rate", "burstiness", "max_concurrency",
    "duration", "completed", "failed", "error_codes", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "max_output_tokens_per_s", "max_concurrent_requests", "prefix_cache_hit_rate", "requests",
    *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
      for s in ("mean", "median", "std", "p50", "p90", "p99")),
)  # fmt: skip


@pytest.fixture(scope="module")
def pool(smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterPool]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: run scripts/setup_system.sh")
    pool = ClusterPool(str(smollm_dir), tmp_path_factory.mktemp("bench-run"), exclusive=False)
    try:
        yield pool
    finally:
        pool.close()


def check_report(directory: Path, expected_arms: set[str]) -> dict:
    report = json.loads((directory / "report.json").read_text())
    assert report["size"] == "small"
    assert {arm["arm"] for arm in report["arms"]} == expected_arms
    for arm in report["arms"]:
        result = json.loads((directory / f"{arm['arm']}.json").read_text())
        assert not [k for k in SUMMARY_KEYS if k not in result], arm["arm"]
        assert result["failed"] == 0, result["error_codes"]
        assert result["completed"] == result["num_prompts"] == len(result["requests"])
        assert result["total_output_tokens"] > 0 and result["mean_ttft_ms"] > 0
    for figure in report["figures"]:
        assert (directory / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (directory / "report.txt").read_text().startswith(f"# {report['scenario']}")
    return report


def run_small(name: str, tmp_path: Path, pool: ClusterPool) -> tuple[dict, Path]:
    options = ScenarioOptions(small=True, result_dir=tmp_path)
    [scenario] = run_scenarios([name], options, pool.model_dir, pool)
    return scenario.to_json(), scenario.directory


def test_disaggregated_vs_colocated(tmp_path: Path, pool: ClusterPool) -> None:
    _, directory = run_small("disagg-vs-colocated", tmp_path, pool)
    llama_cpp = llama_cpp_command(0, None) is not None
    report = check_report(
        directory,
        {"disaggregated", "colocated", "transformers"} | ({"llama.cpp"} if llama_cpp else set()),
    )
    assert report["skipped"] == ([] if llama_cpp else [LLAMA_CPP_MISSING])
    for arm in report["arms"]:
        assert arm["chat_p99_itl_ms"] > 0 and arm["goodput_req_s"] is not None
    colocated = json.loads((directory / "colocated.json").read_text())
    assert set(colocated["categories"]) == {"chat", "long"}
    assert "local_prefill_tokens=1000000000" in colocated["topology"]


def test_routing(tmp_path: Path, pool: ClusterPool) -> None:
    _, directory = run_small("routing", tmp_path, pool)
    arms = {
        f"{d}-{p}"
        for d in ("prefix-repetition", "mooncake-trace")
        for p in ("prefix-aware", "round-robin", "load-only")
    }
    report = check_report(directory, arms)
    rows = {a["arm"]: a for a in report["arms"]}
    # One request at a time: each prefix's first request misses, its 3 others hit all 64
    # prefix tokens on the worker that has them: 6 x 64 / (8 x 80).
    assert rows["prefix-repetition-prefix-aware"]["prefix_hit_rate"] == pytest.approx(0.6)
    assert rows["prefix-repetition-load-only"]["prefix_hit_rate"] <= 0.6
    assert rows["prefix-repetition-round-robin"]["prefix_hit_rate"] <= 0.6


def test_prefix_caching(tmp_path: Path, pool: ClusterPool) -> None:
    _, directory = run_small("prefix-caching", tmp_path, pool)
    report = check_report(directory, {"caching-on", "caching-off"})
    rows = {a["arm"]: a for a in report["arms"]}
    assert rows["caching-on"]["prefix_hit_rate"] == pytest.approx(
        3 * 128 / (4 * 144)
    )  # 3 reuse 128
    assert rows["caching-off"]["prefix_hit_rate"] == 0.0


def test_rate_sweep(tmp_path: Path, pool: ClusterPool) -> None:
    _, directory = run_small("rate-sweep", tmp_path, pool)
    targets = ("pdserve", "transformers", *(("llama.cpp",) if llama_cpp_command(0, None) else ()))
    arms = {f"{t}-rate{r}" for t in targets for r in ("2", "8")}
    report = check_report(directory, arms)
    assert any(n.startswith("pdserve: saturation_rate") for n in report["notes"])


def test_bench_serve_against_the_stack(tmp_path: Path, pool: ClusterPool) -> None:
    from loadtest.scenarios.cluster import GatewaySpec
    from loadtest.serve import run_serve

    target = pool.cluster(SMALL_CLUSTER).gateway(GatewaySpec())
    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    args = parser.parse_args([
        "bench", "serve", "--base-url", target, "--dataset-name", "random", "--num-prompts", "3",
        "--random-input-len", "20", "--random-output-len", "3", "--request-rate", "10",
        "--num-warmups", "1", "--save-result", "--save-detailed", "--result-dir", str(tmp_path),
        "--result-filename", "stack.json", "--disable-tqdm",
    ])  # fmt: skip
    result = asyncio.run(run_serve(args))
    assert result["completed"] == 3 and result["total_input_tokens"] == 60
    assert result["total_output_tokens"] == 9  # ignore_eos: exactly the expected lengths
    assert json.loads((tmp_path / "stack.json").read_text())["requests"][0]["output_tokens"] == 3


def test_every_scenario_is_covered() -> None:
    assert set(SCENARIOS) == {"disagg-vs-colocated", "routing", "prefix-caching", "rate-sweep"}
