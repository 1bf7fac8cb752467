"""BlockStoreConfig and the ``pdserve blockstore`` flags."""

from __future__ import annotations

import argparse

import pytest

from pdserve.cli.commands import blockstore as command
from services.blockstore.config import BlockStoreConfig


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    command.register(parser.add_subparsers())
    return parser.parse_args(["blockstore", *argv])


def test_flags_become_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_REDIS_URL", raising=False)
    monkeypatch.delenv("PDSERVE_BLOCKSTORE_CAPACITY", raising=False)
    args = parse("--port", "0", "--capacity", "2GiB", "--worker-id", "bs-7", "--put-expiry-s", "5")
    assert args.func is command.run
    config = command.config_from_args(args)
    assert config == BlockStoreConfig(
        capacity_bytes=2 * 2**30, host="127.0.0.1", port=0, worker_id="bs-7", put_expiry_s=5.0
    )
    assert config.resolved_worker_id(1234) == "bs-7"
    assert config.advertised_address(1234) == "127.0.0.1:1234"


def test_defaults_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_REDIS_URL", "redis://r:6379/0")
    monkeypatch.setenv("PDSERVE_BLOCKSTORE_CAPACITY", "512MiB")
    config = command.config_from_args(parse())
    assert (config.port, config.capacity_bytes, config.redis_url) == (
        50060,
        512 * 2**20,
        "redis://r:6379/0",
    )
    flagged = command.config_from_args(
        parse("--redis-url", "redis://other:1/0", "--capacity", "1MB")
    )
    assert (flagged.redis_url, flagged.capacity_bytes) == ("redis://other:1/0", 10**6)


def test_a_wildcard_host_advertises_the_host_name() -> None:
    config = BlockStoreConfig(capacity_bytes=1, host="[::]", port=0)
    assert not config.advertised_address(9).startswith("[::]")
    assert config.advertised_address(9).endswith(":9")
    assert BlockStoreConfig(capacity_bytes=1, advertise="bs:1").advertised_address(9) == "bs:1"


@pytest.mark.parametrize(
    "overrides",
    [{"capacity_bytes": 0}, {"port": 70000}, {"put_expiry_s": 0.0}, {"index_ttl_s": 1}],
)
def test_invalid_configs_are_rejected(overrides: dict[str, object]) -> None:
    values: dict[str, object] = {"capacity_bytes": 1, **overrides}
    with pytest.raises(ValueError):
        BlockStoreConfig(**values)  # type: ignore[arg-type]


def test_capacity_must_be_readable() -> None:
    with pytest.raises(ValueError, match="cannot read"):
        BlockStoreConfig.from_env(capacity="lots")


def test_disk_tier_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    monkeypatch.delenv("PDSERVE_BLOCKSTORE_DISK_DIR", raising=False)
    monkeypatch.delenv("PDSERVE_BLOCKSTORE_DISK_CAPACITY", raising=False)
    assert command.config_from_args(parse()).disk_dir is None  # memory only by default
    config = command.config_from_args(
        parse("--disk-dir", f"{tmp_path}/kv", "--disk-capacity", "20GiB")
    )
    assert (config.disk_dir, config.disk_capacity_bytes) == (f"{tmp_path}/kv", 20 * 2**30)
    assert config.disk_segment_bytes == 64 << 20
    halved = command.config_from_args(parse("--disk-dir", f"{tmp_path}/kv"))  # not made yet
    assert halved.disk_capacity_bytes > 0  # half of the file system that will hold it
    monkeypatch.setenv("PDSERVE_BLOCKSTORE_DISK_DIR", f"{tmp_path}/env")
    monkeypatch.setenv("PDSERVE_BLOCKSTORE_DISK_CAPACITY", "8MiB")
    from_env = command.config_from_args(parse())
    assert (from_env.disk_dir, from_env.disk_capacity_bytes) == (f"{tmp_path}/env", 8 << 20)
    assert from_env.disk_segment_bytes == 1 << 20  # an eighth of a small disk
    with pytest.raises(ValueError, match="disk capacity must be at least"):
        BlockStoreConfig(capacity_bytes=1, disk_dir="/x", disk_capacity_bytes=1000)
