"""The result of a run: vLLM-compatible JSON (summary, per category, per request), the
familiar text summary, and saving both."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from loadtest.backends.base import RequestOutput
from loadtest.metrics import METRIC_NAMES, calculate_metrics, percentile_key, tpot_of
from loadtest.runner import LoadOutcome


def per_request(outputs: Sequence[RequestOutput], start: float) -> list[dict[str, Any]]:
    rows = []
    for o in outputs:
        tpot = tpot_of(o) if o.success else None
        rows.append({
            "request_id": o.request_id, "category": o.category, "success": o.success,
            "status_code": o.status_code, "error": o.error,
            "send_s": o.start_time - start, "prompt_len": o.prompt_len,
            "output_tokens": o.output_tokens, "cached_tokens": o.cached_tokens,
            "ttft_ms": o.ttft * 1000, "tpot_ms": None if tpot is None else tpot * 1000,
            "e2el_ms": o.latency * 1000, "itl_ms": [g * 1000 for g in o.itl],
            "chunk_tokens": o.chunk_tokens,
        })  # fmt: skip
    return rows


def build_result(
    outcome: LoadOutcome,
    setup: dict[str, Any],
    *,
    percentiles: Sequence[float] = (99.0,),
    goodput_slos_ms: dict[str, float] | None = None,
    detailed: bool = False,
) -> dict[str, Any]:
    """``setup`` holds what describes the run (backend, model_id, num_prompts, request_rate,
    ...); it comes first in the JSON, then the metrics."""
    outputs = outcome.outputs
    result: dict[str, Any] = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), **setup}
    rate = result.get("request_rate")
    if isinstance(rate, float) and math.isinf(rate):
        result["request_rate"] = "inf"
    result["goodput_slos_ms"] = goodput_slos_ms or None
    result.update(calculate_metrics(outputs, outcome.duration_s, percentiles, goodput_slos_ms))
    categories = sorted({o.category for o in outputs if o.category})
    if len(categories) > 1:
        result["categories"] = {
            name: calculate_metrics([o for o in outputs if o.category == name],
                                    outcome.duration_s, percentiles, goodput_slos_ms)
            for name in categories
        }  # fmt: skip
    if detailed:
        result["input_lens"] = [o.prompt_len for o in outputs]
        result["output_lens"] = [o.output_tokens if o.success else 0 for o in outputs]
        result["ttfts"] = [o.ttft for o in outputs]
        result["itls"] = [o.itl for o in outputs]
        result["generated_texts"] = [o.generated_text for o in outputs]
        result["errors"] = [o.error for o in outputs]
        result["requests"] = per_request(outputs, outcome.start_time)
    return result


_HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


def _line(label: str, value: object) -> str:
    if isinstance(value, float):
        return f"{label:<40} {value:<10.2f}"
    return f"{label:<40} {value!s:<10}"


def format_summary(
    result: dict[str, Any],
    percentiles: Sequence[float] = (99.0,),
    metrics: Sequence[str] = METRIC_NAMES,
    title: str = " Serving Benchmark Result ",
) -> str:
    lines = [f"{title:=^50}", _line("Successful requests:", result["completed"]),
             _line("Failed requests:", result["failed"])]  # fmt: skip
    if result["error_codes"]:
        codes = ", ".join(f"{code} x{n}" for code, n in result["error_codes"].items())
        lines.append(_line("Failure status codes:", codes))
    if result.get("max_concurrency") is not None:
        lines.append(_line("Maximum request concurrency:", result["max_concurrency"]))
    if result.get("request_rate") not in (None, "inf"):
        lines.append(_line("Request rate configured (RPS):", float(result["request_rate"])))
    lines += [
        _line("Benchmark duration (s):", float(result["duration"])),
        _line("Total input tokens:", result["total_input_tokens"]),
        _line("Total generated tokens:", result["total_output_tokens"]),
        _line("Request throughput (req/s):", float(result["request_throughput"])),
    ]
    if result.get("request_goodput") is not None:
        lines.append(_line("Request goodput (req/s):", float(result["request_goodput"])))
    lines += [
        _line("Output token throughput (tok/s):", float(result["output_throughput"])),
        _line("Peak output token throughput (tok/s):", float(result["max_output_tokens_per_s"])),
        _line("Peak concurrent requests:", result["max_concurrent_requests"]),
        _line("Total Token throughput (tok/s):", float(result["total_token_throughput"])),
    ]
    if result.get("total_cached_tokens"):
        lines.append(
            _line("Prefix cache hit rate (tokens):", float(result["prefix_cache_hit_rate"]))
        )
    for name in metrics:
        short, header = _HEADERS[name]
        lines.append(f"{header:-^50}")
        lines.append(_line(f"Mean {short} (ms):", float(result[f"mean_{name}_ms"])))
        lines.append(_line(f"Median {short} (ms):", float(result[f"median_{name}_ms"])))
        for p in percentiles:
            key = percentile_key(p)
            lines.append(_line(f"P{key} {short} (ms):", float(result[f"p{key}_{name}_ms"])))
    lines.append("=" * 50)
    return "\n".join(lines)


def result_filename(result: dict[str, Any]) -> str:
    """vLLM's default name: ``{label}-{rate}qps[-concurrency{N}]-{model}-{date}.json``."""
    label = result.get("label") or result.get("backend", "bench")
    concurrency = result.get("max_concurrency")
    extra = f"-concurrency{concurrency}" if concurrency is not None else ""
    model = Path(str(result.get("model_id", "model"))).name
    return f"{label}-{result.get('request_rate')}qps{extra}-{model}-{result['date']}.json"


def save_result(result: dict[str, Any], result_dir: str | None, filename: str | None) -> Path:
    path = Path(result_dir or ".") / (filename or result_filename(result))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
