"""``pdserve bench soak`` against the shared real stack, shortened to seconds: capacity is
measured, the load runs at a fraction of it, every process's RSS is sampled, and the
report (JSON, text, PNG) says what the closing note quotes from the 30-minute run."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from loadtest.soak import SoakConfig, save, soak, stack_processes
from tests.integration.conftest import Stack

pytestmark = pytest.mark.slow


def test_a_short_soak_reports_memory_of_every_process_and_no_failure(
    stack: Stack, tmp_path: Path
) -> None:
    processes = stack_processes(stack.run_dir)
    assert {"redis", "gateway", "blockstore", "prefill-0", "decode-1"} <= set(processes)
    config = SoakConfig(
        duration_s=16, load_fraction=0.5, capacity_s=8, capacity_clients=2, input_len=48,
        output_len=4, num_prefixes=2, sample_s=1.0, warmup_s=4, windows=2,
    )  # fmt: skip
    result = asyncio.run(soak(stack.target, processes, config))

    assert result["capacity"]["completed"] > 0 and result["capacity"]["failed"] == 0
    rate = result["setup"]["request_rate"]
    assert rate == pytest.approx(0.5 * result["capacity"]["rps"])
    assert result["completed"] == result["setup"]["num_requests"] and result["failed"] == 0
    by_name = {m["name"]: m for m in result["memory"]}
    assert set(by_name) == set(processes)
    for name, memory in by_name.items():
        assert memory["exited_at_s"] is None, f"{name} exited during the soak"
        assert memory["rss_end_mib"] > 1, name
        assert len(result["memory_samples"][name]) >= 10, name  # every second for 16+ s
    assert sum(w["sent"] for w in result["windows"]) == result["setup"]["num_requests"]
    assert all(b["free"] == b["total"] for b in result["kv_blocks_after"])

    report = save(result, tmp_path)
    text = report.read_text()
    assert "decode-1" in text and "KV blocks free after the load" in text
    assert json.loads((tmp_path / "soak.json").read_text())["completed"] == result["completed"]
    assert (tmp_path / "soak.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
