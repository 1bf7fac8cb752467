"""The sampler on hand-made logits: greedy, filters, penalties, seeds, logprobs."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from common.contract.sampling import SamplingParams
from common.engine.request import Request
from common.engine.sampler import Sampler
from common.errors import InvalidRequestError

VOCAB = 8


def req(
    params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None
) -> Request:
    return Request("r", prompt or [0], params, output_token_ids=output)


def sample(logits: list[float], params: SamplingParams, **kwargs: list[int]) -> int:
    result = Sampler(VOCAB)(torch.tensor([logits]), [req(params, **kwargs)])
    return result.token_ids[0]


LOGITS = [0.0, 3.0, 2.9, 1.0, -1.0, 0.5, 2.0, -3.0]


def test_greedy_is_argmax() -> None:
    assert sample(LOGITS, SamplingParams()) == 1


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    for seed in range(20):
        assert sample(LOGITS, SamplingParams(temperature=1.0, top_k=1, seed=seed)) == 1
        assert sample(LOGITS, SamplingParams(temperature=1.0, top_p=0.01, seed=seed)) == 1


def test_top_k_restricts_the_support() -> None:
    seen = {sample(LOGITS, SamplingParams(temperature=5.0, top_k=3, seed=s)) for s in range(200)}
    assert seen == {1, 2, 6}


def test_min_p_drops_unlikely_tokens() -> None:
    # p(2.9)/p(3.0) = e^-0.1 ~ 0.90 stays; p(2.0)/p(3.0) = e^-1 ~ 0.37 is dropped at min_p 0.5.
    seen = {sample(LOGITS, SamplingParams(temperature=1.0, min_p=0.5, seed=s)) for s in range(200)}
    assert seen == {1, 2}


def test_frequencies_follow_the_distribution() -> None:
    logits = [math.log(p) for p in (0.5, 0.3, 0.2)] + [-1e9] * (VOCAB - 3)
    counts = Counter(sample(logits, SamplingParams(temperature=1.0, seed=s)) for s in range(3000))
    for token, p in ((0, 0.5), (1, 0.3), (2, 0.2)):
        assert abs(counts[token] / 3000 - p) < 0.035, counts


def test_seed_and_position_fix_the_draw() -> None:
    params = SamplingParams(temperature=1.0, seed=42)
    a = [sample(LOGITS, params, output=[0] * n) for n in range(10)]
    b = [sample(LOGITS, params, output=[0] * n) for n in range(10)]
    assert a == b
    assert len(set(a)) > 1  # the position changes the draw


def test_repetition_penalty_follows_hf_convention() -> None:
    params = SamplingParams(repetition_penalty=2.0)
    # Token 1 (3.0 -> 1.5) and 2 (2.9 -> 1.45) were seen: token 6 (2.0) wins.
    assert sample(LOGITS, params, prompt=[1], output=[2]) == 6


def test_presence_and_frequency_penalties_use_output_counts() -> None:
    # Token 1 appeared twice in the output: 3.0 - 2*0.1 - 0.0 = 2.8 < 2.9.
    assert sample(LOGITS, SamplingParams(frequency_penalty=0.1), output=[1, 1]) == 2
    assert sample(LOGITS, SamplingParams(frequency_penalty=0.1), output=[1]) == 1
    assert sample(LOGITS, SamplingParams(presence_penalty=0.2), output=[1, 1, 1]) == 2
    # The prompt does not count for presence/frequency.
    assert sample(LOGITS, SamplingParams(presence_penalty=0.2), prompt=[1]) == 1


def test_logprobs_of_choice_and_alternatives() -> None:
    params = SamplingParams(logprobs=True, top_logprobs=3)
    result = Sampler(VOCAB)(torch.tensor([LOGITS]), [req(params)])
    entry = result.logprobs[0]
    assert entry is not None
    expected = torch.log_softmax(torch.tensor(LOGITS), dim=-1)
    assert entry.token_id == 1 and entry.logprob == pytest.approx(expected[1].item())
    assert [t for t, _ in entry.top] == [1, 2, 6]
    assert [lp for _, lp in entry.top] == pytest.approx(expected[[1, 2, 6]].tolist())


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(max_tokens=0), "sampling.max_tokens"),
        (dict(temperature=-0.1), "sampling.temperature"),
        (dict(temperature=float("nan")), "sampling.temperature"),
        (dict(top_p=0.0), "sampling.top_p"),
        (dict(top_p=1.5), "sampling.top_p"),
        (dict(top_k=-1), "sampling.top_k"),
        (dict(min_p=2.0), "sampling.min_p"),
        (dict(top_logprobs=21), "sampling.top_logprobs"),
        (dict(stop=("",)), "sampling.stop"),
    ],
)
def test_invalid_params_name_their_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
