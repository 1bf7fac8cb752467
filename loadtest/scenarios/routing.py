"""Prefix-aware routing against round-robin and load-only routing, across two prefill workers.

Prefix-aware: the gateway's default score, ``overlap_weight x cached leading blocks -
load``. Round-robin: ``--routing-policy round-robin``, each role's workers in turn, blind to
the index and to load. Load-only: ``--routing-policy load``, the least-loaded worker, ties
spread by a per-request hash. Two workloads: ``prefix-repetition``
(K shared prefixes) and the scaled Mooncake trace. The question: how much prefix-cache hit
and TTFT does routing by prefix buy?

The workers run without the block store: with it, a prefix missing on the chosen worker
is fetched from the shared tier, which hides what routing does (and is worth its own run).
At CI size requests go one at a time, so the prefix-aware hit rate is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loadtest.backends.base import SendOptions
from loadtest.datasets.base import SampleRequest
from loadtest.datasets.mooncake import mooncake_requests
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

NAME = "routing"
POLICIES = {
    "prefix-aware": GatewaySpec(routing_policy="prefix-aware"),
    "round-robin": GatewaySpec(routing_policy="round-robin"),
    "load-only": GatewaySpec(routing_policy="load"),
}


@dataclass(frozen=True)
class Size:
    num_prompts: int
    num_prefixes: int
    prefix_len: int
    suffix_len: int
    output_len: int
    request_rate: float
    trace_rows: int
    trace_block_tokens: int
    trace_max_isl: int
    trace_max_osl: int
    trace_speedup: float
    max_concurrency: int | None


SMALL = Size(8, 2, 64, 16, 2, 4.0, 6, 16, 256, 2, 1.0, 1)
FULL = Size(24, 4, 512, 32, 4, 0.5, 40, 32, 1024, 8, 0.25, None)


def _row(result: dict[str, Any]) -> dict[str, Any]:
    return {
        "completed": result["completed"], "failed": result["failed"],
        "prefix_hit_rate": result["prefix_cache_hit_rate"],
        "mean_ttft_ms": result["mean_ttft_ms"], "median_ttft_ms": result["median_ttft_ms"],
        "p99_ttft_ms": result["p99_ttft_ms"], "output_tok_s": result["output_throughput"],
    }  # fmt: skip


def run(
    options: ScenarioOptions, model_dir: str, pool: ClusterPool | None = None
) -> ScenarioReport:
    report = ScenarioReport(NAME, "what do prefix-aware routing's cache hits buy in TTFT?", options)
    report.notes.append("round-robin = --routing-policy round-robin (index and load ignored); "
                        "load-only = --routing-policy load (least queued load)")  # fmt: skip
    report.notes.append(
        "prefix_hit_rate = prompt tokens the gateway reported cached / prompt tokens"
    )
    pool, owned = pool_for(options, model_dir, pool)
    size = SMALL if options.small else FULL
    spec = (
        SMALL_CLUSTER
        if options.small
        else ClusterSpec(prefill_cpus=("0", "1"), decode_cpus=(None,), blockstore=False)
    )
    vocab = vocab_size(model_dir)
    workloads: dict[str, list[SampleRequest]] = {
        "prefix-repetition": prefix_repetition_requests(
            size.num_prompts, size.prefix_len, size.suffix_len, size.num_prefixes,
            size.output_len, vocab, seed=options.seed),
        "mooncake-trace": mooncake_requests(
            size.trace_rows, vocab, block_tokens=size.trace_block_tokens, output_scale=0.02,
            max_osl=size.trace_max_osl, max_isl=size.trace_max_isl,
            speedup_ratio=size.trace_speedup, seed=options.seed),
    }  # fmt: skip
    load = LoadConfig(request_rate=size.request_rate, max_concurrency=size.max_concurrency,
                      seed=options.seed, num_warmups=options.num_warmups, disable_tqdm=options.disable_tqdm)  # fmt: skip
    try:
        cluster = pool.cluster(spec)
        for dataset, requests in workloads.items():
            for policy, gateway in POLICIES.items():
                label = f"{dataset}-{policy}"
                result = run_arm(grpc_backend(cluster.gateway(gateway)), requests, load,
                                 {"label": label, "dataset_name": dataset, "routing": policy,
                                  "topology": f"{spec.describe()} {gateway.describe()}",
                                  "cache_salt": label},
                                 send=SendOptions(cache_salt=label))  # fmt: skip
                report.add(label, result, {"dataset": dataset, "routing": policy, **_row(result)})
    finally:
        if owned:
            pool.close()
    for dataset in workloads:
        runs = {k: v for k, v in report.results.items() if k.startswith(dataset)}
        figure = plot_cdfs(runs, report.directory / f"latency_cdf_{dataset}.png",
                           title=f"routing on {dataset}")  # fmt: skip
        report.figures.append(figure.name)
    report.write()
    return report
