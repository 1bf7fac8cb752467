"""``pdserve up`` forwards its flags to the processes it starts: every forwarded flag is one
the target command accepts, with the value given."""

from __future__ import annotations

import pytest

from common.engine.config import EngineConfig
from pdserve.cli.commands.up import (
    _DECODE_FLAGS,
    _ENGINE_FLAGS,
    _FAILOVER_FLAGS,
    _GATEWAY_FLAGS,
    _WORKER_FLAGS,
    _engine_flags,
    threads_per_worker,
)
from pdserve.cli.engine_args import engine_config_from_args
from pdserve.cli.main import build_parser

UP_ARGV = [
    "up", "--decode-stall-timeout-s", "7", "--prefill-timeout-s", "9", "--expert-load-interval-s",
    "2", "--expert-load-window-s", "30", "--expert-load-windows", "12", "--kv-pull-timeout-s", "4",
    "--max-num-seqs", "8", "--local-prefill-tokens", "32", "--lease-ttl-s", "11",
    "--quantization", "int4", "--quant-group-size", "64", "--quant-kernel", "torch",
    "--quant-act-bits", "8", "--kv-dtype", "int8", "--kv-eviction", "streaming", "--sink-tokens", "4",
    "--window-tokens", "512", "--kv-compression", "snapkv", "--snapkv-budget-tokens", "640",
    "--snapkv-window-tokens", "24", "--kv-prefault", "--prefill-attention", "sdpa",
]  # fmt: skip


@pytest.mark.parametrize(
    ("command", "names"),
    [
        # Every engine worker takes the decoding flags: its role may change to decode.
        ("prefill", _ENGINE_FLAGS + _WORKER_FLAGS + _DECODE_FLAGS),
        ("decode", _ENGINE_FLAGS + _WORKER_FLAGS + _DECODE_FLAGS),
        ("worker", _ENGINE_FLAGS + _WORKER_FLAGS + _DECODE_FLAGS),
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


def test_workers_share_the_cores_out_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)), raising=False)
    parser = build_parser()

    def threads(*argv: str) -> int | None:
        return threads_per_worker(parser.parse_args(["up", *argv]))

    # The cores are shared out among the workers of one role; the roles overlap.
    assert threads() == 8  # 8 cores, 1 prefill + 1 decode worker
    assert threads("--prefill", "2", "--decode", "2") == 4
    assert threads("--prefill", "0", "--decode", "1") == 8
    assert threads("--prefill", "1", "--decode", "3") == 2
    assert threads("--prefill", "4", "--decode", "12") == 1  # never 0
    assert threads("--threads-per-worker", "3") == 3
    assert threads("--threads-per-worker", "0") is None  # torch's default: every core
    # The value reaches the worker's engine config.
    worker = parser.parse_args(["prefill", "--threads", "3"])
    assert engine_config_from_args(worker, "model").num_threads == 3


def test_a_small_machine_starts_no_prefill_worker_unless_told(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pdserve.cli.commands.up import num_prefill_workers

    parser = build_parser()
    for cores, default in ((1, 0), (2, 0), (3, 1), (8, 1)):
        monkeypatch.setattr("os.sched_getaffinity", lambda pid, n=cores: set(range(n)),
                            raising=False)  # fmt: skip
        assert num_prefill_workers(parser.parse_args(["up"])) == default, cores
        assert num_prefill_workers(parser.parse_args(["up", "--prefill", "2"])) == 2
        assert num_prefill_workers(parser.parse_args(["up", "--prefill", "0"])) == 0
    # On 2 cores the decode worker alone takes both.
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert threads_per_worker(parser.parse_args(["up"])) == 2


def test_num_threads_comes_from_the_flag_or_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PDSERVE_NUM_THREADS", "2")
    assert EngineConfig.from_env("model").num_threads == 2
    assert EngineConfig.from_env("model", num_threads=5).num_threads == 5
    monkeypatch.delenv("PDSERVE_NUM_THREADS")
    assert EngineConfig.from_env("model").num_threads is None
    with pytest.raises(ValueError, match="num_threads"):
        EngineConfig(model="model", num_threads=0)


def test_block_store_flags_reach_pdserve_blockstore() -> None:
    from pdserve.cli.commands import blockstore
    from pdserve.cli.commands.up import _store_flags

    parser = build_parser()
    up = parser.parse_args(["up", "--blockstore-capacity", "256MiB", "--blockstore-disk-dir",
                            "kv-here", "--blockstore-disk-capacity", "2GiB",
                            "--blockstore-put-expiry-s", "12"])  # fmt: skip
    config = blockstore.config_from_args(parser.parse_args(["blockstore", *_store_flags(up)]))
    assert config.capacity_bytes == 256 << 20 and config.put_expiry_s == 12.0
    assert config.disk_capacity_bytes == 2 << 30
    assert config.disk_dir is not None and config.disk_dir.endswith("/kv-here")
    assert config.disk_dir.startswith("/")  # absolute: the child may run elsewhere
    assert _store_flags(parser.parse_args(["up"])) == []


def test_gateways_take_the_metrics_ports_from_the_base_and_at_least_one_is_asked() -> None:
    import argparse
    import itertools

    from pdserve.cli.commands.up import _metrics_ports

    args = argparse.Namespace(metrics_port=9100, prefill=1, decode=2, no_blockstore=False,
                              planner=False, gateways=3)  # fmt: skip
    # Start order: block store, workers, then the gateways, which take the base.
    ports = list(itertools.islice(_metrics_ports(args), 4 + 3))
    assert ports == [9103, 9104, 9105, 9106, 9100, 9101, 9102]
    assert len(set(ports)) == len(ports)
    parser = build_parser()
    assert parser.parse_args(["up", "--gateways", "2"]).gateways == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["up", "--gateways", "0"])


def test_each_gateway_takes_its_own_ports() -> None:
    from pdserve.cli.commands.up import gateway_ports

    parser = build_parser()
    defaults = parser.parse_args(["up", "--gateways", "3"])
    ports = [gateway_ports(defaults, i) for i in range(3)]
    assert ports == [(50051, 8000, 8001), (50052, 8002, 8003), (50053, 8004, 8005)]
    apart = parser.parse_args(["up", "--port", "7000", "--http-port", "9000", "--kserve-port",
                               "9500"])  # fmt: skip
    assert [gateway_ports(apart, i) for i in range(2)] == [(7000, 9000, 9500), (7001, 9001, 9501)]
    off = parser.parse_args(["up", "--http-port", "-1", "--kserve-port", "-1"])
    assert gateway_ports(off, 1) == (50052, -1, -1)
    free = parser.parse_args(["up", "--http-port", "0", "--kserve-port", "0"])
    _, http, kserve = gateway_ports(free, 1)
    assert http > 0 and kserve > 0 and http != kserve


def test_prefill_attention_comes_from_the_flag_or_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    worker = build_parser().parse_args(["decode", "--prefill-attention", "kernel"])
    assert engine_config_from_args(worker, "model").prefill_attention == "kernel"
    monkeypatch.setenv("PDSERVE_PREFILL_ATTENTION", "sdpa")
    assert EngineConfig.from_env("model").prefill_attention == "sdpa"
    assert EngineConfig.from_env("model", prefill_attention="kernel").prefill_attention == "kernel"
    monkeypatch.delenv("PDSERVE_PREFILL_ATTENTION")
    assert EngineConfig.from_env("model").prefill_attention == "auto"
    with pytest.raises(ValueError, match="prefill_attention must be one of auto, kernel, sdpa"):
        EngineConfig(model="model", prefill_attention="flash")
