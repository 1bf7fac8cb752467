"""The soak report's arithmetic: memory growth and slope, windows, the text report."""

from __future__ import annotations

import pytest

from loadtest.backends.base import RequestOutput
from loadtest.soak import MemoryTrack, MiB, SoakConfig, format_report, growth_slope, window_rows


def test_growth_slope_is_the_least_squares_rate() -> None:
    # 1 MiB per minute, with noise that cancels out.
    samples = [(60.0 * i, (100 + i) * MiB + (MiB // 4 if i % 2 else -MiB // 4)) for i in range(11)]
    assert growth_slope(samples) * 3600 / MiB == pytest.approx(60.0, rel=0.05)
    assert growth_slope(samples[:2]) == 0.0  # too few to tell
    assert growth_slope([(5.0, MiB)] * 4) == 0.0  # no spread in time


def test_memory_summary_measures_growth_after_the_warm_up() -> None:
    # Start-up allocation in the first 2 minutes, flat afterwards.
    track = MemoryTrack("decode-0", 42)
    track.samples = [(0.0, 200 * MiB), (60.0, 600 * MiB), (120.0, 700 * MiB), (600.0, 700 * MiB),
                     (1200.0, 702 * MiB)]  # fmt: skip
    summary = track.summary(warmup_s=120.0)
    assert summary["rss_start_mib"] == 200.0 and summary["rss_settled_mib"] == 700.0
    assert summary["rss_end_mib"] == 702.0 and summary["rss_peak_mib"] == 702.0
    assert summary["growth_mib"] == 2.0
    assert 0 < summary["slope_mib_per_h"] < 10
    # The second half (from 600 s): 700 -> 702.
    assert summary["late_growth_mib"] == 2.0


def test_a_cache_filling_past_the_warm_up_is_told_apart_by_the_second_half() -> None:
    """The block store fills to its bound for minutes: growth after the warm-up is large,
    the second half is flat. A leak grows in both."""
    filling = MemoryTrack("blockstore", 1)
    filling.samples = [(60.0 * i, min(500 + 100 * i, 1200) * MiB) for i in range(31)]
    leaking = MemoryTrack("leaky", 2)
    leaking.samples = [(60.0 * i, (500 + 10 * i) * MiB) for i in range(31)]
    fill, leak = filling.summary(warmup_s=120.0), leaking.summary(warmup_s=120.0)
    assert fill["growth_mib"] == 500.0 and fill["late_growth_mib"] == 0.0
    assert fill["late_slope_mib_per_h"] == 0.0
    assert leak["late_growth_mib"] == 150.0
    assert leak["late_slope_mib_per_h"] == pytest.approx(600.0)


def test_windows_split_requests_by_send_time() -> None:
    outputs = []
    for i in range(6):
        out = RequestOutput(
            f"r{i}", 10, success=i != 4, status_code="" if i != 4 else "UNAVAILABLE"
        )
        out.start_time = 100.0 + i * 10  # sends at 0, 10, ..., 50 s
        if out.success:
            out.add_chunk(out.start_time + 0.5, 1)
            out.add_chunk(out.start_time + 0.7, 1)
            out.end_time = out.start_time + 0.7
            out.output_tokens = 2
        outputs.append(out)
    rows = window_rows(outputs, start=100.0, duration_s=60.0, n=3)
    assert [(r["sent"], r["completed"], r["failed"]) for r in rows] == [
        (2, 2, 0),
        (2, 2, 0),
        (2, 1, 1),
    ]
    assert rows[0]["p50_ttft_ms"] == pytest.approx(500.0)
    assert rows[0]["p50_tpot_ms"] == pytest.approx(200.0)


def test_config_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="load_fraction"):
        SoakConfig(load_fraction=0)
    with pytest.raises(ValueError, match="warmup_s"):
        SoakConfig(duration_s=60, warmup_s=60)


def test_the_text_report_names_every_process_and_failure() -> None:
    result = {
        "setup": {"duration_s": 60.0, "load_fraction": 0.7, "request_rate": 0.7,
                  "num_requests": 42, "warmup_s": 10.0},
        "capacity": {"rps": 1.0, "clients": 4},
        "completed": 41, "failed": 1, "failures_by_code": {"UNAVAILABLE": 1},
        "memory": [MemoryTrack("gateway", 7, [(0.0, MiB), (20.0, 2 * MiB), (60.0, 2 * MiB)]).summary(10.0)],
        "windows": [{"from_s": 0, "to_s": 60, "sent": 42, "completed": 41, "failed": 1,
                     "p50_ttft_ms": 100.0, "p99_ttft_ms": 300.0, "p50_tpot_ms": 50.0, "p99_tpot_ms": 80.0}],
        "summary": {"request_throughput": 0.68, "output_throughput": 20.0, "median_ttft_ms": 100.0,
                    "p99_ttft_ms": 300.0, "mean_tpot_ms": 50.0, "p99_tpot_ms": 80.0,
                    "prefix_cache_hit_rate": 0.4},
        "kv_blocks_after": [{"id": "decode-0", "free": 10, "total": 10}],
    }  # fmt: skip
    text = format_report(result)
    assert "70% of capacity" in text and "{'UNAVAILABLE': 1}" in text
    assert "gateway" in text and "decode-0 10/10" in text


def test_rss_parts_put_a_large_buffer_apart_from_the_heap() -> None:
    import mmap
    import os

    import psutil

    from loadtest.soak import BIG_MAPPING, RSS_PARTS, rss_parts

    before = rss_parts(os.getpid())
    assert before is not None and set(before) == set(RSS_PARTS)
    # A mapping of its own, as a KV pool is (malloc's thresholds, which other tests in this
    # process may have raised, would decide where a numpy array lands).
    buffer = mmap.mmap(-1, BIG_MAPPING + (1 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for offset in range(0, len(buffer), mmap.PAGESIZE):  # touched: resident
        buffer[offset] = 1
    after = rss_parts(os.getpid())
    assert after is not None
    assert after["big_anon"] - before["big_anon"] >= BIG_MAPPING
    assert sum(after.values()) <= psutil.Process().memory_info().rss * 1.05
    assert rss_parts(2**22 + 12345) is None  # no such process
    buffer.close()
