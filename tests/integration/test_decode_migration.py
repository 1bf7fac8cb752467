"""Workers die or restart under load on a real stack (redis-server, block store, 2 prefill and
2 decode workers, gateway: all processes) and no request is lost or altered.

The undisturbed output of every request is computed first on the same stack (greedy, and one
seeded-sampling request). Then:

- a rolling restart (``pdserve restart NAME``: SIGTERM, drain, start again; each worker in
  turn, each while it has requests under way) under a steady load: every request completes
  with exactly its undisturbed tokens; before each decode worker's restart the load starts
  long streams (192 tokens) afresh, which outlive the restart command's start-up and the
  drain grace period (0.4 s), so some move on to the other decode worker (migrations with
  reason ``draining``);
- a decode worker SIGKILLed while 17 streams run, after each of them has received some
  tokens: all complete, token- and text-identical to their undisturbed runs. The streams of
  the killed worker continue on the other one, which imports the prompt blocks and the full
  blocks of generated tokens (written behind by the killed worker) from the block store.

After each: every KV pool entirely free, no lease held, the block store holding no open put
or pinned block, and every process still alive SERVING.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import jsonschema
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.contract.eviction import KvEviction
from common.contract.sampling import SamplingParams
from common.contract.structured import ConstraintKind, StructuredOutput
from common.telemetry.metrics import Samples, scrape
from pdserve.client import GatewayClient, RemoteCompletion, collect
from pdserve.decode.v1 import decode_pb2, decode_pb2_grpc
from tests.integration.conftest import Stack, up_stack
from tests.near_ties import NearTies
from tests.polling import settle, until
from tests.prompts import prompt_with_context

pytestmark = pytest.mark.slow

# Long enough that the first streams are still running when the last ones (queued behind
# the others' prefills) have their first tokens.
MAX_TOKENS = 64
# Every stream has at least this many tokens when the worker dies: more than a block (16
# tokens), so each has filled a block of generated tokens past its prompt's last full one,
# and a few more steps for the killed worker to have written that block behind (a block goes
# to the store within services/worker/store_tier.py's WRITE_BEHIND_INTERVAL_S of filling). (At 8, with
# streams as even as they now run, none had crossed a boundary in one run of this test.)
KILL_AFTER_TOKENS = 20
# Drain grace period of every process of the stack: short enough that a fresh 64-token
# stream outlives it. At 1 s, on a quiet run, the young streams of both decode restarts
# ended inside it and none migrated (twice in CI runs, stops 24 and 27).
GRACE_S = 0.4
NUM_LOAD_LOOPS = 4
LOAD_TOKENS = 24  # max_tokens of the rolling restart's load: many short requests
# The streams under way when a decode worker restarts: long enough to outlive the start-up of
# `pdserve restart` (a Python process, 1-3 s on a busy 2-core machine) and then the grace
# period. At 64 tokens, a CI run saw every one end first and none migrate (stop 38).
LONG_TOKENS = 192
MIGRATIONS = "pdserve:request_migrations_total"


@dataclass(frozen=True)
class Job:
    index: int
    prompt: str
    sampling: SamplingParams


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(
    max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.95, seed=4321, ignore_eos=True
)
# 16 greedy requests (short prompts prefill on the decode worker, longer ones on a prefill
# worker) and one seeded.
JOBS = [Job(i, prompt_with_context(i % 6, i), GREEDY) for i in range(16)] + [
    Job(16, prompt_with_context(3, 16), SEEDED)
]
# One long stream per load loop for the decode restarts (greedy, and one seeded).
LONG_JOBS = [
    Job(len(JOBS) + i, j.prompt, replace(j.sampling, max_tokens=LONG_TOKENS))
    for i, j in enumerate((JOBS[1], JOBS[8], JOBS[13], JOBS[16]))
]


# A SIGKILLed decode worker can leave a block-store put open (its write-behind of a block);
# the store aborts it after the expiry, and assert_nothing_held waits longer than that.
PUT_EXPIRY_S = 6.0
SHORT_PUT_EXPIRY = ("--blockstore-put-expiry-s", str(PUT_EXPIRY_S))


@pytest.fixture(scope="module")
def chaos_stack(smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with up_stack(
        smollm_dir, tmp_path_factory, "chaos", "--kv-cache-memory", "256MiB",
        "--drain-grace-s", str(GRACE_S), *SHORT_PUT_EXPIRY, env_drop=("PDSERVE_METRICS_PORT",),
    ) as stack:  # fmt: skip
        yield stack


async def complete(
    client: GatewayClient,
    job: Job,
    salt: str,
    request_id: str = "",
    progress: dict[int, int] | None = None,
) -> RemoteCompletion:
    result = RemoteCompletion()
    stream = client.stream(
        prompt=job.prompt, sampling=job.sampling, cache_salt=salt, request_id=request_id
    )
    async for message in stream:
        collect(result, message)
        if progress is not None:
            progress[job.index] = len(result.token_ids)
    return result


@pytest.fixture(scope="module")
def undisturbed(chaos_stack: Stack) -> list[RemoteCompletion]:
    """Every job's output on the stack before anything happens to it."""

    seeded = JOBS[16]

    async def run() -> list[RemoteCompletion]:
        client = GatewayClient(chaos_stack.target)
        try:
            return list(
                await asyncio.gather(
                    *(complete(client, j, f"calm-{j.index}") for j in JOBS + LONG_JOBS),
                    complete(client, Job(seeded.index, seeded.prompt, GREEDY), "greedy"),
                )
            )
        finally:
            await client.close()

    *results, greedy_of_seeded = asyncio.run(run())
    for job, result in zip(JOBS + LONG_JOBS, results, strict=True):
        assert result.finish_reason == "length", job
        assert len(result.token_ids) == job.sampling.max_tokens, job
    # The seeded request samples: it is not what greedy decoding gives.
    assert results[seeded.index].token_ids != greedy_of_seeded.token_ids
    return results


