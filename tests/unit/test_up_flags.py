"""``pdserve up`` forwards its flags to the processes it starts: every forwarded flag is one
the target command accepts, with the value given."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser
from pdserve.commands.up import (
    _DECODE_FLAGS,
    _ENGINE_FLAGS,
    _FAILOVER_FLAGS,
    _GATEWAY_FLAGS,
    _WORKER_FLAGS,
    _engine_flags,
)

UP_ARGV = [
    "up", "--decode-stall-timeout-s", "7", "--prefill-timeout-s", "9", "--expert-load-interval-s",
    "2", "--expert-load-window-s", "30", "--expert-load-windows", "12", "--kv-pull-timeout-s", "4",
    "--max-num-seqs", "8", "--local-prefill-tokens", "32", "--lease-ttl-s", "11",
]  # fmt: skip


@pytest.mark.parametrize(
    ("command", "names"),
    [
        ("prefill", _ENGINE_FLAGS + _WORKER_FLAGS),
        ("decode", _ENGINE_FLAGS + _WORKER_FLAGS + _DECODE_FLAGS),
        ("gateway", _GATEWAY_FLAGS + _FAILOVER_FLAGS),
    ],
)
def test_forwarded_flags_reach_the_command_with_their_values(
    command: str, names: tuple[str, ...]
) -> None:
    parser = build_parser()
    up = parser.parse_args(UP_ARGV)
    forwarded = _engine_flags(up, names)
    args = parser.parse_args([command, *forwarded])
    given = {name: getattr(up, name) for name in names if getattr(up, name) is not None}
    assert given, "the test gives no flag for this command"
    for name, value in given.items():
        assert getattr(args, name) == value, name


def test_expert_load_and_stall_flags_are_forwarded() -> None:
    up = build_parser().parse_args(UP_ARGV)
    assert _engine_flags(up, _WORKER_FLAGS) == [
        "--lease-ttl-s", "11.0", "--expert-load-interval-s", "2.0", "--expert-load-window-s",
        "30.0", "--expert-load-windows", "12",
    ]  # fmt: skip
    assert "--decode-stall-timeout-s" in _engine_flags(up, _FAILOVER_FLAGS)
