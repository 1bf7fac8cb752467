"""The load tester pointed at servers of ours with scripted latencies reports them."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from loadtest.backends.base import SendOptions
from loadtest.backends.grpc_gateway import GrpcGatewayBackend
from loadtest.backends.openai_http import OpenAIHttpBackend
from loadtest.datasets.base import SampleRequest
from loadtest.metrics import calculate_metrics
from loadtest.runner import LoadConfig, run_load
from pdserve.cli.commands import bench
from tests.loadtest.fakes import (
    FAIL_MIDWAY_TOKEN,
    FAIL_TOKEN,
    Script,
    ScriptedGateway,
    grpc_gateway,
    openai_server,
)

# Sleeps overshoot on a busy machine, never undershoot: each reported latency must lie in
# [scripted, scripted + SLACK_S], and the run's median within MEDIAN_SLACK_MS of the script.
SLACK_S = 0.25
MEDIAN_SLACK_MS = (
    80.0  # a loaded 2-core CI box adds tens of ms; a wrong definition is off by a gap (100 ms+)
)


def run(body: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(asyncio.wait_for(body(), timeout=60))


def requests(n: int, first_tokens: tuple[int, ...] = ()) -> list[SampleRequest]:
    out = [SampleRequest(f"r{i}", (5000 + i, 6000, 7000), 5) for i in range(n)]
    out += [SampleRequest(f"x{t}", (t, 6000), 5) for t in first_tokens]
    return out


def assert_near(measured: float, scripted: float, early_s: float = 0.002) -> None:
    assert scripted - early_s <= measured <= scripted + SLACK_S, (measured, scripted)


# A gap is measured between two arrivals: when the client reads the first one late (its
# event loop busy on a loaded box), the gap after it looks that much shorter.
GAP_EARLY_S = 0.010
# TPOT is (last arrival - first arrival) / (tokens - 1): a first arrival read late shortens
# every request's TPOT by that lateness over (tokens - 1). A wrong definition (per chunk, per
# token including the first, from the request's start) is off by far more.
def tpot_early_ms(tokens: int) -> float:
    return 1000.0 * GAP_EARLY_S / (tokens - 1)



@pytest.mark.parametrize("chat", [False, True])
def test_openai_http_backend_reports_scripted_latencies(chat: bool) -> None:
    script = Script(ttft_s=0.30, gap_s=0.15, tokens=(1, 1, 1, 1, 1), cached_tokens=2)

    async def body() -> Any:
        async with openai_server(script) as url:
            backend = OpenAIHttpBackend(
                url, "fake", chat=chat, detokenize=lambda ids: " ".join(map(str, ids))
            )
            await backend.ready(10)
            outcome = await run_load(backend, requests(3, (FAIL_TOKEN, FAIL_MIDWAY_TOKEN)), SendOptions(),
                                     LoadConfig(disable_tqdm=True))  # fmt: skip
            await backend.close()
            return outcome

    outcome = run(body)
    done = [o for o in outcome.outputs if o.success]
    assert len(done) == 3
    for o in done:
        assert_near(o.ttft, 0.30)
        assert len(o.itl) == 4
        for gap in o.itl:
            assert_near(gap, 0.15, GAP_EARLY_S)
        assert o.output_tokens == 5 and o.cached_tokens == 2
        assert_near(o.latency, 0.90)
    failures = {
        o.request_id.rsplit("-", 1)[-1]: o.status_code for o in outcome.outputs if not o.success
    }
    assert failures == {f"x{FAIL_TOKEN}": "HTTP 503", f"x{FAIL_MIDWAY_TOKEN}": "RuntimeError"}
    m = calculate_metrics(outcome.outputs, outcome.duration_s)
    assert (m["completed"], m["failed"]) == (3, 2)
    assert m["error_codes"] == {"HTTP 503": 1, "RuntimeError": 1}
    assert 150.0 - tpot_early_ms(5) <= m["median_tpot_ms"] <= 150.0 + MEDIAN_SLACK_MS
    assert 150.0 - 1000 * GAP_EARLY_S <= m["median_itl_ms"] <= 150.0 + MEDIAN_SLACK_MS
    assert 300.0 - 2 <= m["median_ttft_ms"] <= 300.0 + MEDIAN_SLACK_MS
    assert 900.0 - 2 <= m["median_e2el_ms"] <= 900.0 + MEDIAN_SLACK_MS


def test_grpc_backend_reports_scripted_latencies_with_multi_token_chunks() -> None:
    # Chunks of 1, 3 and 1 tokens: ITL sees two 100 ms gaps, TPOT (200 ms / 4) = 50 ms.
    script = Script(ttft_s=0.20, gap_s=0.10, tokens=(1, 3, 1), cached_tokens=16)

    async def body() -> Any:
        async with grpc_gateway(script) as (target, servicer):
            backend = GrpcGatewayBackend(target)
            await backend.ready(10)
            outcome = await run_load(backend, requests(3, (FAIL_TOKEN, FAIL_MIDWAY_TOKEN)),
                                     SendOptions(cache_salt="tenant-a"), LoadConfig(disable_tqdm=True))  # fmt: skip
            await backend.close()
            return outcome, servicer.requests

    outcome, received = run(body)
    done = [o for o in outcome.outputs if o.success]
    assert len(done) == 3
    for o in done:
        assert_near(o.ttft, 0.20)
        assert o.chunk_tokens == [1, 3, 1] and o.output_tokens == 5 and o.cached_tokens == 16
        assert len(o.itl) == 2 and all(0.10 - GAP_EARLY_S <= g <= 0.10 + SLACK_S for g in o.itl)
    m = calculate_metrics(outcome.outputs, outcome.duration_s)
    assert (m["completed"], m["failed"]) == (3, 2)
    assert m["error_codes"] == {"INTERNAL": 1, "RESOURCE_EXHAUSTED": 1}
    assert 50.0 - tpot_early_ms(5) <= m["median_tpot_ms"] <= 50.0 + 10.0
    assert 100.0 - 1000 * GAP_EARLY_S <= m["median_itl_ms"] <= 100.0 + MEDIAN_SLACK_MS
    assert 200.0 - 2 <= m["median_ttft_ms"] <= 200.0 + MEDIAN_SLACK_MS
    # What went over the wire: the exact prompt ids, greedy, exact length, the salt.
    first = next(r for r in received if r.token_ids.ids[0] == 5000)
    assert list(first.token_ids.ids) == [5000, 6000, 7000]
    assert first.sampling.max_tokens == 5 and first.sampling.ignore_eos
    assert first.sampling.HasField("temperature") and first.sampling.temperature == 0.0
    assert first.cache_salt == "tenant-a"
    assert len({r.request_id for r in received}) == 5


def bench_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve")
    bench.register(parser.add_subparsers(dest="command"))
    return parser


VLLM_KEYS = (
    "date", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
    "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
    "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests",
    *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "std", "p99")),
)  # fmt: skip


def test_bench_serve_command_against_the_fake_http_server(tmp_path: Path, smollm_dir: Path) -> None:
    script = Script(ttft_s=0.05, gap_s=0.02, tokens=(1, 1, 1))

    async def body() -> int:
        async with openai_server(script) as url:
            args = bench_parser().parse_args([
                "bench", "serve", "--backend", "openai", "--base-url", url, "--tokenizer", str(smollm_dir),
                "--dataset-name", "random", "--random-input-len", "12", "--random-output-len", "3",
                "--num-prompts", "4", "--request-rate", "50", "--goodput", "ttft:1000", "tpot:500",
                "--metric-percentiles", "50,99", "--save-result", "--save-detailed", "--plot",
                "--result-dir", str(tmp_path), "--result-filename", "run.json", "--disable-tqdm",
                "--metadata", "machine=ci",
            ])  # fmt: skip
            from loadtest.serve import run_serve

            return int((await run_serve(args))["completed"])

    assert run(body) == 4
    result = json.loads((tmp_path / "run.json").read_text())
    missing = [k for k in VLLM_KEYS if k not in result]
    assert not missing
    assert result["machine"] == "ci" and result["request_rate"] == 50.0
    assert result["completed"] == 4 and result["total_input_tokens"] == 48
    assert result["total_output_tokens"] == 12 and result["good_requests"] == 4
    assert len(result["requests"]) == 4 and len(result["ttfts"]) == 4 and "p50_ttft_ms" in result
    png = tmp_path / "run.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_serve_command_against_the_fake_gateway(tmp_path: Path) -> None:
    script = Script(ttft_s=0.05, gap_s=0.02, tokens=(2, 2))

    async def body() -> dict[str, Any]:
        async with grpc_gateway(script) as (target, _):
            args = bench_parser().parse_args([
                "bench", "serve", "--base-url", target, "--dataset-name", "multi-turn",
                "--num-prompts", "4", "--multi-turn-num-turns", "2", "--multi-turn-system-len", "8",
                "--multi-turn-user-len", "4", "--multi-turn-output-len", "4", "--disable-tqdm",
                "--save-result", "--result-dir", str(tmp_path),
            ])  # fmt: skip
            from loadtest.serve import run_serve

            return await run_serve(args)

    result = run(body)
    assert result["backend"] == "pdserve" and result["completed"] == 4
    assert result["total_input_tokens"] == 2 * 12 + 2 * 20  # turn 0: 8 + 4; turn 1: 12 + 4 + 4
    assert set(result["categories"]) == {"turn-0", "turn-1"}
    saved = list(tmp_path.glob("pdserve-infqps-default-*.json"))
    assert len(saved) == 1 and "requests" not in json.loads(saved[0].read_text())


def _serve_args(backend: str, url: str, *extra: str) -> list[str]:
    return ["bench", "serve", "--backend", backend, "--base-url", url, "--dataset-name", "random",
            "--random-input-len", "8", "--random-output-len", "2", "--num-prompts", "3",
            "--disable-tqdm", *extra]  # fmt: skip


@pytest.mark.parametrize("with_key", [True, False])
def test_bench_serve_sends_the_api_key_to_the_gateway(with_key: bool) -> None:
    """--api-key travels as 'authorization: Bearer KEY' with every call (the real gateway
    answers UNAUTHENTICATED without it), and --header entries go along."""
    script = Script(ttft_s=0.01, gap_s=0.01, tokens=(1, 1))

    async def body() -> tuple[dict[str, Any], ScriptedGateway]:
        async with grpc_gateway(script, api_key="k-123") as (target, gateway):
            flags = ["--api-key", "k-123" if with_key else "wrong", "--header", "x-tenant-hint=a"]
            from loadtest.serve import run_serve

            args = bench_parser().parse_args(_serve_args("pdserve", target, *flags))
            if not with_key:
                # Model info is asked first, with the same (wrong) key.
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await run_serve(args)
                assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
                return {}, gateway
            return await run_serve(args), gateway

    result, gateway = run(body)
    if with_key:
        assert result["completed"] == 3 and result["failed"] == 0
        assert len(gateway.metadata) == 3
        assert all(m["authorization"] == "Bearer k-123" for m in gateway.metadata)
        assert all(m["x-tenant-hint"] == "a" for m in gateway.metadata)


def test_bench_serve_sends_the_api_key_over_http(smollm_dir: Path) -> None:
    script = Script(ttft_s=0.01, gap_s=0.01, tokens=(1, 1))

    async def body(key: str) -> dict[str, Any]:
        async with openai_server(script, api_key="k-456") as url:
            from loadtest.serve import run_serve

            args = bench_parser().parse_args(
                _serve_args("openai", url, "--tokenizer", str(smollm_dir), "--api-key", key)
            )
            return await run_serve(args)

    good = run(lambda: body("k-456"))
    assert good["completed"] == 3 and good["failed"] == 0
    bad = run(lambda: body("nope"))
    assert bad["completed"] == 0 and bad["failed"] == 3
