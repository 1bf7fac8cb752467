"""The raw-bytes harness in CI: the seeds and crafted hostile bytes through the real
GatewayServicer, then a bounded atheris run (skipped where atheris does not install)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from pdserve.gateway.v1 import gateway_pb2
from tests.fuzz.gateway_harness import FORBIDDEN, Harness, seeds

ATHERIS_RUNS = 3000  # about 30 s here


@pytest.fixture(scope="module")
def harness(smollm_dir: Path) -> Harness:
    return Harness(str(smollm_dir))


def hostile() -> list[bytes]:
    generate = gateway_pb2.GenerateRequest
    return [
        b"",
        b"\x0a\x05ab",  # truncated string
        b"\x4b" * 200 + b"\x4c" * 200,  # groups nested past the recursion limit
        b"\x28" + b"\xff" * 10,  # an over-long varint
        generate(raw_prompt="x", sampling={"max_tokens": 10**9}).SerializeToString(),
        generate(raw_prompt="x", sampling={"stop": ["a"] * 100_000}).SerializeToString(),
        generate(raw_prompt="x", sampling={"stop": ["a" * 5000]}).SerializeToString(),
        generate(raw_prompt="x", sampling={"stop_token_ids": [1] * 5000}).SerializeToString(),
        generate(messages={"messages": [{"role": "user", "content": "a"}] * 20_000})
        .SerializeToString(),
        generate(prompt=" " * 2_000_000).SerializeToString(),
        generate(token_ids={"ids": [0] * 100_000}).SerializeToString(),
        b"\x1a\x02\xff\xfe",  # raw_prompt that is not UTF-8
    ]  # fmt: skip


def test_seeds_and_hostile_bytes(harness: Harness) -> None:
    outcomes = [harness.run(data) for data in [*seeds(), *hostile()]]
    assert all(code not in FORBIDDEN for o in outcomes for code in o.values()), outcomes
    # Well-formed seeds pass every check and reach routing (no worker here: UNAVAILABLE).
    assert [o["Generate"] for o in outcomes[:4]] == [grpc.StatusCode.UNAVAILABLE] * 4
    refused = [o["Generate"] for o in outcomes[5:]]
    assert refused == [grpc.StatusCode.INVALID_ARGUMENT] * len(refused), outcomes


@pytest.mark.skipif(
    importlib.util.find_spec("atheris") is None,
    reason="atheris is not installed (it has wheels for Linux x86-64/aarch64 CPython only)",
)
def test_atheris_finds_nothing_in_a_bounded_run(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, seed in enumerate(seeds()):
        (corpus / f"seed-{i}").write_bytes(seed)
    script = Path(__file__).with_name("atheris_gateway.py")
    done = subprocess.run(
        [sys.executable, str(script), f"-runs={ATHERIS_RUNS}", "-max_total_time=120",
         "-timeout=30", "-rss_limit_mb=6144", f"-artifact_prefix={tmp_path}/", str(corpus)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    crashes = list(tmp_path.glob("crash-*")) + list(tmp_path.glob("timeout-*"))
    assert done.returncode == 0 and not crashes, done.stderr[-4000:]
    assert "Done" in done.stderr, done.stderr[-2000:]
