"""``pdserve perplexity --windows``: which tokens each mode feeds and scores."""

from __future__ import annotations

import pytest
import torch

from pdserve.cli.commands.perplexity import Scores, make_windows


def test_all_windows_score_every_token_after_the_first() -> None:
    cut = make_windows(list(range(10)), 4, "all", bos=None)
    assert cut.parts == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert cut.starts == [0, 4, 8] and cut.skip == 0


@pytest.mark.parametrize("bos", [None, 100])
def test_llama_cpp_windows_are_whole_start_with_bos_and_score_the_second_half(bos: int | None) -> None:
    """As llama-perplexity: BOS before the text (when the tokenizer adds one), whole windows
    only, each window's first token replaced by BOS, rows from context // 2 on scored."""
    ids = list(range(1, 20))
    cut = make_windows(ids, 6, "llama.cpp", bos=bos)
    text = ([bos] if bos is not None else []) + ids
    assert len(cut.parts) == len(text) // 6
    for start, window in zip(cut.starts, cut.parts, strict=True):
        assert len(window) == 6
        assert window[1:] == text[start + 1 : start + 6]
        assert window[0] == (bos if bos is not None else text[start])
    assert cut.skip == 3


def test_scores_skip_the_first_rows() -> None:
    """Row r scores token r + 1; with skip 3 only tokens 4.. of a 6-token window count."""
    window = [0, 1, 2, 3, 4, 5]
    rows = torch.log_softmax(torch.randn(5, 8, generator=torch.Generator().manual_seed(0)), -1)
    scores = Scores()
    scores.add(rows, window, None, skip=3)
    expected = -(rows[3, 4] + rows[4, 5]).item()
    assert scores.num_scored == 2
    assert scores.nll == pytest.approx(expected)
