"""Dataset generators: exact token counts, prefix sharing, order, seeds, trace scaling."""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import pytest

from loadtest.datasets import add_dataset_args, build_requests
from loadtest.datasets.base import FIRST_PLAIN_TOKEN_ID, SampleRequest
from loadtest.datasets.interference import interference_requests
from loadtest.datasets.mooncake import DEFAULT_TRACE, mooncake_requests
from loadtest.datasets.multi_turn import multi_turn_requests
from loadtest.datasets.prefix_repetition import prefix_repetition_requests
from loadtest.datasets.random_dataset import random_requests

VOCAB = 49152


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_random_lengths_are_exact_and_tokens_plain() -> None:
    requests = random_requests(20, 100, 30, VOCAB, seed=1)
    assert [r.prompt_len for r in requests] == [100] * 20
    assert [r.expected_output_len for r in requests] == [30] * 20
    assert all(FIRST_PLAIN_TOKEN_ID <= t < VOCAB for r in requests for t in r.prompt_token_ids)
    assert len({r.request_id for r in requests}) == 20
    assert len({r.prompt_token_ids for r in requests}) == 20


def test_random_range_ratio_bounds_and_seed() -> None:
    requests = random_requests(200, 100, 20, VOCAB, range_ratio=0.5, seed=2)
    inputs = [r.prompt_len for r in requests]
    outputs = [r.expected_output_len for r in requests]
    assert min(inputs) >= 50 and max(inputs) <= 150 and len(set(inputs)) > 50
    assert min(outputs) >= 10 and max(outputs) <= 30
    assert random_requests(200, 100, 20, VOCAB, range_ratio=0.5, seed=2) == requests
    assert random_requests(200, 100, 20, VOCAB, range_ratio=0.5, seed=3) != requests


def test_random_prefix_len_is_shared_by_every_prompt() -> None:
    requests = random_requests(5, 40, 4, VOCAB, prefix_len=32, seed=0)
    assert [r.prompt_len for r in requests] == [72] * 5
    first = requests[0].prompt_token_ids
    assert all(common_prefix(first, r.prompt_token_ids) == 32 for r in requests[1:])


def test_prefix_repetition_shares_exactly_the_prefix_and_is_shuffled() -> None:
    requests = prefix_repetition_requests(12, 48, 16, 3, 5, VOCAB, seed=4)
    assert len(requests) == 12
    assert all(r.prompt_len == 64 and r.expected_output_len == 5 for r in requests)
    by_prefix: dict[str, list[SampleRequest]] = {}
    for r in requests:
        by_prefix.setdefault(r.category, []).append(r)
    assert sorted(by_prefix) == ["prefix-0", "prefix-1", "prefix-2"]
    assert all(len(group) == 4 for group in by_prefix.values())
    for group in by_prefix.values():
        head = group[0].prompt_token_ids
        assert all(common_prefix(head, r.prompt_token_ids) == 48 for r in group[1:])
    heads = [group[0].prompt_token_ids for group in by_prefix.values()]
    assert common_prefix(heads[0], heads[1]) == 0 and common_prefix(heads[1], heads[2]) == 0
    categories = [r.category for r in requests]
    assert categories != sorted(categories)  # not grouped: shuffled
    assert prefix_repetition_requests(12, 48, 16, 3, 5, VOCAB, seed=4) == requests


def test_prefix_repetition_uneven_split() -> None:
    requests = prefix_repetition_requests(7, 8, 8, 3, 1, VOCAB)
    counts = sorted(sum(r.category == f"prefix-{k}" for r in requests) for k in range(3))
    assert counts == [2, 2, 3]


def test_multi_turn_each_turn_repeats_the_whole_history() -> None:
    requests = multi_turn_requests(6, 3, 32, 8, 4, VOCAB, seed=0)
    # 2 conversations x 3 turns, interleaved turn by turn.
    assert [r.request_id for r in requests] == [
        "conv-0-turn-0", "conv-1-turn-0", "conv-0-turn-1", "conv-1-turn-1",
        "conv-0-turn-2", "conv-1-turn-2",
    ]  # fmt: skip
    conv0 = [r for r in requests if r.session_id == "conv-0"]
    assert [r.prompt_len for r in conv0] == [40, 52, 64]  # system 32 + t * (8 + 4) + 8
    for earlier, later in itertools.pairwise(conv0):
        assert later.prompt_token_ids[: earlier.prompt_len] == earlier.prompt_token_ids
    conv1 = [r for r in requests if r.session_id == "conv-1"]
    assert common_prefix(conv0[0].prompt_token_ids, conv1[0].prompt_token_ids) == 0
    assert len(multi_turn_requests(5, 3, 0, 8, 4, VOCAB)) == 5


