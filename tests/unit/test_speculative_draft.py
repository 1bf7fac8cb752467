"""``method: draft_model`` (common/engine/speculative/draft.py) on tiny checkpoints: the
draft's own KV kept across rounds and rolled back, its guesses what the draft model would
guess from scratch, and the target's output unchanged whatever the draft."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from common.contract.sampling import SamplingParams
from common.engine.engine import Engine
from common.engine.request import Request
from common.engine.speculative.config import SpeculativeConfigError
from common.engine.speculative.draft import DraftModelProposer
from tests.factories import make_tiny_checkpoint, random_prompts, run_to_completion, tiny_engine

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("draft") / "target", "llama",
                                intermediate_size=128)  # fmt: skip


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another random model with the same vocabulary: a draft whose guesses mostly miss."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("draft") / "other", "llama", seed=5,
                                intermediate_size=64, num_hidden_layers=1)  # fmt: skip


def _config(draft: Path, k: int = 4, **extra: Any) -> str:
    return json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": k,
                       "adaptive": False, **extra})  # fmt: skip


def _prompts() -> dict[str, list[int]]:
    return {f"r{i}": p for i, p in enumerate(random_prompts(384, [9, 30, 17, 50], seed=4))}


def _run(engine: Engine, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    got = run_to_completion(engine, prompts, GREEDY)
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
    draft = engine.proposer
    assert isinstance(draft, DraftModelProposer)
    assert not draft.sequences and draft.kv.pool.num_free == draft.kv.pool.num_blocks
    return got


def test_the_target_as_its_own_draft_has_every_guess_kept(target: Path) -> None:
    """Same weights, same arithmetic: a draft whose state is right guesses exactly what the
    target emits, so every guess is kept, round after round (a bad rollback or a stale
    token in the draft's sequence would show as a rejection)."""
    prompts = _prompts()
    plain = run_to_completion(tiny_engine(target), prompts, GREEDY)
    engine = tiny_engine(target, speculative_config=_config(target))
    assert _run(engine, prompts) == plain
    stats = engine.spec_stats
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens


def test_a_poor_draft_changes_nothing_and_guesses_what_it_would_from_scratch(
    target: Path, other: Path
) -> None:
    prompts = _prompts()
    plain = run_to_completion(tiny_engine(target), prompts, GREEDY)
    engine = tiny_engine(target, speculative_config=_config(other))
    draft = engine.proposer
    assert isinstance(draft, DraftModelProposer)
    reference = tiny_engine(other)
    checked = [0]
    propose = draft.propose_batch

    def checking(asks: list[tuple[Request, int]]) -> dict[str, list[int]]:
        guesses = propose(asks)
        for req, limit in asks:  # the draft model's own greedy continuation, from scratch
            want = run_to_completion(
                reference, {f"ref{checked[0]}": list(req.token_ids)},
                SamplingParams(max_tokens=limit, ignore_eos=True),
            )  # fmt: skip
            assert guesses[req.request_id] == want[f"ref{checked[0]}"], req.request_id
            checked[0] += 1
        return guesses

    draft.propose_batch = checking  # type: ignore[method-assign]
    assert _run(engine, prompts) == plain
    stats = engine.spec_stats
    assert checked[0] > 20 and stats.num_accepted_tokens < stats.num_draft_tokens


def test_a_quantized_copy_of_the_target_drafts_for_it(target: Path) -> None:
    """Self-speculation: int8 weights guess for the float target, which verifies in float32,
    so the output is float32's."""
    prompts = _prompts()
    plain = run_to_completion(tiny_engine(target), prompts, GREEDY)
    engine = tiny_engine(target, speculative_config=_config(target, quantization="int8"))
    draft = engine.proposer
    assert isinstance(draft, DraftModelProposer) and draft.runner.weight_format.quantized
    assert not engine.runner.weight_format.quantized
    assert _run(engine, prompts) == plain
    assert engine.spec_stats.num_accepted_tokens > 0


def test_aborted_and_preempted_requests_leave_the_draft_nothing_held(target: Path) -> None:
    prompts = _prompts()
    engine = tiny_engine(target, speculative_config=_config(target), num_kv_blocks=12)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, GREEDY)
    for _ in range(12):
        engine.step()
    assert engine.spec_stats.num_drafts > 0 and engine.num_preemptions > 0
    for rid in prompts:
        engine.abort(rid)
    draft = engine.proposer
    assert isinstance(draft, DraftModelProposer)
    assert not draft.sequences and draft.kv.pool.num_free == draft.kv.pool.num_blocks


def test_a_draft_with_another_vocabulary_is_refused(target: Path, tmp_path: Path) -> None:
    wrong = make_tiny_checkpoint(tmp_path / "wrong", "llama", vocab_size=512)
    with pytest.raises(SpeculativeConfigError, match="vocabulary"):
        tiny_engine(target, speculative_config=_config(wrong))
