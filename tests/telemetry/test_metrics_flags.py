"""--metrics-port on every service command, and how ``pdserve up`` hands them out and
records them for ``pdserve status``."""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import pytest

from pdserve.cli.commands.up import _metrics_ports
from pdserve.cli.launcher import Child, StackState
from pdserve.cli.main import build_parser
from services.blockstore.config import BlockStoreConfig
from services.gateway.config import GatewayConfig


@pytest.mark.parametrize(
    "argv",
    [
        ["gateway", "--metrics-port", "9100"],
        ["prefill", "--metrics-port", "9100"],
        ["decode", "--metrics-port", "9100"],
        ["blockstore", "--metrics-port", "9100"],
    ],
)
def test_every_service_command_takes_a_metrics_port(argv: list[str]) -> None:
    assert build_parser().parse_args(argv).metrics_port == 9100


def test_the_metrics_port_defaults_to_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_METRICS_PORT", raising=False)
    assert build_parser().parse_args(["gateway"]).metrics_port == 0


def test_metrics_ports_are_validated() -> None:
    with pytest.raises(ValueError, match="metrics_port"):
        GatewayConfig(model="m", redis_url="redis://x", metrics_port=70000)
    with pytest.raises(ValueError, match="metrics_port"):
        BlockStoreConfig(capacity_bytes=1, metrics_port=-1)


def _up_args(metrics_port: int | None, no_blockstore: bool = False) -> argparse.Namespace:
    return argparse.Namespace(
        metrics_port=metrics_port, prefill=2, decode=1, no_blockstore=no_blockstore
    )


def test_up_gives_the_gateway_the_base_port_and_the_others_the_next_ones() -> None:
    # Start order: block store, prefill-0, prefill-1, decode-0, then the gateway.
    assert list(_metrics_ports(_up_args(9400))) == [9401, 9402, 9403, 9404, 9400]
    assert list(_metrics_ports(_up_args(9400, no_blockstore=True))) == [9401, 9402, 9403, 9400]
    assert list(itertools.islice(_metrics_ports(_up_args(0)), 5)) == [0] * 5
    free = list(itertools.islice(_metrics_ports(_up_args(None)), 5))
    assert all(port > 0 for port in free) and len(set(free)) == 5


def test_the_stack_file_records_metrics_endpoints(tmp_path: Path) -> None:
    path = tmp_path / "stack.json"
    state = StackState(
        children=[
            Child("gateway", "gateway", 1, "127.0.0.1:50051", "g.log", 9400),
            Child("redis", "redis", 2, "127.0.0.1:6379", "r.log"),
        ]
    )
    state.save(path)
    loaded = StackState.load(path)
    assert loaded is not None
    assert [c.metrics_url for c in loaded.children] == ["http://127.0.0.1:9400/metrics", None]
    # A stack recorded before metrics existed still loads.
    raw = json.loads(path.read_text())
    for child in raw["children"]:
        del child["metrics_port"]
    path.write_text(json.dumps(raw))
    old = StackState.load(path)
    assert old is not None and [c.metrics_port for c in old.children] == [0, 0]
