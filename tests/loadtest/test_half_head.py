"""bench_half_head: one row per path and row count, each path's speed-up against float16's
time in the same run."""

from __future__ import annotations

import pytest

from kernels.cpu import available
from loadtest.bench_half_head import measure

pytestmark = pytest.mark.skipif(not available(), reason="the C++ CPU kernels do not build here")


def test_every_path_is_timed_against_the_float16_head() -> None:
    results = measure([1, 3], repeats=1)
    assert [(r["rows"], r["path"]) for r in results] == [
        (m, path) for m in (1, 3) for path in ("bf16", "f16", "fp32 gemm")
    ]
    for r in results:
        assert float(r["ms"]) > 0 and float(r["gb_per_s"]) > 0
        f16 = next(x for x in results if x["rows"] == r["rows"] and x["path"] == "f16")
        # vs_f16 comes from the unrounded times, ms is printed to 3 decimals.
        assert r["vs_f16"] == pytest.approx(float(f16["ms"]) / float(r["ms"]), abs=0.011)
