"""loadtest/sim_suffix_fleet.py: the replay yields each record's output exactly, counts a
step per verify, and a fleet whose requests repeat one another's answers gains from one
tree that a split fleet loses."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("arctic_inference.suffix_decoding", reason="scripts/setup.sh builds it")

from loadtest.sim_suffix_fleet import Record, insert_cost_us, replay


def _records(count: int, seed: int = 0) -> list[Record]:
    """Requests whose answers are one of two templates with a fresh token or two in them:
    a tree that saw earlier answers guesses most of each; the prompts tell nothing."""
    rng = random.Random(seed)
    templates = [list(range(100, 140)), list(range(200, 250))]
    records = []
    for _ in range(count):
        out = list(rng.choice(templates))
        out[rng.randrange(5, len(out))] = rng.randrange(1000, 2000)
        records.append(Record([rng.randrange(3000, 4000) for _ in range(12)], out))
    return records


def test_the_replay_makes_each_output_once_and_counts_its_steps() -> None:
    records = _records(12)
    r = replay(records, workers=1, concurrency=4)
    assert r.tokens == sum(len(rec.output) for rec in records)
    assert r.steps == r.tokens - len(records) - r.kept  # a step makes kept + 1; first: free
    assert 0 < r.kept <= r.proposed
    assert r.tokens_per_step > 2.0  # answers repeat: most of each is guessed


def test_one_tree_over_the_fleet_beats_trees_split_over_workers() -> None:
    records = _records(24, seed=1)
    whole = replay(records, workers=1, concurrency=1)
    split = replay(records, workers=4, concurrency=1)
    assert whole.tokens == split.tokens
    assert whole.tokens_per_step > split.tokens_per_step
    # Nothing to learn across requests (fresh random answers): the split costs nothing.
    rng = random.Random(2)
    noise = [Record([1, 2, 3], [rng.randrange(10_000) for _ in range(30)]) for _ in range(8)]
    assert replay(noise, 1, 1).tokens_per_step == pytest.approx(replay(noise, 4, 1).tokens_per_step)


def test_putting_a_response_in_a_tree_is_timed() -> None:
    assert insert_cost_us(_records(4)) > 0.0
