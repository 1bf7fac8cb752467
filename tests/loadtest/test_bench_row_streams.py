"""bench_row_streams runs both arms on every kind of weight it takes (the x16 layouts and a
KQx16 type), checks their bits agree, and prints one line per type."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.cpu import available
from kernels.cpu import quant as cpu_quant
from kernels.cpu.kquant import kq_available

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    not available() or not cpu_quant.has_x16() or not kq_available(),
    reason="no x16 kernels here (the CPU lacks AVX-512 BW / VL or VNNI)",
)
def test_it_times_both_arms_of_each_type() -> None:
    types = ["q4_0", "q4_1", "q8_0", "Q5_0"]
    done = subprocess.run(
        [sys.executable, "loadtest/bench_row_streams.py", "--types", ",".join(types),
         "--layers", "1", "--rounds", "2", "--steps", "1", "--evict-mb", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if re.match(r"\w+: [\d.]+ MB", line)]
    assert [line.split(":")[0] for line in lines] == types
    for line in lines:
        assert re.search(r"4 runs [\d.]+ \([\d.]+ GB/s\), 1 run [\d.]+ \([\d.]+ GB/s\), ratio [\d.]+$", line), line
