"""Result JSON, text summary, file names, figures, and the transformers baseline's streamer."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch

from loadtest.backends.base import RequestOutput
from loadtest.baselines.hf_server import Job, StreamRows
from loadtest.plots import plot_cdfs, plot_sweep
from loadtest.report import build_result, format_summary, result_filename, save_result
from loadtest.runner import LoadOutcome
from loadtest.scenarios.rate_sweep import saturation_rate


def output(category: str, start: float, chunks: list[float], success: bool = True) -> RequestOutput:
    out = RequestOutput(f"id-{category}-{start}", 8, category, success=success, start_time=start)
    for when in chunks:
        out.add_chunk(when, 1, "t")
    out.end_time = chunks[-1] if chunks else start
    out.output_tokens = len(chunks) if success else 0
    out.status_code = "" if success else "UNAVAILABLE"
    return out


def outcome() -> LoadOutcome:
    outputs = [
        output("chat", 10.0, [10.1, 10.2, 10.3]),
        output("chat", 10.5, [10.7, 10.8]),
        output("long", 10.2, [11.2, 11.3]),
        output("long", 10.3, [], success=False),
    ]
    return LoadOutcome(outputs, duration_s=2.0, start_time=10.0, offsets_s=[0.0, 0.5, 0.2, 0.3])


def test_result_has_setup_metrics_categories_and_per_request_rows() -> None:
    result = build_result(outcome(), {"backend": "pdserve", "request_rate": math.inf, "model_id": "m"},
                          percentiles=[50, 99], goodput_slos_ms={"ttft": 500}, detailed=True)  # fmt: skip
    assert result["request_rate"] == "inf"
    assert (result["completed"], result["failed"], result["good_requests"]) == (3, 1, 2)
    assert result["categories"]["chat"]["completed"] == 2
    assert result["categories"]["long"]["error_codes"] == {"UNAVAILABLE": 1}
    assert result["categories"]["chat"]["mean_ttft_ms"] == pytest.approx(150.0)
    row = result["requests"][0]
    assert row["send_s"] == 0.0 and row["ttft_ms"] == pytest.approx(100.0)
    assert row["itl_ms"] == pytest.approx([100.0, 100.0]) and row["tpot_ms"] == pytest.approx(100.0)
    assert result["output_lens"] == [3, 2, 2, 0]
    assert result["itls"][3] == []
    text = format_summary(result, [50, 99])
    for line in ("Successful requests:                     3", "Failure status codes:", "UNAVAILABLE x1",
                 "Request goodput (req/s):", "P99 ITL (ms):", "Mean E2EL (ms):"):  # fmt: skip
        assert line in text, line


def test_result_file_name_and_save(tmp_path: Path) -> None:
    result = build_result(outcome(), {"backend": "openai", "label": "peer", "request_rate": 2.0,
                                      "max_concurrency": 4, "model_id": "/x/SmolLM2"})  # fmt: skip
    name = result_filename(result)
    assert name == f"peer-2.0qps-concurrency4-SmolLM2-{result['date']}.json"
    assert save_result(result, str(tmp_path), None) == tmp_path / name
    assert "requests" not in result


def test_figures_are_pngs(tmp_path: Path) -> None:
    detailed = build_result(outcome(), {"backend": "pdserve", "request_rate": 1.0}, detailed=True)
    cdf = plot_cdfs({"a": detailed, "b": detailed}, tmp_path / "cdf.png", category="chat")
    sweep_results = []
    for rate, goodput in ((0.5, 0.5), (1.0, 0.95), (2.0, 1.2)):
        r = dict(
            detailed, request_rate=rate, request_throughput=min(rate, 1.5), request_goodput=goodput
        )
        sweep_results.append(r)
    sweep = plot_sweep({"pdserve": sweep_results}, tmp_path / "sweep.png")
    for path in (cdf, sweep):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    assert saturation_rate(sweep_results) == 2.0  # 1.2 < 0.9 x 2
    assert saturation_rate(sweep_results[:2]) is None


def test_hf_baseline_streams_each_row_and_stops_rows_that_are_done() -> None:
    async def body() -> list[list[int | None]]:
        loop = asyncio.get_running_loop()
        jobs = [Job([1], max_tokens=3, ignore_eos=True, loop=loop),
                Job([1], max_tokens=5, ignore_eos=False, loop=loop)]  # fmt: skip
        stream = StreamRows(jobs, eos_ids={2})
        steps = [[5, 6], [7, 2], [8, 9], [9, 9]]  # row 1 samples eos at step 2
        flags = []
        ids = torch.tensor([[0], [0]])
        for step in steps:
            ids = torch.cat([ids, torch.tensor(step).unsqueeze(1)], dim=1)
            flags.append(stream(ids, None).tolist())
        await asyncio.sleep(0)
        assert flags == [[False, False], [False, True], [True, True], [True, True]]
        got = []
        for job in jobs:
            items = []
            while not job.tokens.empty():
                items.append(job.tokens.get_nowait())
            got.append(items)
        return got

    assert asyncio.run(body()) == [[5, 7, 8, None], [6, 2, None]]
