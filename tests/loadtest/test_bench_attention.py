"""loadtest/bench_attention.py's prefill comparison runs the engine's own two prompt paths."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import available

pytestmark = pytest.mark.skipif(not available(), reason="the C++ CPU kernels do not build here")


@pytest.mark.parametrize(("prefix", "chunk"), [(0, 24), (40, 8)])
def test_both_prompt_paths_are_timed(prefix: int, chunk: int) -> None:
    from loadtest.bench_attention import measure_prefill

    r = measure_prefill(prefix, chunk, repeats=1, dtype=torch.float32)
    assert (r["prefix"], r["chunk"]) == (prefix, chunk)
    assert r["kernel_us_per_layer"] > 0 and r["sdpa_us_per_layer"] > 0
