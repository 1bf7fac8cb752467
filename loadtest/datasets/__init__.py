"""Synthetic, seeded workloads, and the flags that choose one (named as in vllm bench serve
where it has them)."""

from __future__ import annotations

import argparse
from pathlib import Path

from loadtest.datasets.base import SampleRequest
from loadtest.datasets.interference import interference_requests
from loadtest.datasets.mooncake import DEFAULT_TRACE, mooncake_requests
from loadtest.datasets.multi_turn import multi_turn_requests
from loadtest.datasets.prefix_repetition import prefix_repetition_requests
from loadtest.datasets.random_dataset import random_requests

DATASET_NAMES = (
    "random", "prefix-repetition", "multi-turn", "long-prefill-interference", "mooncake-trace",
)  # fmt: skip

__all__ = ["DATASET_NAMES", "SampleRequest", "add_dataset_args", "build_requests"]


def _dataset_name(text: str) -> str:
    name = text.replace("_", "-")
    if name not in DATASET_NAMES:
        raise argparse.ArgumentTypeError(
            f"unknown dataset {text!r}; one of {', '.join(DATASET_NAMES)}"
        )
    return name


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("dataset")
    group.add_argument(
        "--dataset-name",
        type=_dataset_name,
        default="random",
        help=f"one of {', '.join(DATASET_NAMES)}",
    )
    group.add_argument(
        "--dataset-path",
        default=None,
        help=f"mooncake-trace: the trace file (default {DEFAULT_TRACE})",
    )
    group.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    group.add_argument("--seed", type=int, default=0, help="seeds the dataset and the arrivals")

    random_group = parser.add_argument_group("random dataset")
    random_group.add_argument("--random-input-len", type=int, default=1024)
    random_group.add_argument("--random-output-len", type=int, default=128)
    random_group.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len * (1 - r), len * (1 + r)]",
    )
    random_group.add_argument(
        "--random-prefix-len",
        type=int,
        default=0,
        help="tokens of one prefix shared by every prompt, before the input",
    )

    prefix = parser.add_argument_group("prefix-repetition dataset")
    prefix.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    prefix.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    prefix.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    prefix.add_argument("--prefix-repetition-output-len", type=int, default=128)

    turns = parser.add_argument_group("multi-turn dataset")
    turns.add_argument("--multi-turn-num-turns", type=int, default=4)
    turns.add_argument("--multi-turn-system-len", type=int, default=256)
    turns.add_argument("--multi-turn-user-len", type=int, default=64)
    turns.add_argument("--multi-turn-output-len", type=int, default=64)

    mixed = parser.add_argument_group("long-prefill-interference dataset")
    mixed.add_argument("--interference-chat-input-len", type=int, default=64)
    mixed.add_argument("--interference-chat-output-len", type=int, default=64)
    mixed.add_argument("--interference-long-input-len", type=int, default=2048)
    mixed.add_argument("--interference-long-output-len", type=int, default=4)
    mixed.add_argument(
        "--interference-long-every", type=int, default=8, help="every N-th request is a long prompt"
    )

    trace = parser.add_argument_group("mooncake-trace dataset")
    trace.add_argument("--trace-start", type=int, default=0, help="first trace row to replay")
    trace.add_argument(
        "--trace-block-tokens",
        type=int,
        default=16,
        help="tokens per 512-token trace block (prefix sharing is kept)",
    )
    trace.add_argument(
        "--trace-output-scale",
        type=float,
        default=1.0,
        help="multiplies each output length (at least 1 token)",
    )
    trace.add_argument("--synthesis-max-osl", type=int, default=None, help="caps output lengths")
    trace.add_argument(
        "--synthesis-max-isl",
        type=int,
        default=None,
        help="leaves out rows whose scaled prompt is longer",
    )
    trace.add_argument(
        "--synthesis-speedup-ratio",
        type=float,
        default=1.0,
        help="the trace clock runs this many times faster",
    )


def build_requests(args: argparse.Namespace, vocab_size: int) -> list[SampleRequest]:
    name = args.dataset_name
    n, seed = args.num_prompts, args.seed
    if n < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {n}")
    if name == "random":
        return random_requests(n, args.random_input_len, args.random_output_len, vocab_size,
                               range_ratio=args.random_range_ratio,
                               prefix_len=args.random_prefix_len, seed=seed)  # fmt: skip
    if name == "prefix-repetition":
        return prefix_repetition_requests(
            n, args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes, args.prefix_repetition_output_len,
            vocab_size, seed=seed,
        )  # fmt: skip
    if name == "multi-turn":
        return multi_turn_requests(n, args.multi_turn_num_turns, args.multi_turn_system_len,
                                   args.multi_turn_user_len, args.multi_turn_output_len,
                                   vocab_size, seed=seed)  # fmt: skip
    if name == "long-prefill-interference":
        return interference_requests(
            n, args.interference_chat_input_len, args.interference_chat_output_len,
            args.interference_long_input_len, args.interference_long_output_len,
            args.interference_long_every, vocab_size, seed=seed,
        )  # fmt: skip
    assert name == "mooncake-trace", name
    return mooncake_requests(
        n, vocab_size, path=Path(args.dataset_path) if args.dataset_path else DEFAULT_TRACE,
        start=args.trace_start, block_tokens=args.trace_block_tokens,
        output_scale=args.trace_output_scale, max_osl=args.synthesis_max_osl,
        max_isl=args.synthesis_max_isl,
        speedup_ratio=args.synthesis_speedup_ratio, seed=seed,
    )  # fmt: skip
