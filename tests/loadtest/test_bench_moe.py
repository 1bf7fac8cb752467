"""loadtest/bench_moe.py runs, and every implementation it times agrees with ours
(correctness only: no timed assertions)."""

from __future__ import annotations

import argparse

import pytest

from loadtest.bench_moe import SHAPES, bench_shape


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_timed_implementation_computes_the_same_layer(shape: str) -> None:
    args = argparse.Namespace(seed=0, min_repeats=1, min_seconds=0.0, max_naive_pairs=64)
    result = bench_shape(SHAPES[shape], 4, args, with_hf=True)
    assert {"grouped", "per-token", "hf eager"} <= set(result["ms"])
    assert all(diff < 1e-4 for diff in result["max_abs_diff"].values()), result["max_abs_diff"]
    assert result["ratio_vs_grouped"]["grouped"] == 1.0