def gateway_metrics(stack: Stack) -> Samples:
    url = stack.children()["gateway"].metrics_url
    assert url is not None
    return scrape(url)


def status_json(stack: Stack) -> list[dict]:
    result = stack.cli("status", "--target", stack.target, "--json")
    assert result.returncode == 0, result.stderr
    workers: list[dict] = json.loads(result.stdout)
    return workers


def assert_nothing_held(
    stack: Stack, skip_pids: tuple[int, ...] = (), timeout_s: float = 3 * PUT_EXPIRY_S
) -> None:
    """Every live process's KV pool free, no lease, no open put or pinned store block.

    With ``skip_pids`` killed, a put one of them left open counts until the store aborts it.
    """

    def held() -> list[dict]:
        return [
            w
            for w in stack.workers()
            if w["pid"] not in skip_pids
            and w["role"] in ("prefill", "decode", "blockstore")
            and (w["kv_blocks_free"] != w["kv_blocks_total"] or w["running"] or w["waiting"])
        ]

    still_held = settle(held, lambda workers: not workers, timeout_s)
    assert not still_held, still_held
    for name, child in stack.children().items():
        if child.role in ("prefill", "decode") and child.pid not in skip_pids:
            assert child.metrics_url is not None
            assert scrape(child.metrics_url).sum("pdserve:kv_leases_active") == 0, name


def assert_serving(stack: Stack, skip_pids: tuple[int, ...] = ()) -> None:
    for name, child in stack.children().items():
        if child.role == "redis" or child.pid in skip_pids:
            continue
        with grpc.insecure_channel(child.address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5.0
            )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, name


def wait_streams(stack: Stack, name: str, count: int, timeout_s: float = 120.0) -> None:
    """Until decode worker ``name`` runs ``count`` streams."""
    address = stack.children()[name].address
    with grpc.insecure_channel(address) as channel:
        stub = decode_pb2_grpc.DecodeServiceStub(channel)

        def running() -> int:
            return stub.GetStatus(
                decode_pb2.GetStatusRequest(), timeout=5.0
            ).status.num_running_requests

        until(f"{name} runs {count} streams", lambda: running() >= count, timeout_s, every_s=0.05)


@pytest.fixture(scope="module")
def near_ties(smollm_dir: Path) -> NearTies:
    return NearTies(smollm_dir)


