"""Worker profiles in a real redis-server (common/index/profiles.py), and ``pdserve profile``
end to end on a tiny checkpoint: the table, --json, the local cache and --redis-url."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from common.index import keys
from common.index.profiles import DEFAULT_TTL_S, ProfileStore
from common.planner.profile import ProfileKey, WorkerProfile
from common.planner.profile_files import load_profile
from pdserve.cli.launcher import free_port
from pdserve.cli.main import main as cli_main
from tests.factories import make_tiny_checkpoint
from tests.redis_server import redis_server
from tests.unit.test_profile import a_profile

pytestmark = pytest.mark.redis

DAY_MS = 24 * 3600 * 1000


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    with redis_server(tmp_path) as url:
        yield url


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


async def _client(url: str) -> Any:
    import redis.asyncio

    return redis.asyncio.from_url(url)


def test_put_get_list_by_model_with_ttls(redis_url: str) -> None:
    first = a_profile()  # SmolLM2-135M-Instruct, gguf, 2 threads, an H200
    on_cpu = dataclasses.replace(first, key=dataclasses.replace(first.key, device="cpu"))
    other_model = dataclasses.replace(first, key=ProfileKey("other", "", 4, "cpu"))

    async def scenario() -> None:
        client = await _client(redis_url)
        store = ProfileStore(client)
        assert await store.get(first.key) is None
        assert await store.list(first.key.model) == []
        for profile in (first, on_cpu, other_model):
            await store.put(profile)
        assert await store.get(first.key) == first
        assert await store.get(on_cpu.key) == on_cpu
        assert await store.list(first.key.model) == [on_cpu, first]  # by slug
        assert await store.list("other") == [other_model]
        model = first.key.model
        assert sorted(k.decode() for k in await client.keys("*")) == sorted([
            f"pdserve:v1:{model}:profile:{model}.gguf-MOSTLY_Q4_1-a16.t2.cpu",
            f"pdserve:v1:{model}:profile:{model}.gguf-MOSTLY_Q4_1-a16.t2.cuda-NVIDIA-H200",
            f"pdserve:v1:{model}:profiles",
            "pdserve:v1:other:profile:other.float.t4.cpu",
            "pdserve:v1:other:profiles",
        ])  # fmt: skip
        profile_key = keys.profile(model, first.key.slug())
        for key in (profile_key, keys.profiles(model)):
            assert 30 * DAY_MS - 60_000 < await client.pttl(key) <= 30 * DAY_MS
        # A put renews both TTLs.
        await client.pexpire(profile_key, 5000)
        await client.pexpire(keys.profiles(model), 5000)
        await store.put(first)
        for key in (profile_key, keys.profiles(model)):
            assert await client.pttl(key) > DEFAULT_TTL_S * 1000 - 60_000
        await client.aclose()

    run(scenario())


def test_expired_and_unreadable_profiles_are_left_out(redis_url: str) -> None:
    first = a_profile()
    on_cpu = dataclasses.replace(first, key=dataclasses.replace(first.key, device="cpu"))
    model = first.key.model

    async def scenario() -> None:
        client = await _client(redis_url)
        store = ProfileStore(client)
        await store.put(first)
        await store.put(on_cpu)
        await client.delete(keys.profile(model, on_cpu.key.slug()))  # as if it expired
        assert await store.list(model) == [first]
        assert await client.smembers(keys.profiles(model)) == {first.key.slug().encode()}
        await client.set(keys.profile(model, first.key.slug()), "{not json")
        assert await store.get(first.key) is None
        assert await store.list(model) == []
        await client.aclose()

    run(scenario())


def test_profile_command_end_to_end(
    tmp_path: Path,
    redis_url: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    ckpt = make_tiny_checkpoint(tmp_path / "tiny-llama")
    out = tmp_path / "profile.json"
    argv = ["profile", "--model", str(ckpt), "--device", "cpu", "--num-kv-blocks", "128",
            "--threads", "1", "--json", str(out), "--redis-url", redis_url]  # fmt: skip
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out

    profile = WorkerProfile.from_json(out.read_text())
    assert profile.key == ProfileKey("tiny-llama", "", 1, "cpu")
    assert (profile.num_kv_blocks, profile.block_size, profile.max_model_len) == (128, 16, 1024)
    assert len(profile.prefill_samples) >= 3 and len(profile.decode_samples) >= 3
    assert json.loads(out.read_text())["key"]["model"] == "tiny-llama"
    assert load_profile(profile.key) == profile  # the local cache has it too
    stored = run(_stored(redis_url, profile.key))
    assert stored == profile

    assert "profile of tiny-llama: weights float, threads 1, device cpu" in printed
    assert "KV capacity: 128 blocks x 16 tokens = 2048 tokens; max_num_seqs 32" in printed
    lines = printed.splitlines()
    prefill_rows = lines[lines.index("prefill, submission to first token:") + 2 :]
    for sample, row in zip(profile.prefill_samples, prefill_rows, strict=False):
        cells = row.split()
        assert [int(cells[0]), int(cells[1]), float(cells[3])] == [
            sample.prompt_tokens, sample.cached_tokens, round(sample.ms, 1)
        ]  # fmt: skip
    assert printed.count("fits its samples within") == 2
    assert f"stored in Redis at {redis_url}" in printed


async def _stored(url: str, key: ProfileKey) -> WorkerProfile | None:
    client = await _client(url)
    try:
        return await ProfileStore(client).get(key)
    finally:
        await client.aclose()


def test_profile_command_says_when_the_gateway_cannot_be_reached(
    capsys: pytest.CaptureFixture[str],
) -> None:
    port = free_port()  # nothing listens there
    assert cli_main(["profile", "--worker", "w1", "--target", f"127.0.0.1:{port}"]) == 1
    assert "pdserve profile: UNAVAILABLE" in capsys.readouterr().err
