"""Prefix caching on and off: the RadixAttention example, one long shared system prompt
(2,000 tokens) followed by short questions (200 tokens).

Off at full size restarts the workers with ``--no-prefix-caching``. At CI size, where the
workers are shared, off is a fresh cache salt per request: no request can reuse another's
KV, which is what caching off means to a client. Both arms run without the block store,
which would otherwise hand the shared prompt's KV to a worker that does not cache it, so
the arms differ in the one setting. Requests go one at a time (``max_concurrency`` 1), so
each TTFT is one prefill, not a queue: the first request computes the shared prompt,
every later one finds it cached.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from loadtest.backends.base import SendOptions
from loadtest.datasets.prefix_repetition import prefix_repetition_requests
from loadtest.plots import plot_cdfs
from loadtest.runner import LoadConfig
from loadtest.scenarios.cluster import ClusterPool, ClusterSpec, GatewaySpec
from loadtest.scenarios.common import (
    SMALL_CLUSTER,
    ScenarioOptions,
    ScenarioReport,
    grpc_backend,
    pool_for,
    run_arm,
    vocab_size,
)

NAME = "prefix-caching"


@dataclass(frozen=True)
class Size:
    num_prompts: int
    prefix_len: int
    question_len: int
    output_len: int
    request_rate: float


SMALL = Size(4, 128, 16, 2, 2.0)
FULL = Size(12, 2000, 200, 8, 0.1)


def _row(result: dict[str, Any]) -> dict[str, Any]:
    return {
        "completed": result["completed"], "failed": result["failed"],
        "prefix_hit_rate": result["prefix_cache_hit_rate"],
        "mean_ttft_ms": result["mean_ttft_ms"], "median_ttft_ms": result["median_ttft_ms"],
        "p99_ttft_ms": result["p99_ttft_ms"], "mean_e2el_ms": result["mean_e2el_ms"],
    }  # fmt: skip


def run(
    options: ScenarioOptions, model_dir: str, pool: ClusterPool | None = None
) -> ScenarioReport:
    report = ScenarioReport(
        NAME, "how much TTFT does a cached 2,000-token system prompt save?", options
    )
    pool, owned = pool_for(options, model_dir, pool)
    size = SMALL if options.small else FULL
    requests = prefix_repetition_requests(size.num_prompts, size.prefix_len, size.question_len, 1,
                                          size.output_len, vocab_size(model_dir), seed=options.seed)  # fmt: skip
    load = LoadConfig(request_rate=size.request_rate, max_concurrency=1, seed=options.seed,
                      num_warmups=options.num_warmups, disable_tqdm=options.disable_tqdm)  # fmt: skip
    on_spec = SMALL_CLUSTER if options.small else ClusterSpec(
        prefill_cpus=("0",), decode_cpus=("1",), blockstore=False)  # fmt: skip
    arms = [
        ("caching-on", on_spec, load, "engine prefix caching on"),
        ("caching-off", on_spec, replace(load, unique_cache_salt=True), "a unique cache salt per request")
        if options.small else
        ("caching-off", replace(on_spec, prefix_caching=False), load, "workers run --no-prefix-caching"),
    ]  # fmt: skip
    gateway = GatewaySpec()
    try:
        for label, spec, arm_load, how in arms:
            address = pool.cluster(spec).gateway(gateway)
            result = run_arm(grpc_backend(address), requests, arm_load,
                             {"label": label, "dataset_name": "prefix-repetition", "caching": how,
                              "topology": f"{spec.describe()} {gateway.describe()}"},
                             send=SendOptions(cache_salt=f"{label}-{options.seed}"))  # fmt: skip
            report.add(label, result, {"how": how, **_row(result)})
    finally:
        if owned:
            pool.close()
    figure = plot_cdfs(report.results, report.directory / "latency_cdf.png",
                       title=f"{size.prefix_len}-token shared prefix, {size.question_len}-token questions")  # fmt: skip
    report.figures.append(figure.name)
    report.write()
    return report
