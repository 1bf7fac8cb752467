"""bench_gateway_kill's arithmetic: the gap a resume puts into a stream is told apart from
its usual gaps, and the gateway dies once every stream reached the mark, not before."""

from __future__ import annotations

from loadtest.bench_gateway_kill import Gate, Stream


def test_a_resumes_gap_is_the_one_before_the_first_message_after_it() -> None:
    stream = Stream(times=[0.0, 0.05, 0.10, 0.90, 0.95], resumed_at=[3])
    seams, usual = stream.gaps_ms()
    assert [round(s) for s in seams] == [800]
    assert [round(u) for u in usual] == [50, 50, 50]


def test_the_gate_kills_once_when_every_stream_has_its_tokens() -> None:
    kills: list[int] = []
    gate = Gate(2, at=10, kill=lambda: kills.append(1))
    gate.saw(0, 12)
    gate.saw(1, 9)
    assert kills == [] and gate.killed_at is None
    gate.saw(1, 10)
    gate.saw(0, 20)
    assert kills == [1] and gate.killed_at is not None