def assert_same(
    job: Job, got: RemoteCompletion, want: RemoteCompletion, near_ties: NearTies
) -> None:
    """Token- and text-identical, or (greedy only) parted at a near-tie (tests/near_ties.py)."""
    assert got.finish_reason == "length", (job, got)
    want_ids = want.token_ids[: len(got.token_ids)]
    if job.sampling.temperature or near_ties.check(job.prompt, got.token_ids, want_ids, job.index):
        assert got.token_ids == want_ids, job
        assert want.text.startswith(got.text), job


def test_rolling_restart_of_every_worker_under_load_loses_no_request(
    chaos_stack: Stack, undisturbed: list[RemoteCompletion], near_ties: NearTies
) -> None:
    stack = chaos_stack
    pids_before = {w["id"]: w["pid"] for w in status_json(stack)}
    draining_before = gateway_metrics(stack).sum(MIGRATIONS, reason="draining")

    async def run() -> list[tuple[Job, RemoteCompletion | BaseException]]:
        client = GatewayClient(stack.target)
        done = asyncio.Event()
        go = asyncio.Event()  # the load loops start requests while set
        go.set()
        max_tokens = LOAD_TOKENS
        in_flight = 0
        results: list[tuple[Job, RemoteCompletion | BaseException]] = []

        async def load(loop: int) -> None:
            nonlocal in_flight
            n = 0
            while not done.is_set():
                await go.wait()
                if max_tokens == LONG_TOKENS:
                    job = LONG_JOBS[loop]
                else:
                    job = JOBS[(loop + n * NUM_LOAD_LOOPS) % len(JOBS)]
                    job = Job(job.index, job.prompt, replace(job.sampling, max_tokens=max_tokens))
                n += 1
                in_flight += 1
                try:
                    # A salt of its own: nothing cached, every request prefills and moves KV.
                    result = await complete(client, job, f"roll-{loop}-{n}")
                except grpc.aio.AioRpcError as exc:
                    results.append((job, exc))
                else:
                    results.append((job, result))
                finally:
                    in_flight -= 1

        async def fresh_long_streams(name: str) -> None:
            """Every load loop starts a LONG_JOBS request at once, and one runs on decode
            worker ``name``: young streams, sure to outlive the drain grace period (streams
            of the short load may be near their end by the time SIGTERM arrives)."""
            nonlocal max_tokens
            go.clear()
            while in_flight:
                await asyncio.sleep(0.05)
            max_tokens = LONG_TOKENS
            go.set()
            await asyncio.to_thread(wait_streams, stack, name, 1)

        loops = [asyncio.create_task(load(i)) for i in range(NUM_LOAD_LOOPS)]
        try:
            await asyncio.sleep(2.0)  # requests under way before the first SIGTERM
            for name in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
                if name.startswith("decode"):
                    await fresh_long_streams(name)
                restart = await asyncio.to_thread(stack.cli, "restart", name, timeout=900)
                assert restart.returncode == 0, restart.stdout + restart.stderr
                max_tokens = LOAD_TOKENS  # after the long streams, short requests again
            await asyncio.sleep(2.0)  # and some requests after the last worker is back
        finally:
            done.set()
            go.set()
            await asyncio.gather(*loops)
            await client.close()
        return results

    results = asyncio.run(run())
    failed = [(job.index, r) for job, r in results if isinstance(r, BaseException)]
    assert not failed, failed
    assert len(results) >= 2 * NUM_LOAD_LOOPS
    for job, result in results:
        assert isinstance(result, RemoteCompletion)
        # The undisturbed run, or its beginning (max_tokens is all that differs).
        assert len(result.token_ids) == job.sampling.max_tokens, job
        assert_same(job, result, undisturbed[job.index], near_ties)

    # Every worker is a new process, serving; the gateway saw drained streams move on.
    pids_after = {w["id"]: w["pid"] for w in status_json(stack)}
    for worker_id in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
        assert pids_after[worker_id] not in (0, pids_before[worker_id]), worker_id
        assert pids_after[worker_id] == stack.children()[worker_id].pid
    assert gateway_metrics(stack).sum(MIGRATIONS, reason="draining") > draining_before
    assert_nothing_held(stack)
    assert_serving(stack)


