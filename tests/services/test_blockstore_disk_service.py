"""The block store's disk tier on real processes: a store filled past its memory and
restarted on the same directory serves every prefix from disk and republishes it to a real
Redis; a ``pdserve blockstore`` process killed with SIGKILL while it spills keeps every
block it had written, bit for bit, and nothing torn; damaged segment files are caught by
their checksums and never served; the files stay under their bound."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from common.errors import NotFoundError
from common.index import keys
from common.index.prefix_index import PrefixIndex
from common.kv.block_store_client import BlockStoreClient
from common.kv.layout import KvLayout
from services.blockstore.config import BlockStoreConfig
from services.blockstore.server import BlockStoreProcess, start
from tests.polling import until_async
from tests.redis_server import redis_server

pytestmark = pytest.mark.redis

# [n, L=2, 2, S=16, Hkv=2, D=64] float32: 32 KiB a block
LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
BLOCK = LAYOUT.bytes_per_block
MODEL = "tiny"
DISK = 2 << 20  # 64 blocks' worth of segment files


def blocks_for(hashes: list[int]) -> torch.Tensor:
    """Each block's contents follow from its hash, so any block read back can be checked."""
    return torch.stack(
        [
            torch.randn(LAYOUT.block_shape, generator=torch.Generator().manual_seed(h))
            for h in hashes
        ]
    )


def run(body: Any) -> None:
    asyncio.run(asyncio.wait_for(body(), timeout=120))


@contextlib.asynccontextmanager
async def disk_store(
    directory: Path, memory_blocks: int = 8, disk: int = DISK, **overrides: Any
) -> AsyncIterator[BlockStoreProcess]:
    config = BlockStoreConfig(
        capacity_bytes=memory_blocks * BLOCK, host="127.0.0.1", port=0, drain_grace_s=5.0,
        disk_dir=str(directory), disk_capacity_bytes=disk, **overrides,
    )  # fmt: skip
    process = await start(config)
    try:
        yield process
    finally:
        await process.stop()


@contextlib.asynccontextmanager
async def client_of(port: int) -> AsyncIterator[BlockStoreClient]:
    client = BlockStoreClient(f"127.0.0.1:{port}", MODEL, LAYOUT)
    try:
        yield client
    finally:
        await client.close()


async def put_prompts(client: BlockStoreClient, prompts: list[list[int]]) -> None:
    for hashes in prompts:
        await client.put(hashes, blocks_for(hashes), timeout_s=10)


async def present(client: BlockStoreClient, hashes: list[int]) -> list[bool]:
    return [await client.contains([h], timeout_s=10) == 1 for h in hashes]


def disk_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("seg-*.pdkv"))


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    with redis_server(tmp_path) as url:
        yield url


def test_a_restarted_store_serves_every_prefix_from_disk(tmp_path: Path, redis_url: str) -> None:
    import redis.asyncio

    prompts = [[100 * p + i for i in range(1, 5)] for p in range(1, 9)]  # 32 blocks, memory 8
    every = [h for hashes in prompts for h in hashes]

    async def body() -> None:
        redis_client = redis.asyncio.from_url(redis_url)
        index = PrefixIndex(redis_client, MODEL)
        try:
            store = disk_store(tmp_path / "kv", redis_url=redis_url, heartbeat_s=0.1)
            async with store as first, client_of(first.port) as client:
                await put_prompts(client, prompts)
                assert await present(client, every) == [True] * 32  # past memory: on disk
                assert first.store.stats().num_evictions >= 24
                got = await client.get(prompts[0], timeout_s=10)  # evicted long ago
                assert torch.equal(got, blocks_for(prompts[0]))
            assert await index.lookup(every[:1]) == []  # a stopped store withdraws its blocks

            async with disk_store(tmp_path / "kv", redis_url=redis_url, heartbeat_s=0.1) as again:
                assert again.store.stats().num_blocks == 0  # memory starts empty
                async with client_of(again.port) as client:

                    async def republished() -> bool:
                        return len(await index.lookup(every)) == 32

                    await until_async("republished", republished, timeout_s=10.0)
                    assert (await index.lookup(every[:1]))[0] == {keys.STORE_LOCATION: "disk"}
                    for hashes in prompts:
                        assert await client.contains(hashes, timeout_s=10) == 4
                        got = await client.get(hashes, timeout_s=10)
                        assert torch.equal(got, blocks_for(hashes))
                    stats = again.store.stats()
                    assert stats.prefix_hit_rate == 1.0 and stats.num_disk_reads == 32
                    assert stats.num_blocks_found_on_disk == 32
                    # A put of blocks the disk holds sends nothing; new ones still go in.
                    assert await client.put(prompts[3], blocks_for(prompts[3])) == 0
                    assert await client.put([9001], blocks_for([9001])) == 1
        finally:
            await redis_client.aclose()

    run(body)


