"""bench_formats' summary of a format's rounds: best speeds, and the single stream's ratio to
the llama-bench run beside each round, with its median."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest import bench_formats
from loadtest.bench_formats import STREAMS, summarize


def rounds(*single: float) -> list[dict[str, object]]:
    return [
        {"label": "Q2_K", "weight_mb": 83.0, "single_tok_s": s, f"c{STREAMS}_tok_s": 10 * s}
        for s in single
    ]


def test_each_round_is_judged_against_the_llama_bench_run_beside_it() -> None:
    row = summarize(rounds(300.0, 240.0, 270.0), [200.0, 150.0, 180.0])
    assert row["single_tok_s"] == 300.0 and row[f"c{STREAMS}_tok_s"] == 3000.0
    assert row["single_tok_s_rounds"] == [300.0, 240.0, 270.0]
    assert row["llama_bench_tg"] == 200.0
    assert row["single_x_llama_bench_rounds"] == [1.5, 1.6, 1.5]
    assert row["single_x_llama_bench_median"] == 1.5


def test_a_format_without_llama_bench_or_with_a_failed_run_has_no_ratio() -> None:
    assert "llama_bench_tg" not in summarize(rounds(100.0), [])
    row = summarize(rounds(100.0, 120.0), [80.0])  # one llama-bench run failed
    assert row["llama_bench_tg"] == 80.0
    assert "single_x_llama_bench_median" not in row


def test_a_crashed_llama_bench_falls_back_to_the_better_run_that_works(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runs: list[list[str]] = []

    def run(binary: Path, gguf: str, tokens: int, threads: int, extra: list[str]) -> float | None:
        runs.append(extra)
        return {("-d", "32"): None, ("-d", "32", "--repack", "0"): 76.0, ("-d", "0"): 85.0}[
            tuple(extra)
        ]

    monkeypatch.setattr(bench_formats, "_llama_bench_run", run)
    assert bench_formats.llama_bench(Path("llama-bench"), "m.gguf", 128, 2, 32) == 85.0
    assert runs[0] == ["-d", "32"]  # the run as built comes first
    monkeypatch.setattr(bench_formats, "_llama_bench_run", lambda *a: 90.0)
    assert bench_formats.llama_bench(Path("llama-bench"), "m.gguf", 128, 2, 32) == 90.0
    monkeypatch.setattr(bench_formats, "_llama_bench_run", lambda *a: None)
    assert bench_formats.llama_bench(Path("llama-bench"), "m.gguf", 128, 2, 32) is None


def test_each_measurement_reports_its_figures_as_it_ends() -> None:
    result = rounds(150.5)[0]
    line = bench_formats.progress(2, result, 120.26)
    assert line == f"round 2: Q2_K 1 stream 150.5 tok/s, {STREAMS} streams 1505.0 tok/s, llama-bench 120.3 tok/s"
    # no llama-bench run beside it (a float checkpoint, or the run failed): no figure
    assert bench_formats.progress(1, result, None).endswith(f"{STREAMS} streams 1505.0 tok/s")
