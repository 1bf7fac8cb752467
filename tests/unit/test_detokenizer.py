"""Incremental detokenization and stop strings, on the real SmolLM2 tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.text.detokenizer import IncrementalDetokenizer
from common.text.tokenizer import Tokenizer

TEXT = "Héllo wörld 🙂, this is a test of 東京 streaming.\nNew line: done."


@pytest.fixture(scope="module")
def tokenizer(smollm_dir: Path) -> Tokenizer:
    return Tokenizer(smollm_dir)


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    deltas = [detok.add([t]) for t in ids]
    return [*deltas, detok.flush()]


def test_deltas_concatenate_to_the_full_decode(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode_raw("Say something:")
    ids = tokenizer.encode_raw(TEXT)
    deltas = stream(IncrementalDetokenizer(tokenizer, prompt), ids)
    assert "".join(deltas) == tokenizer.decode(ids) == TEXT
    # A multi-byte character split across tokens is never emitted half-way.
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_across_token_boundaries(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode_raw(TEXT)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["is a te"])
    deltas = []
    consumed = 0
    for t in ids:
        deltas.append(detok.add([t]))
        consumed += 1
        if detok.stop_string is not None:
            break
    deltas.append(detok.flush())
    assert detok.stop_string == "is a te"
    assert "".join(deltas) == TEXT[: TEXT.index("is a te")]
    # The stop string was completed by the token that was just consumed, not later.
    assert "is a te" in tokenizer.decode(ids[:consumed])
    assert "is a te" not in tokenizer.decode(ids[: consumed - 1])


def test_no_prefix_of_a_stop_string_is_streamed_early(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode_raw("alpha beta gamma delta")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["gamma X"])
    streamed = ""
    for t in ids:
        streamed += detok.add([t])
        # Whatever was streamed cannot end inside a possible stop string match.
        assert not streamed.endswith("gam")
    assert detok.stop_string is None
    assert streamed + detok.flush() == "alpha beta gamma delta"


def test_earliest_of_several_stop_strings_wins(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode_raw("one two three four")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["four", "two"])
    text = "".join(detok.add([t]) for t in ids) + detok.flush()
    assert text == "one " and detok.stop_string == "two"


def test_chat_template_matches_apply_chat_template(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode_prompt("Hi there", raw=False)
    expected = tokenizer.hf.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], add_generation_prompt=True, tokenize=False
    )
    assert tokenizer.decode(ids, skip_special_tokens=False) == expected
    assert tokenizer.encode_prompt("Hi there", raw=True) == list(tokenizer.hf("Hi there").input_ids)


@pytest.mark.parametrize("burst", [1, 2, 3, 5, 8])
def test_a_burst_crossing_a_stop_string_takes_tokens_up_to_the_one_completing_it(
    tokenizer: Tokenizer, burst: int
) -> None:
    """A speculating decode worker sends several tokens per message: the text, and how many
    of the burst's tokens count, are what one token per message gives."""
    ids = tokenizer.encode_raw(TEXT)
    one = IncrementalDetokenizer(tokenizer, [], stop=["is a te"])
    taken_one = []
    for t in ids:
        one.add([t])
        taken_one.append(t)
        if one.stop_string is not None:
            break
    bursts = IncrementalDetokenizer(tokenizer, [], stop=["is a te"])
    text, taken = "", []
    for start in range(0, len(ids), burst):
        chunk = ids[start : start + burst]
        text += bursts.add(chunk)
        taken += chunk[: bursts.num_taken]
        if bursts.stop_string is not None:
            break
    assert taken == taken_one
    assert text + bursts.flush() == TEXT[: TEXT.index("is a te")]
    assert bursts.add(ids[:3]) == "" and bursts.num_taken == 0  # after the stop: nothing
