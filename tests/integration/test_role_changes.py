"""Engine workers change roles in place under load, on a real stack (redis-server, block
store, 1 prefill and 2 decode workers, gateway: all processes), and no request is lost or
altered.

8 greedy streams of 300 tokens run at once while ``pdserve role`` flips a decode worker (the
one running the most streams at the time) to prefill and the prefill worker to decode, and
back, 6 times (24 role changes). Every stream
completes with exactly the tokens of its undisturbed run on the same stack; none fails;
the streams of a worker leaving the decode role continue elsewhere (migrations with reason
``role_changed``); after each flip a prompt seen before is still served from a prefix cache;
afterwards every KV pool is free and no lease is held.
"""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.contract.sampling import SamplingParams
from pdserve.client import GatewayClient, RemoteCompletion, collect
from tests.integration.conftest import Stack, up_stack
from tests.integration.test_decode_migration import (
    assert_nothing_held,
    assert_serving,
    gateway_metrics,
    status_json,
)
from tests.near_ties import NearTies
from tests.prompts import prompt_with_context

pytestmark = pytest.mark.slow

# Streams long enough to outlast the flips: at 300 tokens a CI run (stop 43) saw only the
# first of 6 flips move any ([0, 4, 0, 4, 0, 0, ...]), the streams running out meanwhile.
MAX_TOKENS = 450
NUM_STREAMS = 8
NUM_FLIPS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
PROMPTS = [prompt_with_context(i % 6, i) for i in range(NUM_STREAMS)]
# Seen before every flip's check: its prefix must still be served from a cache.
PROBE = prompt_with_context(5, 99)
PROBE_SAMPLING = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
DECODE_WORKERS = ("decode-0", "decode-1")


