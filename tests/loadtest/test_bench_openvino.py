"""loadtest/bench_openvino.py and the timing code both engines share
(loadtest/baselines/engine_cases.py). OpenVINO's venv is not part of CI: its side runs in the
benchmark itself; here a scripted engine checks the timing code and pdserve's side runs whole."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from loadtest import bench_openvino
from loadtest.baselines.engine_cases import batch_case, prefill_case, run_requests


class ScriptedEngine:
    """Each step gives every running request ``per_step`` tokens (its first step: one, the
    prefill's), at most ``max_running`` running; records the most it ever held."""

    def __init__(self, max_running: int = 1000, per_step: int = 1, short_by: int = 0) -> None:
        self.running: dict[int, list[int]] = {}  # id -> [produced, wanted]
        self.max_running = max_running
        self.per_step = per_step
        self.short_by = short_by
        self.most_in_flight = 0
        self.added: list[tuple[int, int]] = []

    def add(self, request_id: int, prompt: Sequence[int], max_tokens: int) -> None:
        self.added.append((request_id, len(prompt)))
        self.running[request_id] = [0, max_tokens - self.short_by]
        self.most_in_flight = max(self.most_in_flight, len(self.running))

    def step(self) -> list[tuple[int, int, bool]]:
        events = []
        for request_id, state in list(self.running.items())[: self.max_running]:
            n = 1 if state[0] == 0 else min(self.per_step, state[1] - state[0])
            state[0] += n
            finished = state[0] >= state[1]
            events.append((request_id, n, finished))
            if finished:
                del self.running[request_id]
        return events


def test_a_closed_loop_keeps_the_concurrency_and_times_every_token() -> None:
    engine = ScriptedEngine()
    prompts = [[1] * (10 + i) for i in range(7)]
    start, lines = run_requests(engine, prompts, max_tokens=5, concurrency=3)
    assert engine.most_in_flight == 3
    assert [rid for rid, _ in engine.added] == list(range(7))
    assert [n for _, n in engine.added] == [len(p) for p in prompts]
    for line in lines.values():
        assert line.finished and len(line.tokens) == 5
        assert start <= line.added <= line.tokens[0] <= line.tokens[-1]
        assert line.tokens == sorted(line.tokens)


def test_batch_figures_count_every_token_and_refuse_a_short_request() -> None:
    figures = batch_case(ScriptedEngine(per_step=2), [[5] * 8] * 6, output_len=9, concurrency=4)
    assert figures["requests"] == 6 and figures["output_tokens"] == 54
    assert figures["output_tok_s"] == pytest.approx(54 / figures["wall_s"])
    assert figures["ttft_ms_p50"] >= 0 and figures["tpot_ms_p50"] >= 0
    with pytest.raises(RuntimeError, match="did not produce exactly 9 tokens"):
        batch_case(ScriptedEngine(short_by=1), [[5] * 8] * 2, output_len=9, concurrency=2)


def test_prefill_figures_are_prompt_tokens_over_the_time_to_the_first() -> None:
    figures = prefill_case(ScriptedEngine(), [[3] * 40, [4] * 40, [5] * 40])
    assert figures["prompt_len"] == 40 and len(figures["prefill_tok_s_all"]) == 3
    assert all(rate > 0 for rate in figures["prefill_tok_s_all"])


def test_the_summary_takes_each_engines_defaults_and_best_setting() -> None:
    def run(c16: float) -> dict:
        return {"cases": {"c16": {"output_tok_s": c16}, "prefill512": {"prefill_tok_s": 2 * c16}}}

    runs = {
        "pdserve": {"default": [run(300), run(320)], "fast": [run(400), run(420)]},
        "openvino": {"default": [run(500), run(480)], "f16kv": [run(450), run(460)]},
    }
    summary = bench_openvino.summarize(runs, ["c16", "prefill512"])
    c16 = summary["c16"]
    assert c16["pdserve"]["default"] == 310 and c16["pdserve"]["best"] == 410
    assert c16["pdserve"]["best_setting"] == "fast"
    assert c16["openvino"]["best"] == 490 and c16["openvino"]["best_setting"] == "default"
    assert c16["ratio_default"] == pytest.approx(310 / 490)
    assert c16["ratio_best"] == pytest.approx(410 / 490)
    assert summary["prefill512"]["ratio_best"] == pytest.approx(820 / 980)


def test_pdserves_side_runs_whole_in_a_process_of_its_own(tmp_path: Path) -> None:
    result = bench_openvino.main(["--quick", "--engines", "pdserve", "--pdserve-settings",
                                  "default", "--result-dir", str(tmp_path)])  # fmt: skip
    assert result is not None
    (run,) = result["runs"]["pdserve"]["default"]
    assert run["weight_format"]["name"] in {"gguf", "none", "int4", "int8"}
    assert set(run["cases"]) == {"c1", "c4", "prefill64"}
    assert run["cases"]["c4"]["output_tokens"] == 4 * 8
    assert set(result["summary"]) == {"c1", "c4", "prefill64"}
    saved = json.loads((tmp_path / "bench_openvino.json").read_text())
    assert saved["summary"]["c4"]["pdserve"]["best_setting"] == "default"
    text = (tmp_path / "bench_openvino.txt").read_text()
    assert "pdserve default" in text and "prefill64" in text
