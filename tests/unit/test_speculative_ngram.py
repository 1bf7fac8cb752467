"""Prompt lookup (common/engine/speculative/ngram.py) and --speculative-config parsing."""

from __future__ import annotations

import json
import random

import pytest

from common.engine.speculative.config import SpeculativeConfig, SpeculativeConfigError
from common.engine.speculative.ngram import NgramIndex, propose_reference


def test_the_longest_suffix_that_occurred_before_proposes_what_followed_it() -> None:
    #            0  1  2  3  4  5  6  7  8  9
    context = [5, 6, 7, 8, 9, 1, 6, 7, 8]
    index = NgramIndex(1, 3, context)
    # Suffix [6, 7, 8] occurred at 1..3, followed by 9, 1, 6, ...
    assert index.propose(3) == [9, 1, 6]
    # Past the context's end the text since the occurrence repeats: 9 1 6 7 8, again.
    assert index.propose(10) == [9, 1, 6, 7, 8, 9, 1, 6, 7, 8]
    # Nothing after [.., 8, 4] occurred before: a fall back to shorter suffixes, then none.
    index.extend([4])
    assert index.propose(2) == []


def test_the_latest_occurrence_wins_and_shorter_suffixes_are_the_fallback() -> None:
    index = NgramIndex(1, 2, [3, 1, 2, 3, 4, 3])
    # [4, 3] never occurred before; [3] last occurred at 3, followed by 4.
    assert index.propose(2) == [4, 3]
    index = NgramIndex(2, 2, [3, 1, 2, 3, 4, 3])
    assert index.propose(2) == []  # min 2: the 1-gram fallback is off


def test_the_suffix_never_matches_itself() -> None:
    assert NgramIndex(1, 4, [7]).propose(4) == []
    assert NgramIndex(1, 4, [1, 2, 3]).propose(4) == []
    # A run: the latest earlier [7, 7] ends one token before the end; the run goes on.
    assert NgramIndex(1, 2, [7, 7, 7]).propose(4) == [7, 7, 7, 7]
    # A loop of period 3 is guessed whole, not 3 at a time.
    assert NgramIndex(2, 2, [1, 2, 3, 1, 2, 3, 1, 2]).propose(5) == [3, 1, 2, 3, 1]


@pytest.mark.parametrize("seed", range(40))
def test_the_index_proposes_what_a_backward_scan_does(seed: int) -> None:
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5, 20])
    min_n = rng.randint(1, 3)
    max_n = rng.randint(min_n, 5)
    k = rng.randint(1, 6)
    tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 120))]
    index = NgramIndex(min_n, max_n)
    # Appended in uneven pieces, as verified tokens arrive; checked after every piece.
    at = 0
    while at < len(tokens):
        step = rng.randint(1, 5)
        index.extend(tokens[at : at + step])
        at += step
        seen = tokens[:at]
        assert index.propose(k) == propose_reference(seen, k, min_n, max_n), (seen, k)
    assert len(index) == len(tokens)


def test_config_parses_what_vllm_takes() -> None:
    config = SpeculativeConfig.from_json(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
    )
    assert config == SpeculativeConfig("ngram", 4, prompt_lookup_max=4, prompt_lookup_min=1)
    assert SpeculativeConfig.from_json(config.to_json()) == config
    draft = SpeculativeConfig.from_dict(
        {"method": "draft_model", "model": "/m", "num_speculative_tokens": 3,
         "quantization": "int4"}
    )  # fmt: skip
    assert SpeculativeConfig.from_json(draft.to_json()) == draft
    assert json.loads(draft.to_json())["model"] == "/m"


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ("[1]", "JSON object"),
        ("{", "not JSON"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "one of ngram, draft_model"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "[1, 16]"),
        ('{"method": "ngram", "num_speculative_tokens": "4"}', "must be an integer"),
        ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_mx": 3}',
         "unknown key(s) prompt_lookup_mx"),
        ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5}',
         "prompt_lookup_min <= prompt_lookup_max"),
        ('{"method": "draft_model", "num_speculative_tokens": 4}', "needs 'model'"),
        ('{"method": "ngram", "num_speculative_tokens": 4, "model": "/m"}', "no draft model"),
    ],
)  # fmt: skip
def test_config_refuses_with_the_field_named(raw: str, says: str) -> None:
    with pytest.raises(SpeculativeConfigError) as caught:
        SpeculativeConfig.from_json(raw)
    assert says in str(caught.value)