def test_interference_mixes_chats_and_long_prompts() -> None:
    requests = interference_requests(9, 16, 8, 256, 2, 3, VOCAB, seed=0)
    assert [r.category for r in requests] == ["chat", "chat", "long"] * 3
    assert all(
        r.prompt_len == 256 and r.expected_output_len == 2 for r in requests if r.category == "long"
    )
    assert all(
        r.prompt_len == 16 and r.expected_output_len == 8 for r in requests if r.category == "chat"
    )


def write_trace(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_mooncake_scaling_keeps_sharing_order_and_times(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 1000, "input_length": 1536, "output_length": 100, "hash_ids": [0, 1, 2]},
        {"timestamp": 1000, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1, 3]},
        {"timestamp": 4000, "input_length": 300, "output_length": 1000, "hash_ids": [5]},
        {"timestamp": 9000, "input_length": 513, "output_length": 50, "hash_ids": [0, 6]},
    ])  # fmt: skip
    requests = mooncake_requests(None, VOCAB, path=trace, block_tokens=16, output_scale=0.1,
                                 max_osl=64, speedup_ratio=2.0)  # fmt: skip
    assert [r.request_id for r in requests] == [f"mooncake-{i}" for i in range(4)]
    # 3 full blocks; 2 full + 76/512 of a block (rounded up to 3 tokens); 300/512 -> 10; 1 + 1.
    assert [r.prompt_len for r in requests] == [48, 35, 10, 17]
    a, b, c, d = (r.prompt_token_ids for r in requests)
    assert common_prefix(a, b) == 32  # hash ids 0 and 1
    assert common_prefix(a, d) == 16  # hash id 0
    assert common_prefix(a, c) == 0
    assert [r.expected_output_len for r in requests] == [10, 1, 64, 5]  # x0.1, at least 1, capped
    assert [r.arrival_s for r in requests] == [0.0, 0.0, 1.5, 4.0]  # relative, twice as fast
    again = mooncake_requests(None, VOCAB, path=trace, block_tokens=16, output_scale=0.1,
                              max_osl=64, speedup_ratio=2.0)  # fmt: skip
    assert again == requests


def test_mooncake_start_limit_and_max_isl(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": t, "input_length": 512 * n, "output_length": 4, "hash_ids": list(range(n))}
        for t, n in ((0, 1), (100, 4), (200, 2), (300, 3), (400, 1))
    ])  # fmt: skip
    requests = mooncake_requests(2, VOCAB, path=trace, start=1, block_tokens=8, max_isl=24)
    assert [r.request_id for r in requests] == ["mooncake-2", "mooncake-3"]  # row 1 is too long
    assert [r.prompt_len for r in requests] == [16, 24]
    assert [r.arrival_s for r in requests] == [0.0, 0.1]


@pytest.mark.skipif(
    not DEFAULT_TRACE.is_file(), reason="the shared Mooncake trace is not beside the repo"
)
def test_real_mooncake_trace_first_rows_share_their_system_block() -> None:
    requests = mooncake_requests(20, VOCAB, block_tokens=16)
    assert len(requests) == 20
    # 6758 tokens = 13 full blocks + 102 -> 13 * 16 + ceil(102 / 32); 7322 = 14 + 154; 7236 = 14 + 68
    assert [r.prompt_len for r in requests[:3]] == [13 * 16 + 4, 14 * 16 + 5, 14 * 16 + 3]
    first = requests[0].prompt_token_ids
    assert all(common_prefix(first, r.prompt_token_ids) >= 16 for r in requests)


def test_build_requests_from_flags() -> None:
    parser = argparse.ArgumentParser()
    add_dataset_args(parser)
    args = parser.parse_args(["--dataset-name", "prefix_repetition", "--num-prompts", "6",
                              "--prefix-repetition-prefix-len", "8", "--prefix-repetition-suffix-len", "4",
                              "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "3"])  # fmt: skip
    requests = build_requests(args, VOCAB)
    assert len(requests) == 6 and all(r.prompt_len == 12 for r in requests)
    with pytest.raises(SystemExit):
        parser.parse_args(["--dataset-name", "sharegpt"])
