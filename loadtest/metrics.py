"""Serving metrics, as vLLM's ``bench serve`` defines them, from client-side stream records.

Per successful request:
- TTFT: send -> first content chunk.
- TPOT: (E2E - TTFT) / (output tokens - 1), for requests with more than one output token
  (for goodput a single-token request counts as TPOT 0).
- ITL: every gap between consecutive content chunks, pooled over all requests; a chunk
  that carries several tokens is one gap, so ITL and TPOT differ when chunks do.
- E2EL: send -> end of the stream.
Throughputs divide by the whole benchmark's duration: requests completed, output tokens,
input + output tokens, and goodput (requests that met every SLO given) per second.
Percentiles are numpy's linear interpolation; an empty series reports 0, as vLLM does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from loadtest.backends.base import RequestOutput

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")


def parse_goodput(pairs: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs or ():
        name, sep, value = pair.partition(":")
        if not sep:
            raise ValueError(f"goodput SLO {pair!r} is not KEY:MS (e.g. ttft:500)")
        if name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"goodput SLO {name!r}: the keys are ttft, tpot and e2el")
        slos[name] = float(value)
        if slos[name] < 0:
            raise ValueError(f"goodput SLO {pair!r} must be >= 0")
    return slos


def parse_percentiles(text: str) -> list[float]:
    values = [float(p) for p in text.split(",") if p.strip()]
    if any(not 0 < p <= 100 for p in values):
        raise ValueError(f"percentiles must be in (0, 100], got {text!r}")
    return values


def percentile_key(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def tpot_of(output: RequestOutput) -> float | None:
    if output.output_tokens <= 1:
        return None
    return (output.latency - output.ttft) / (output.output_tokens - 1)


def is_good(output: RequestOutput, slos_ms: dict[str, float]) -> bool:
    values = {"ttft": output.ttft, "tpot": tpot_of(output) or 0.0, "e2el": output.latency}
    return all(values[name] * 1000 <= slo for name, slo in slos_ms.items())


def _stats(name: str, values_s: list[float], percentiles: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(values_s or [0.0], dtype=np.float64) * 1000
    stats = {
        f"mean_{name}_ms": float(np.mean(ms)),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(np.std(ms)),
    }
    for p in percentiles:
        stats[f"p{percentile_key(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return stats


def peak_output_rate(outputs: Sequence[RequestOutput]) -> tuple[float, int]:
    """Most output tokens seen in one whole second from the first send, and most requests
    in flight in any such second (vLLM's max_output_tokens_per_s, max_concurrent_requests).
    A chunk whose token count is unknown counts as one token."""
    done = [o for o in outputs if o.success]
    if not done:
        return 0.0, 0
    start = min(o.start_time for o in done)
    seconds = int(np.ceil(max(o.end_time for o in done) - start)) + 1
    tokens = np.zeros(seconds)
    in_flight = np.zeros(seconds)
    for o in done:
        for when, count in zip(o.chunk_times, o.chunk_tokens, strict=True):
            tokens[int(when - start)] += max(count, 1)
        in_flight[int(o.start_time - start) : int(o.end_time - start) + 1] += 1
    return float(tokens.max()), int(in_flight.max())


def calculate_metrics(
    outputs: Sequence[RequestOutput],
    duration_s: float,
    percentiles: Sequence[float] = (99.0,),
    goodput_slos_ms: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The summary of a run, keyed as vLLM's result JSON (plus ``error_codes``,
    ``total_cached_tokens`` and ``prefix_cache_hit_rate``)."""
    if not duration_s > 0:
        raise ValueError(f"duration must be > 0, got {duration_s}")
    done = [o for o in outputs if o.success]
    failed = [o for o in outputs if not o.success]
    total_input = sum(o.prompt_len for o in done)
    total_output = sum(o.output_tokens for o in done)
    total_cached = sum(o.cached_tokens for o in done)
    series = {
        "ttft": [o.ttft for o in done],
        "tpot": [t for o in done if (t := tpot_of(o)) is not None],
        "itl": [gap for o in done for gap in o.itl],
        "e2el": [o.latency for o in done],
    }
    good = sum(is_good(o, goodput_slos_ms) for o in done) if goodput_slos_ms else None
    peak_tokens, peak_requests = peak_output_rate(done)
    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(failed),
        "error_codes": dict(sorted(Counter(o.status_code or "unknown" for o in failed).items())),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "request_goodput": None if good is None else good / duration_s,
        "good_requests": good,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_requests,
        "total_cached_tokens": total_cached,
        "prefix_cache_hit_rate": total_cached / total_input if total_input else 0.0,
    }
    for name in METRIC_NAMES:
        result.update(_stats(name, series[name], percentiles))
    return result
