"""A request-rate sweep to saturation: where does goodput fall away from the offered rate?

pdserve disaggregated (prefill on CPU 0, decode on CPU 1) and, on the same requests and
rates, transformers ``generate`` (static batches, both CPUs) and llama.cpp's server when
installed. ``saturation_rate`` is the first offered rate at which goodput drops below 90%
of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from loadtest.backends.base import Backend, SendOptions
from loadtest.datasets.random_dataset import random_requests
from loadtest.plots import plot_sweep
from loadtest.runner import LoadConfig
from loadtest.scenarios.cluster import LLAMA_CPP_MISSING, ClusterPool, ClusterSpec, GatewaySpec
from loadtest.scenarios.common import (
    SMALL_CLUSTER,
    ScenarioOptions,
    ScenarioReport,
    grpc_backend,
    http_backend,
    pool_for,
    run_arm,
    vocab_size,
)

NAME = "rate-sweep"


@dataclass(frozen=True)
class Size:
    prompts_per_rate: int
    input_len: int
    output_len: int
    rates: tuple[float, ...]
    slos_ms: tuple[tuple[str, float], ...]


SMALL = Size(4, 32, 4, (2.0, 8.0), (("ttft", 5000.0), ("tpot", 1000.0)))
FULL = Size(16, 128, 32, (0.25, 0.5, 1.0, 2.0, 4.0), (("ttft", 3000.0), ("tpot", 250.0)))


def saturation_rate(results: Sequence[dict[str, Any]], fraction: float = 0.9) -> float | None:
    """The lowest offered rate whose goodput is under ``fraction`` of it; None if none is."""
    for result in sorted(results, key=lambda r: float(r["request_rate"])):
        if (result["request_goodput"] or 0.0) < fraction * float(result["request_rate"]):
            return float(result["request_rate"])
    return None


def _row(result: dict[str, Any]) -> dict[str, Any]:
    return {
        "rate": result["request_rate"], "completed": result["completed"], "failed": result["failed"],
        "req_s": result["request_throughput"], "goodput_req_s": result["request_goodput"],
        "output_tok_s": result["output_throughput"], "p99_ttft_ms": result["p99_ttft_ms"],
        "p99_tpot_ms": result["p99_tpot_ms"], "p99_itl_ms": result["p99_itl_ms"],
    }  # fmt: skip


def run(
    options: ScenarioOptions, model_dir: str, pool: ClusterPool | None = None
) -> ScenarioReport:
    report = ScenarioReport(NAME, "at what request rate does goodput fall away?", options)
    pool, owned = pool_for(options, model_dir, pool)
    size = SMALL if options.small else FULL
    slos = dict(size.slos_ms)
    report.notes.append(f"goodput SLOs (ms): {slos}")
    requests = random_requests(size.prompts_per_rate, size.input_len, size.output_len,
                               vocab_size(model_dir), range_ratio=0.25, seed=options.seed)  # fmt: skip
    spec = SMALL_CLUSTER if options.small else ClusterSpec(prefill_cpus=("0",), decode_cpus=("1",))
    base = LoadConfig(
        seed=options.seed,
        num_warmups=options.num_warmups,
        disable_tqdm=options.disable_tqdm,
    )
    sweeps: dict[str, list[dict[str, Any]]] = {}

    def sweep(label: str, make_backend: Any, topology: str) -> None:
        for rate in size.rates:
            # Each rate its own salt: a rate's requests do not hit KV cached by the last rate.
            backend: Backend = make_backend()
            result = run_arm(backend, requests, replace(base, request_rate=rate),
                             {"label": label, "dataset_name": "random", "topology": topology},
                             send=SendOptions(cache_salt=f"{label}-{rate}"), goodput_slos_ms=slos)  # fmt: skip
            sweeps.setdefault(label, []).append(result)
            report.add(f"{label}-rate{rate:g}", result, {"target": label, **_row(result)})

    try:
        address = pool.cluster(spec).gateway(GatewaySpec())
        sweep("pdserve", lambda: grpc_backend(address), spec.describe())
        for name in ("transformers", "llama.cpp"):
            server = pool.baseline(name, None if options.small else "0,1")
            if server is None:
                report.skipped.append(LLAMA_CPP_MISSING)
                continue
            url = server.url
            sweep(name, lambda url=url: http_backend(url), f"{name} server")
    finally:
        if owned:
            pool.close()
    for label, results in sweeps.items():
        report.notes.append(f"{label}: saturation_rate = {saturation_rate(results)}")
    figure = plot_sweep(
        sweeps, report.directory / "sweep.png", title="request-rate sweep (random dataset)"
    )
    report.figures.append(figure.name)
    report.write()
    return report
