"""Every metric on hand-made stream timelines with known answers."""

from __future__ import annotations

import pytest

from loadtest.backends.base import RequestOutput
from loadtest.metrics import calculate_metrics, is_good, parse_goodput, peak_output_rate, tpot_of


def stream(
    chunks: list[tuple[float, int]], *, start: float = 0.0, end: float | None = None,
    prompt_len: int = 10, category: str = "",
) -> RequestOutput:  # fmt: skip
    """A successful request sent at ``start`` whose content chunks arrived at the given
    times with the given token counts; the stream ended at ``end`` (the last chunk)."""
    out = RequestOutput("r", prompt_len, category, success=True, start_time=start)
    for when, tokens in chunks:
        out.add_chunk(when, tokens)
    out.end_time = end if end is not None else chunks[-1][0]
    out.output_tokens = sum(n for _, n in chunks)
    return out


def failed(code: str, prompt_len: int = 10) -> RequestOutput:
    return RequestOutput(
        "f", prompt_len, status_code=code, error="boom", start_time=0.0, end_time=0.1
    )


def test_one_token_per_chunk() -> None:
    out = stream([(0.100, 1), (0.150, 1), (0.250, 1)])
    assert out.ttft == pytest.approx(0.100)
    assert out.itl == pytest.approx([0.050, 0.100])
    assert out.latency == pytest.approx(0.250)
    assert tpot_of(out) == pytest.approx(0.075)  # (250 - 100) / (3 - 1)
    m = calculate_metrics([out], duration_s=1.0)
    assert m["mean_ttft_ms"] == pytest.approx(100.0)
    assert m["mean_tpot_ms"] == pytest.approx(75.0)
    assert m["mean_itl_ms"] == pytest.approx(75.0)
    assert m["median_itl_ms"] == pytest.approx(75.0)
    assert m["mean_e2el_ms"] == pytest.approx(250.0)


def test_a_multi_token_chunk_is_one_itl_gap_but_counts_every_token_in_tpot() -> None:
    out = stream([(0.2, 1), (0.3, 3), (0.4, 1)])
    m = calculate_metrics([out], duration_s=1.0)
    assert out.output_tokens == 5
    assert m["total_output_tokens"] == 5
    assert m["mean_itl_ms"] == pytest.approx(100.0)  # two gaps of 100 ms
    assert m["mean_tpot_ms"] == pytest.approx(50.0)  # (400 - 200) / (5 - 1)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)


def test_single_token_requests_have_no_tpot_and_no_itl() -> None:
    single = stream([(0.3, 1)], end=0.31)
    assert tpot_of(single) is None
    assert single.itl == []
    m = calculate_metrics([single], duration_s=1.0)
    assert m["mean_tpot_ms"] == 0.0 and m["p99_tpot_ms"] == 0.0  # empty series report 0
    assert m["mean_itl_ms"] == 0.0
    assert m["mean_ttft_ms"] == pytest.approx(300.0)
    assert m["mean_e2el_ms"] == pytest.approx(310.0)
    # Next to a longer request, it adds a TTFT and an E2EL, but no TPOT and no ITL.
    longer = stream([(0.1, 1), (0.2, 1), (0.3, 1)])
    m = calculate_metrics([single, longer], duration_s=1.0)
    assert m["mean_tpot_ms"] == pytest.approx(100.0)
    assert m["mean_itl_ms"] == pytest.approx(100.0)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)  # (300 + 100) / 2


def test_itl_is_pooled_over_requests_and_percentiles_interpolate() -> None:
    a = stream([(0.0, 1), (0.01, 1), (0.03, 1), (0.06, 1)])  # gaps 10, 20, 30
    b = stream([(1.0, 1), (1.04, 1), (1.09, 1)], start=0.9)  # gaps 40, 50
    m = calculate_metrics([a, b], duration_s=2.0, percentiles=[50, 90, 99, 99.9])
    assert m["mean_itl_ms"] == pytest.approx(30.0)
    assert m["median_itl_ms"] == pytest.approx(30.0)
    assert m["p99_itl_ms"] == pytest.approx(49.6)  # 40 + 0.96 * (50 - 40)
    assert m["p90_itl_ms"] == pytest.approx(46.0)  # 40 + 0.6 * 10
    assert m["p99.9_itl_ms"] == pytest.approx(49.96)
    assert m["std_itl_ms"] == pytest.approx(14.142135, rel=1e-6)


def test_throughputs_count_completed_requests_over_the_whole_duration() -> None:
    outs = [
        stream([(0.1, 1), (0.2, 2)], prompt_len=100),
        stream([(0.5, 1), (0.6, 1), (0.7, 1)], start=0.4, prompt_len=50),
        failed("UNAVAILABLE", prompt_len=999),
        failed("UNAVAILABLE"),
        failed("HTTP 503"),
    ]
    m = calculate_metrics(outs, duration_s=2.0)
    assert (m["completed"], m["failed"]) == (2, 3)
    assert m["error_codes"] == {"HTTP 503": 1, "UNAVAILABLE": 2}
    assert m["total_input_tokens"] == 150  # failed requests' prompts are not counted
    assert m["total_output_tokens"] == 6
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(3.0)
    assert m["total_token_throughput"] == pytest.approx(78.0)
    assert m["request_goodput"] is None and m["good_requests"] is None


def test_goodput_counts_requests_meeting_every_slo() -> None:
    fast = stream([(0.1, 1), (0.15, 1), (0.2, 1)])  # ttft 100, tpot 50, e2el 200
    slow_start = stream([(0.5, 1), (0.55, 1)])  # ttft 500, tpot 50, e2el 550
    slow_decode = stream([(0.1, 1), (0.4, 1)])  # ttft 100, tpot 300
    single = stream([(0.2, 1)])  # ttft 200, tpot counts as 0
    outs = [fast, slow_start, slow_decode, single]
    m = calculate_metrics(outs, duration_s=4.0, goodput_slos_ms={"ttft": 200, "tpot": 100})
    assert m["good_requests"] == 2  # fast and single (ttft exactly at the SLO passes)
    assert m["request_goodput"] == pytest.approx(0.5)
    assert is_good(slow_start, {"e2el": 550})
    assert not is_good(slow_start, {"e2el": 549})


def test_peak_output_rate_buckets_tokens_by_whole_seconds() -> None:
    a = stream([(0.5, 1), (0.9, 2), (1.2, 1)])
    b = stream([(0.3, 1), (2.5, 1)], start=0.1)
    assert peak_output_rate([a, b]) == (4.0, 2)


def test_empty_and_failed_only_runs_report_zeros() -> None:
    m = calculate_metrics([failed("CANCELLED")], duration_s=1.0, percentiles=[99])
    assert m["completed"] == 0 and m["failed"] == 1
    assert m["mean_ttft_ms"] == 0.0 and m["p99_e2el_ms"] == 0.0
    assert m["max_output_tokens_per_s"] == 0.0


def test_prefix_cache_hit_rate_is_cached_over_prompt_tokens() -> None:
    a = stream([(0.1, 1)], prompt_len=100)
    a.cached_tokens = 64
    b = stream([(0.1, 1)], prompt_len=100)
    m = calculate_metrics([a, b], duration_s=1.0)
    assert m["total_cached_tokens"] == 64
    assert m["prefix_cache_hit_rate"] == pytest.approx(0.32)


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:2000.5"]) == {
        "ttft": 500.0, "tpot": 50.0, "e2el": 2000.5,
    }  # fmt: skip
    assert parse_goodput(None) == {}
    for bad in (["ttft"], ["itl:5"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
