"""bench_step_parts' timer: it sums the time spent in the call it wraps and is otherwise the
wrapped object (the fused decoder's ``applies`` and ``decode_model`` stay reachable)."""

from __future__ import annotations

import time

from loadtest.bench_step_parts import Timed


class Decoder:
    decode_model = "the C++ model"

    def applies(self, metadata: object) -> bool:
        return metadata == "decode"

    def __call__(self, seconds: float) -> str:
        time.sleep(seconds)
        return "hidden"


def test_timed_sums_its_calls_and_is_otherwise_what_it_wraps() -> None:
    timed = Timed(Decoder())
    assert timed(0.02) == "hidden"
    assert timed(0.01) == "hidden"
    assert 0.03 <= timed.seconds < 0.5
    assert timed.applies("decode") and not timed.applies("prefill")
    assert timed.decode_model == "the C++ model"
    timed.seconds = 0.0
    timed(0.0)
    assert timed.seconds < 0.01