# A JSON answer long enough (24 items or more, some 350 tokens) to outlive the start-up of
# `pdserve restart` (a Python process, 1-3 s on a busy 2-core machine) and the drain grace
# period after it: structured output across a migration. (At 12 items, some 150 tokens, a
# fast single stream could end first, as the rolling restart's 64-token streams did.)
ITEMS_SCHEMA = {
    "type": "object",
    "properties": {"items": {
        "type": "array", "minItems": 24, "maxItems": 28,
        "items": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 12},
            "count": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["name", "count"], "additionalProperties": False},
    }},
    "required": ["items"],
    "additionalProperties": False,
}  # fmt: skip


def test_a_constrained_stream_drained_mid_object_ends_in_the_same_valid_json(
    chaos_stack: Stack,
) -> None:
    """A seeded JSON-schema request whose decode worker restarts (drains) mid-object moves
    to the other decode worker, which rebuilds the matcher from the tokens so far: the
    output is the undisturbed run's, token for token, and validates."""
    stack = chaos_stack
    constraint = StructuredOutput(ConstraintKind.JSON_SCHEMA, json.dumps(ITEMS_SCHEMA))
    job = Job(100, "List what is in a grocery bag, as JSON.",
              SamplingParams(max_tokens=900, temperature=0.8, seed=99,
                             structured_output=constraint))  # fmt: skip
    draining_before = gateway_metrics(stack).sum(MIGRATIONS, reason="draining")

    async def run() -> tuple[RemoteCompletion, RemoteCompletion, str]:
        client = GatewayClient(stack.target)
        try:
            calm = await complete(client, job, "json-calm")
            progress = {job.index: 0}
            stream = asyncio.create_task(complete(client, job, "json-storm", "json-storm",
                                                  progress))  # fmt: skip
            while progress[job.index] < KILL_AFTER_TOKENS:
                await asyncio.sleep(0.02)
            name = await asyncio.to_thread(running_decode_worker, stack)
            restart = await asyncio.to_thread(stack.cli, "restart", name, timeout=900)
            assert restart.returncode == 0, restart.stdout + restart.stderr
            return calm, await stream, name
        finally:
            await client.close()

    calm, storm, drained = asyncio.run(run())
    assert calm.finish_reason == "stop", calm.text
    jsonschema.validate(json.loads(calm.text), ITEMS_SCHEMA)
    assert storm.token_ids == calm.token_ids and storm.text == calm.text
    assert gateway_metrics(stack).sum(MIGRATIONS, reason="draining") > draining_before
    assert re.search(rf"request json-storm: decode stream from {drained}", stack.log_of("gateway"))
    assert_nothing_held(stack)
    assert_serving(stack)


def test_an_evicting_stream_drained_past_its_first_eviction_goes_on(chaos_stack: Stack) -> None:
    """A StreamingLLM stream (sinks 16, window 64) whose decode worker drains after 120
    tokens, well past its first eviction, with 480 to go: the gateway moves it with its
    eviction (part of the request's sampling) to the other decode worker, which imports the
    blocks written before the first eviction (the only ones ever written behind) and
    recomputes the rest evicting as it goes; the stream ends at max_tokens, its tokens before
    the drain are the undisturbed run's, and no block is left held. (After the move the
    stream's KV is recomputed in chunks, not token by token, so later tokens may differ.)"""
    stack = chaos_stack
    eviction = KvEviction(sink_tokens=16, window_tokens=64)
    job = Job(101, "Tell a long tale of a river and the boats upon it.",
              SamplingParams(max_tokens=600, ignore_eos=True, kv_eviction=eviction))  # fmt: skip

    async def run() -> tuple[RemoteCompletion, RemoteCompletion, int, str]:
        client = GatewayClient(stack.target)
        try:
            calm = await complete(client, job, "evict-calm")
            progress = {job.index: 0}
            stream = asyncio.create_task(complete(client, job, "evict-storm", "evict-storm",
                                                  progress))  # fmt: skip
            while progress[job.index] < 120:
                await asyncio.sleep(0.02)
            at_drain = progress[job.index]
            name = await asyncio.to_thread(running_decode_worker, stack)
            restart = await asyncio.to_thread(stack.cli, "restart", name, timeout=900)
            assert restart.returncode == 0, restart.stdout + restart.stderr
            return calm, await stream, at_drain, name
        finally:
            await client.close()

    calm, storm, at_drain, drained = asyncio.run(run())
    # 480 tokens left at the drain: the stream outlasts the drain's grace and must move.
    assert len(calm.token_ids) == len(storm.token_ids) == 600
    assert storm.finish_reason == "length"
    assert storm.token_ids[:at_drain] == calm.token_ids[:at_drain]
    assert re.search(rf"request evict-storm: decode stream from {drained}", stack.log_of("gateway"))
    assert_nothing_held(stack)
    assert_serving(stack)