def test_damaged_segment_files_are_never_served(tmp_path: Path) -> None:
    prompts = [[10 * p + i for i in range(1, 5)] for p in range(1, 5)]
    every = [h for hashes in prompts for h in hashes]
    directory = tmp_path / "kv"

    async def body() -> None:
        async with disk_store(directory) as first, client_of(first.port) as client:
            await put_prompts(client, prompts)
        # Flip a byte in the data of block 12 and cut the newest segment short mid-record.
        victim = blocks_for([12]).numpy().tobytes()
        segments = sorted(directory.glob("seg-*.pdkv"))
        for segment in segments:
            raw = bytearray(segment.read_bytes())
            if (where := raw.find(victim)) >= 0:
                raw[where + 1000] ^= 0x01
                segment.write_bytes(bytes(raw))
        newest = segments[-1]
        os.truncate(newest, newest.stat().st_size - BLOCK // 2)

        async with disk_store(directory) as again, client_of(again.port) as client:
            held = await present(client, every)
            assert held[: every.index(12)] == [True] * every.index(12)
            assert held[-1] is False  # the torn record was cut, never indexed
            with pytest.raises(NotFoundError, match="lost from the disk tier"):
                await client.get([*prompts[0][:1], 12], timeout_s=10)
            assert await present(client, [12]) == [False]  # found out, and forgotten
            good = [h for h, hit in zip(every, await present(client, every), strict=True) if hit]
            assert len(good) == 14  # all but the damaged and the torn
            for h in good:
                assert torch.equal(await client.get([h], timeout_s=10), blocks_for([h]))
            disk = again.spiller.disk.stats() if again.spiller else None
            assert disk is not None and disk.num_corrupt == 2

    run(body)


def test_the_disk_stays_under_its_bound(tmp_path: Path) -> None:
    directory = tmp_path / "kv"
    prompts = [[1000 * p + i for i in range(1, 5)] for p in range(1, 41)]  # 160 blocks, 5 MiB

    async def body() -> None:
        async with disk_store(directory) as process, client_of(process.port) as client:
            for hashes in prompts:
                await put_prompts(client, [hashes])
                assert process.spiller is not None and await process.spiller.flush(10)
                assert disk_bytes(directory) <= DISK
            held = await present(client, [h for hashes in prompts for h in hashes])
            assert 40 <= sum(held) <= 64 and held[-40:] == [True] * 40  # the newest stay
            assert held[:4] == [False] * 4

    run(body)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_sigkill_while_spilling_loses_no_written_block(tmp_path: Path) -> None:
    directory = tmp_path / "kv"
    port = _free_port()
    argv = [sys.executable, "-m", "pdserve", "--log-level", "WARNING", "blockstore",
            "--port", str(port), "--capacity", str(8 * BLOCK), "--disk-dir", str(directory),
            "--disk-capacity", str(4 * DISK)]  # fmt: skip
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    put: list[int] = []

    async def load_until_killed() -> None:
        async with client_of(port) as client:
            started = time.monotonic()
            while time.monotonic() - started < 30:
                with contextlib.suppress(Exception):  # not serving yet
                    if await client.contains([1], timeout_s=1) >= 0:
                        break
                await asyncio.sleep(0.1)
            for p in range(1, 25):
                hashes = [10 * p + i for i in range(1, 5)]
                await client.put(hashes, blocks_for(hashes), timeout_s=10)
                put.extend(hashes)
                if len(put) == 48:  # wait until these 48 are in the files: written

                    async def written() -> bool:
                        return disk_bytes(directory) >= 48 * BLOCK

                    await until_async("written", written)
            child.send_signal(signal.SIGKILL)  # the last 48 were put just now: mid-spill

    try:
        run(load_until_killed)
        assert child.wait(timeout=10) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()

    async def check() -> None:
        async with disk_store(directory, disk=4 * DISK) as again, client_of(again.port) as client:
            held = await present(client, put)
            assert held[:48] == [True] * 48  # every block written before the kill is there
            for h, hit in zip(put, held, strict=True):
                if hit:  # every block the disk kept reads back whole and exact
                    assert torch.equal(await client.get([h], timeout_s=10), blocks_for([h]))
            assert again.store.stats().num_disk_blocks == sum(held)

    run(check)
