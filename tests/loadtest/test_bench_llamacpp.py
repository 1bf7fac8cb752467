"""bench_llamacpp's llama-server start: a server killed by a signal at load (llama.cpp's AMX
repacking on an Intel Xeon) is started again with --no-repack, and the record says so."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from loadtest import bench_llamacpp


def run(monkeypatch: pytest.MonkeyPatch, outcomes: list[int | None], args: str = "") -> tuple[
    dict[str, Any], list[list[str]]
]:
    calls: list[list[str]] = []

    def stack(*a: Any) -> dict[str, Any]:
        calls.append(a[-1])
        code = outcomes[len(calls) - 1]
        if code is not None:
            raise bench_llamacpp.ServerDied(code, f"llama-server exited with {code}")
        return {"runs": {}}

    monkeypatch.setattr(bench_llamacpp, "_llama_stack", stack)
    namespace = argparse.Namespace(llama_server_args=args)
    record = bench_llamacpp.run_llama_stack(namespace, None, Path("s"), "m.gguf", Path("o"))  # type: ignore[arg-type]
    return record, calls


def test_a_server_killed_at_load_runs_again_without_repacking(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    record, calls = run(monkeypatch, [-11, None], "--threads-batch 2")
    assert calls == [["--threads-batch", "2"], ["--threads-batch", "2", "--no-repack"]]
    assert record["fallback"].startswith("--no-repack")


def test_a_server_that_starts_or_fails_otherwise_is_not_retried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    record, calls = run(monkeypatch, [None])
    assert calls == [[]] and "fallback" not in record
    with pytest.raises(bench_llamacpp.ServerDied):
        run(monkeypatch, [1, None])  # an error exit: a bad flag, a missing file
    with pytest.raises(bench_llamacpp.ServerDied):
        run(monkeypatch, [-11, None], "--no-repack")  # already without repacking