def running_decode_worker(stack: Stack) -> str:
    """The decode worker that runs a stream (the one request in flight)."""
    for name in ("decode-0", "decode-1"):
        with grpc.insecure_channel(stack.children()[name].address) as channel:
            status = (
                decode_pb2_grpc.DecodeServiceStub(channel)
                .GetStatus(decode_pb2.GetStatusRequest(), timeout=5.0)
                .status
            )
        if status.num_running_requests:
            return name
    raise AssertionError("no decode worker runs the stream")


def test_sigkill_of_a_decode_worker_mid_stream_loses_and_repeats_nothing(
    chaos_stack: Stack, undisturbed: list[RemoteCompletion], near_ties: NearTies
) -> None:
    stack = chaos_stack
    victim = next(w for w in status_json(stack) if w["id"] == "decode-0")
    assert victim["pid"] == stack.children()["decode-0"].pid
    migrations_before = gateway_metrics(stack).sum(MIGRATIONS)

    async def run() -> tuple[list[RemoteCompletion], dict[int, int]]:
        client = GatewayClient(stack.target)
        progress = {job.index: 0 for job in JOBS}
        try:
            streams = [
                asyncio.create_task(
                    complete(client, j, f"storm-{j.index}", f"storm-{j.index}", progress)
                )
                for j in JOBS
            ]
            # Until every stream still running has its tokens. A stream may end first: one
            # alone on the other worker (the gateway's breaker can send nearly all of them to
            # one worker just after a restart) outruns 16 sharing a batch.
            running = list(zip(JOBS, streams, strict=True))
            while any(not s.done() and progress[j.index] < KILL_AFTER_TOKENS for j, s in running):
                await asyncio.sleep(0.02)
            at_kill = {j.index: progress[j.index] for j, s in running if not s.done()}
            os.kill(victim["pid"], signal.SIGKILL)
            return list(await asyncio.gather(*streams)), at_kill
        finally:
            await client.close()

    results, at_kill = asyncio.run(run())
    assert len(at_kill) >= len(JOBS) // 2, at_kill  # most streams were still running
    for job, result in zip(JOBS, results, strict=True):
        assert_same(job, result, undisturbed[job.index], near_ties)

    # The killed worker's streams continued on decode-1, which rebuilt their KV from the
    # block store: the prompt's full blocks, and for some also blocks of generated tokens.
    migrated = sorted(set(re.findall(r"request (storm-\d+): decode stream from decode-0 broke",
                                     stack.log_of("gateway"))))  # fmt: skip
    assert migrated, "no stream was on the killed worker"
    # Each stream of the killed worker broke mid-stream. (Streams on the survivor may be at
    # their last token by then: few in its batch, they outrun the victim's.)
    for request_id in migrated:
        index = int(request_id.removeprefix("storm-"))
        assert at_kill.get(index, MAX_TOKENS) < MAX_TOKENS, (request_id, at_kill)
    assert gateway_metrics(stack).sum(MIGRATIONS) - migrations_before == len(migrated)
    survivor_log = stack.log_of("decode-1")
    beyond_prompt = 0
    for request_id in migrated:
        found = re.search(
            rf"decode {request_id}: length, prompt (\d+) tokens \(0 context tokens cached, "
            r"(\d+) imported from block_store",
            survivor_log,
        )
        assert found, request_id
        num_prompt, num_imported = int(found[1]), int(found[2])
        assert num_imported >= num_prompt // 16 * 16, (request_id, num_prompt, num_imported)
        beyond_prompt += num_imported > num_prompt
    assert beyond_prompt > 0

    assert_nothing_held(stack, skip_pids=(victim["pid"],))
    assert_serving(stack, skip_pids=(victim["pid"],))