def forward_and_back(leaving: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """A forward flip, then its reverse, each change in turn: the worker taking the decode
    role first, so that the streams of the one leaving it have somewhere new to go."""
    return (
        [("prefill-0", "decode"), (leaving, "prefill")],
        [(leaving, "decode"), ("prefill-0", "prefill")],
    )


@pytest.fixture(scope="module")
def role_stack(smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with up_stack(
        smollm_dir, tmp_path_factory, "roles", "--prefill", "1", "--decode", "2",
        "--kv-cache-memory", "256MiB", env_drop=("PDSERVE_METRICS_PORT",),
    ) as stack:  # fmt: skip
        yield stack


async def complete(
    client: GatewayClient,
    prompt: str,
    salt: str,
    sampling: SamplingParams = GREEDY,
    progress: list[int] | None = None,
    index: int = 0,
) -> RemoteCompletion:
    result = RemoteCompletion()
    async for message in client.stream(prompt=prompt, sampling=sampling, cache_salt=salt):
        collect(result, message)
        if progress is not None:
            progress[index] = len(result.token_ids)
    return result


async def set_role(stack: Stack, worker_id: str, role: str) -> str:
    """``pdserve role`` as a user runs it; its output line."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdserve", "role", worker_id, role, "--target", stack.target,
        env=stack.env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    return out.decode().strip()


async def busiest_decode_worker(client: GatewayClient) -> str:
    """The decode worker running the most streams now (the gateway's cluster status, as
    ``pdserve status`` reads it). Where the gateway sends a moved stream is its own choice (a
    worker that has just come back to the decode role may not be in its view yet), so a
    fixed worker to flip can end up holding nothing while the other holds every stream."""
    reply = await client.cluster_status()
    running = {w.worker_id: w.num_running_requests for w in reply.workers}
    return max(DECODE_WORKERS, key=lambda worker_id: running.get(worker_id, 0))


def test_role_flips_under_load_lose_and_alter_nothing(role_stack: Stack) -> None:
    near_ties = NearTies(role_stack.model_dir)
    moved_by_flips: list[int] = []  # what each pdserve role said it moved
    flipped_workers: list[str] = []  # the decode worker each forward flip took away

    async def undisturbed(client: GatewayClient) -> list[RemoteCompletion]:
        return list(await asyncio.gather(
            *(complete(client, p, f"calm-{i}") for i, p in enumerate(PROMPTS))
        ))  # fmt: skip

    async def flips(
        client: GatewayClient, streams: list[asyncio.Task[RemoteCompletion]]
    ) -> tuple[list[int], int]:
        """Flips while the streams run; the probe's cached tokens after each flip, and how
        many flips found streams still running."""
        cached, during = [], 0
        moved_by_flips.clear()
        flipped_workers.clear()
        for _ in range(NUM_FLIPS):
            leaving = await busiest_decode_worker(client)
            flipped_workers.append(leaving)
            for moves in forward_and_back(leaving):
                running = not all(s.done() for s in streams)
                lines = [await set_role(role_stack, worker_id, role) for worker_id, role in moves]
                for (worker_id, role), line in zip(moves, lines, strict=True):
                    assert line.startswith(f"{worker_id}: ") and f" -> {role} in " in line, line
                    moved = re.search(r", (\d+) decode streams moved on$", line)
                    moved_by_flips.append(int(moved[1]) if moved else 0)
                during += running
                probe = await complete(client, PROBE, "probe", PROBE_SAMPLING)
                assert probe.finish_reason == "length"
                cached.append(probe.cached_tokens)
        return cached, during

    async def run() -> tuple[list[RemoteCompletion], list[RemoteCompletion], list[int], int]:
        client = GatewayClient(role_stack.target)
        try:
            calm = await undisturbed(client)
            await complete(client, PROBE, "probe", PROBE_SAMPLING)  # its prefix now cached
            progress = [0] * NUM_STREAMS
            streams = [
                asyncio.create_task(complete(client, p, f"flip-{i}", progress=progress, index=i))
                for i, p in enumerate(PROMPTS)
            ]
            while min(progress) == 0:  # every stream is decoding
                await asyncio.sleep(0.01)
            cached, during = await flips(client, streams)
            return calm, list(await asyncio.gather(*streams)), cached, during
        finally:
            await client.close()

    migrated_before = gateway_metrics(role_stack).sum(
        "pdserve:request_migrations_total", reason="role_changed"
    )
    calm, flipped, cached, during = asyncio.run(run())
    assert during >= 4, f"only {during} flips found the streams running"
    for i, (got, want) in enumerate(zip(flipped, calm, strict=True)):
        assert want.finish_reason == "length" and len(want.token_ids) == MAX_TOKENS, i
        assert got.finish_reason == "length", (i, got)
        if near_ties.check(PROMPTS[i], got.token_ids, want.token_ids, i):
            assert got.text == want.text, i
    # A prompt seen before is served from a prefix cache after every flip.
    assert len(cached) == 2 * NUM_FLIPS and min(cached) >= 64, cached
    metrics = gateway_metrics(role_stack)
    moved = metrics.sum("pdserve:request_migrations_total", reason="role_changed")
    assert moved - migrated_before > 0, "no stream was moved by a role change"
    # Every stream a worker said it moved on continued elsewhere, once.
    assert moved - migrated_before == sum(moved_by_flips), moved_by_flips
    assert sum(1 for m in moved_by_flips if m) >= 3, moved_by_flips  # moved again and again
    assert metrics.sum("pdserve:request_success_total", finished_reason="error") == 0
    # Every worker is back in its starting role, and nothing is held.
    roles = {w["id"]: w["role"] for w in status_json(role_stack) if "num_role_changes" in w}
    assert roles == {"prefill-0": "prefill", "decode-0": "decode", "decode-1": "decode"}
    changes = {w["id"]: w.get("num_role_changes") for w in status_json(role_stack)}
    assert {k: changes[k] for k in roles} == {
        "prefill-0": 2 * NUM_FLIPS,
        **{k: 2 * flipped_workers.count(k) for k in DECODE_WORKERS},
    }  # fmt: skip
    assert_nothing_held(role_stack)
    assert_serving(role_stack)


def test_bad_role_requests_get_a_status_that_says_why(role_stack: Stack) -> None:
    unknown = role_stack.cli("role", "decode-9", "prefill", "--target", role_stack.target)
    assert unknown.returncode == 1
    assert "NOT_FOUND" in unknown.stderr and "'decode-9'" in unknown.stderr
    assert "decode-0" in unknown.stderr  # it lists the engine workers there are
    bad_role = role_stack.cli("role", "decode-0", "banana", "--target", role_stack.target)
    assert bad_role.returncode == 1
    assert "INVALID_ARGUMENT" in bad_role.stderr and "WORKER_ROLE_PREFILL" in bad_role.stderr
    not_engine = role_stack.cli("role", "gateway-0", "decode", "--target", role_stack.target)
    assert not_engine.returncode == 1 and "NOT_FOUND" in not_engine.stderr
    # Nothing changed.
    roles = {w["id"]: w["role"] for w in status_json(role_stack) if "num_role_changes" in w}
    assert roles == {"prefill-0": "prefill", "decode-0": "decode", "decode-1": "decode"}


def test_a_running_workers_profile_through_the_gateway(role_stack: Stack) -> None:
    shown = role_stack.cli("profile", "--worker", "decode-0", "--target", role_stack.target)
    assert shown.returncode == 0, shown.stderr
    assert "decode" in shown.stdout and "prefill" in shown.stdout and "KV" in shown.stdout
    status = {w["id"]: w for w in status_json(role_stack)}
    assert status["decode-0"]["profile"]["kv_capacity_tokens"] > 0
