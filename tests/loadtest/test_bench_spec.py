"""loadtest/bench_spec.py's workloads: every round of a run gets prompts no earlier round
had, so a global tree over past responses (suffix decoding) is not measured answering a
request it has seen answered; what the workloads are meant to share stays shared."""

from __future__ import annotations

import json

import pytest

from loadtest import bench_spec


def _key(chat: list[dict[str, str]]) -> str:
    return json.dumps(chat, sort_keys=True)


@pytest.mark.parametrize("workload", ["copy", "chat", "agentic"])
def test_no_prompt_recurs_in_a_default_run(workload: str) -> None:
    seen: dict[str, tuple[int, int]] = {}
    cells: dict[int, int] = {}
    for concurrency, r, chats in bench_spec.plan(workload, [1, 16], rounds=3):
        assert len(chats) >= concurrency
        cells[concurrency] = cells.get(concurrency, 0) + 1
        for chat in chats:
            key = _key(chat)
            assert key not in seen, f"{workload}: c{concurrency} round {r} repeats {seen[key]}"
            seen[key] = (concurrency, r)
    assert cells == {1: 3, 16: 3}


def test_round_sizes() -> None:
    sizes = {(w, c): len(chats) for w in bench_spec.WORKLOADS
             for c, r, chats in bench_spec.plan(w, [1, 16], rounds=1)}  # fmt: skip
    assert sizes == {("copy", 1): 12, ("copy", 16): 16, ("chat", 1): 8, ("chat", 16): 16,
                     ("agentic", 1): 8, ("agentic", 16): 16}  # fmt: skip


def test_copy_requests_quote_a_document_of_their_own_variant() -> None:
    docs = [bench_spec._document(v) for v in range(40)]
    assert len(set(docs)) == 40
    for v in (0, 1, 5):
        chats = bench_spec.copy_prompts(v)
        assert bench_spec._document(v) in chats[0][0]["content"]
        assert chats[3][1] == {"role": "assistant", "content": bench_spec._document(v)}
        assert "teh" in chats[1][0]["content"]


def test_agentic_requests_share_the_tools_and_the_file_but_not_the_task() -> None:
    a, b = bench_spec.agentic_prompts(0), bench_spec.agentic_prompts(1)
    assert len(a) == len(b) == 8
    for chats in (a, b):
        assert [c[0]["content"] for c in chats[:5]] == [bench_spec._TOOLS] * 5
        assert all(bench_spec._FILE in c[0]["content"] for c in chats[5:])
        # the follow-up's earlier call is valid JSON naming the city it was asked about
        call = json.loads(chats[4][2]["content"])
        assert call["name"] == "get_weather" and call["arguments"]["city"] in chats[4][1]["content"]
    assert not {_key(c) for c in a} & {_key(c) for c in b}


def test_chat_questions_are_distinct() -> None:
    questions = bench_spec._QUESTIONS
    assert len(set(questions)) == len(questions) == 128
