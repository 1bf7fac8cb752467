"""Disaggregated against colocated serving, under long-prefill interference.

Disaggregated: one prefill worker on CPU 0 and one decode worker on CPU 1. Colocated: one
worker on both CPUs that prefills every prompt itself (a gateway with no prefill worker to
send to). Same workload: a stream of short chats while long prompts arrive. The question:
does moving the long prefills off the decode worker keep the chats' inter-token latency
down, and what does it do to goodput? Baselines: transformers ``generate`` (static
batches, both CPUs) and llama.cpp's server when installed, on the same workload.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loadtest.backends.base import SendOptions
from loadtest.datasets.interference import interference_requests
from loadtest.plots import plot_cdfs
from loadtest.runner import LoadConfig
from loadtest.scenarios.cluster import LLAMA_CPP_MISSING, ClusterPool, ClusterSpec, GatewaySpec
from loadtest.scenarios.common import (
    SMALL_CLUSTER,
    ScenarioOptions,
    ScenarioReport,
    category_metric,
    grpc_backend,
    http_backend,
    pool_for,
    run_arm,
    vocab_size,
)

NAME = "disagg-vs-colocated"
LOCAL_EVERYTHING = GatewaySpec(local_prefill_tokens=10**9)


@dataclass(frozen=True)
class Size:
    num_prompts: int
    chat_input_len: int
    chat_output_len: int
    long_input_len: int
    long_output_len: int
    long_every: int
    request_rate: float
    slos_ms: tuple[tuple[str, float], ...]


SMALL = Size(6, 16, 4, 96, 2, 3, 4.0, (("ttft", 5000.0), ("tpot", 1000.0)))
FULL = Size(32, 64, 32, 768, 2, 4, 0.25, (("ttft", 5000.0), ("tpot", 500.0)))
# Prefill in chunks of this many tokens, so that no engine step runs for seconds (what a
# colocated deployment does against interference; the same for both arms).
FULL_CHUNK_TOKENS = 256


def _row(result: dict[str, Any]) -> dict[str, Any]:
    return {
        "completed": result["completed"], "failed": result["failed"],
        "chat_p99_itl_ms": category_metric(result, "chat", "p99_itl_ms"),
        "chat_p99_tpot_ms": category_metric(result, "chat", "p99_tpot_ms"),
        "chat_median_ttft_ms": category_metric(result, "chat", "median_ttft_ms"),
        "long_median_ttft_ms": category_metric(result, "long", "median_ttft_ms"),
        "goodput_req_s": result["request_goodput"],
        "good_requests": result["good_requests"],
        "output_tok_s": result["output_throughput"],
    }  # fmt: skip


def run(
    options: ScenarioOptions, model_dir: str, pool: ClusterPool | None = None
) -> ScenarioReport:
    report = ScenarioReport(
        NAME, "does disaggregation keep decode ITL down while long prompts prefill?", options
    )
    pool, owned = pool_for(options, model_dir, pool)
    size = SMALL if options.small else FULL
    slos = dict(size.slos_ms)
    if options.small:
        disagg_spec = colocated_spec = SMALL_CLUSTER
        report.notes.append(
            "small size: every arm shares one unpinned cluster; only the fields mean something"
        )
    else:
        disagg_spec = ClusterSpec(prefill_cpus=("0",), decode_cpus=("1",),
                                  max_num_batched_tokens=FULL_CHUNK_TOKENS)  # fmt: skip
        colocated_spec = ClusterSpec(prefill_cpus=(), decode_cpus=("0,1",),
                                     max_num_batched_tokens=FULL_CHUNK_TOKENS)  # fmt: skip
    requests = interference_requests(size.num_prompts, size.chat_input_len, size.chat_output_len,
                                     size.long_input_len, size.long_output_len, size.long_every,
                                     vocab_size(model_dir), seed=options.seed)  # fmt: skip
    load = LoadConfig(
        request_rate=size.request_rate,
        seed=options.seed,
        num_warmups=options.num_warmups,
        disable_tqdm=options.disable_tqdm,
    )
    arms = (
        ("disaggregated", disagg_spec, GatewaySpec()),
        ("colocated", colocated_spec, LOCAL_EVERYTHING),
    )
    try:
        for label, spec, gateway in arms:
            address = pool.cluster(spec).gateway(gateway)
            # A salt per arm: arms that share workers (CI size) do not share cached prefixes.
            result = run_arm(grpc_backend(address), requests, load,
                             {"label": label, "dataset_name": "long-prefill-interference",
                              "topology": f"{spec.describe()} {gateway.describe()}",
                              "cache_salt": label},
                             send=SendOptions(cache_salt=label), goodput_slos_ms=slos)  # fmt: skip
            report.add(label, result, _row(result))
        for name in ("transformers", "llama.cpp"):
            server = pool.baseline(name, None if options.small else "0,1")
            if server is None:
                report.skipped.append(LLAMA_CPP_MISSING)
                continue
            result = run_arm(http_backend(server.url), requests, load,
                             {"label": name, "dataset_name": "long-prefill-interference",
                              "topology": f"{name} server" + ("" if options.small else " @cpu0,1")},
                             goodput_slos_ms=slos)  # fmt: skip
            report.add(name, result, _row(result))
    finally:
        if owned:
            pool.close()
    figure = plot_cdfs(report.results, report.directory / "latency_cdf_chat.png",
                       title="chats under long-prefill interference", category="chat")  # fmt: skip
    report.figures.append(figure.name)
    report.write()
    return report
