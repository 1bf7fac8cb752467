"""PNG figures from result JSON (saved with per-request detail): latency CDFs, one line per
run; and, for a request-rate sweep, throughput and p99 latencies against the offered rate.

    .venv/bin/python -m loadtest.plots cdf  a.json b.json -o cdf.png
    .venv/bin/python -m loadtest.plots sweep rate-*.json -o sweep.png
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

_PANELS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency"))


def latency_series(
    result: Mapping[str, Any], name: str, category: str | None = None
) -> list[float]:
    """Milliseconds of one metric over a result's successful requests (ITL pooled)."""
    rows = [r for r in result.get("requests", ()) if r["success"]]
    if category is not None:
        rows = [r for r in rows if r["category"] == category]
    if name == "itl":
        return [gap for r in rows for gap in r["itl_ms"]]
    return [r[f"{name}_ms"] for r in rows if r[f"{name}_ms"] is not None]


def plot_cdfs(
    results: Mapping[str, Mapping[str, Any]], path: Path, title: str = "",
    category: str | None = None,
) -> Path:  # fmt: skip
    """One panel per metric, one empirical CDF per labelled result."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, (name, label) in zip(axes.flat, _PANELS, strict=True):
        for run_label, result in results.items():
            values = np.sort(np.asarray(latency_series(result, name, category)))
            if values.size:
                ax.step(values, np.arange(1, values.size + 1) / values.size, where="post",
                        label=f"{run_label} (p99 {np.percentile(values, 99):.0f} ms)")  # fmt: skip
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("fraction of requests" if name != "itl" else "fraction of gaps")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title or "latency CDFs" + (f" ({category} requests)" if category else ""))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sweep(
    runs: Mapping[str, Sequence[Mapping[str, Any]]], path: Path, title: str = ""
) -> Path:
    """Left: request throughput and goodput against the offered rate (the diagonal is a
    server that keeps up); right: p99 TTFT, TPOT and ITL, log scale."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    top = 0.0
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (label, results) in enumerate(runs.items()):
        color = colors[index % len(colors)]
        ordered = sorted(results, key=lambda r: float(r["request_rate"]))
        rates = [float(r["request_rate"]) for r in ordered]
        top = max(top, *rates)
        left.plot(rates, [r["request_throughput"] for r in ordered], "o-", color=color,
                  label=f"{label} throughput")  # fmt: skip
        if ordered and ordered[0].get("request_goodput") is not None:
            left.plot(rates, [r["request_goodput"] for r in ordered], "s--", color=color,
                      label=f"{label} goodput")  # fmt: skip
        for key, style in (("p99_ttft_ms", "o-"), ("p99_tpot_ms", "^--"), ("p99_itl_ms", "s:")):
            if all(key in r for r in ordered):
                right.plot(rates, [max(r[key], 1e-3) for r in ordered], style, color=color,
                           label=f"{label} {key[:-3].replace('_', ' ')}")  # fmt: skip
    left.plot([0, top], [0, top], color="grey", lw=0.8, label="offered")
    left.set_xlabel("offered request rate (req/s)")
    left.set_ylabel("req/s")
    right.set_xlabel("offered request rate (req/s)")
    right.set_ylabel("ms")
    right.set_yscale("log")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title or "request-rate sweep")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("kind", choices=["cdf", "sweep"])
    parser.add_argument("results", nargs="+", help="result JSON files saved with --save-detailed")
    parser.add_argument("-o", "--output", required=True, help="PNG path")
    parser.add_argument("--category", default=None, help="cdf: only requests of this category")
    args = parser.parse_args(argv)
    loaded = {Path(p).stem: json.loads(Path(p).read_text()) for p in args.results}
    if args.kind == "cdf":
        plot_cdfs(loaded, Path(args.output), category=args.category)
    else:
        by_label: dict[str, list[Mapping[str, Any]]] = {}
        for result in loaded.values():
            by_label.setdefault(str(result.get("label") or result.get("backend")), []).append(
                result
            )
        plot_sweep(by_label, Path(args.output))
    print(args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
