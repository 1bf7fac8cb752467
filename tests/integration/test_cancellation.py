"""Cancellation and deadlines free every block, on every worker, within a bounded time.

A seeded storm of streams is cancelled at random points: before the first token, while a
long prompt is prefilled or its KV moves, and mid-decode; short prompts take the local
prefill path on a decode worker, long ones (each with its own cache salt, so nothing is
cached) remote prefill plus KV transfer. Other streams run into their deadline mid-decode.
Afterwards every KV pool must be entirely free again within 15 s. Leases live 30 s, so a
lease nobody released would still pin its blocks then: a live lease always pins at least
one block (a prompt has at least one token), which is how "no lease remains" is checked.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import grpc
import pytest

from common.contract.sampling import SamplingParams
from pdserve.client import GatewayClient
from tests.integration.conftest import Stack
from tests.prompts import passage

pytestmark = pytest.mark.slow

SEED = 1234
NUM_STREAMS = 100
MAX_TOKENS = 12
FREE_WITHIN_S = 15.0  # well under the 30 s lease TTL


@dataclass(frozen=True)
class Plan:
    """Where one stream of the storm is cancelled."""

    index: int
    long_prompt: bool  # remote prefill + KV transfer; else local prefill on the decode worker
    point: str  # "at_once" | "after_delay" | "after_tokens"
    start_after_s: float  # spreads the streams over time, so they meet every phase
    cancel_after_s: float  # point == "after_delay"
    cancel_after_tokens: int  # point == "after_tokens"


@dataclass
class Outcome:
    plan: Plan | None
    num_tokens: int = 0
    code: grpc.StatusCode | None = None  # None: the stream finished
    first_token_s: float | None = None


def storm_plans(seed: int, count: int) -> list[Plan]:
    rng = random.Random(seed)
    return [
        Plan(
            index=index,
            long_prompt=rng.random() < 0.5,
            point=rng.choice(["at_once", "after_delay", "after_delay", "after_tokens"]),
            start_after_s=rng.uniform(0.0, 2.0),
            cancel_after_s=rng.uniform(0.0, 1.5),
            cancel_after_tokens=rng.randint(1, MAX_TOKENS - 1),
        )
        for index in range(count)
    ]


def start_stream(
    client: GatewayClient,
    index: int,
    long_prompt: bool,
    sampling: SamplingParams,
    timeout_s: float | None = None,
) -> grpc.aio.UnaryStreamCall:
    if long_prompt:
        # ~70 prompt tokens, uncached (own salt): over local_prefill_tokens, so prefill is remote.
        return client.stream(
            prompt=f"{passage(2, offset=index)}\n\nWhat is this about? ({index})",
            sampling=sampling,
            cache_salt=f"cancel-{time.time()}-{index}",
            timeout_s=timeout_s,
        )
    # A few raw tokens: the decode worker prefills them itself.
    return client.stream(
        raw_prompt=f"Item {index}: the river", sampling=sampling, timeout_s=timeout_s
    )


async def read(call: grpc.aio.UnaryStreamCall, outcome: Outcome, cancel_after_tokens: int) -> None:
    start = time.monotonic()
    try:
        async for message in call:
            if message.token_ids and outcome.first_token_s is None:
                outcome.first_token_s = time.monotonic() - start
            outcome.num_tokens += len(message.token_ids)
            if outcome.num_tokens >= cancel_after_tokens:
                call.cancel()
    except asyncio.CancelledError:
        outcome.code = grpc.StatusCode.CANCELLED
    except grpc.aio.AioRpcError as exc:
        outcome.code = exc.code()


async def run_plan(client: GatewayClient, plan: Plan) -> Outcome:
    await asyncio.sleep(plan.start_after_s)
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    call = start_stream(client, plan.index, plan.long_prompt, sampling)
    if plan.point == "at_once":
        call.cancel()
    elif plan.point == "after_delay":
        asyncio.get_running_loop().call_later(plan.cancel_after_s, call.cancel)
    outcome = Outcome(plan)
    never = MAX_TOKENS + 1
    await read(call, outcome, plan.cancel_after_tokens if plan.point == "after_tokens" else never)
    return outcome


async def run_storm(target: str, plans: list[Plan]) -> list[Outcome]:
    client = GatewayClient(target)
    try:
        return list(await asyncio.gather(*(run_plan(client, p) for p in plans)))
    finally:
        await client.close()


async def run_six(target: str, max_tokens: int, timeout_s: float | None) -> list[Outcome]:
    """Three short prompts and three long ones, concurrently, to the end or the deadline."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    client = GatewayClient(target)

    async def one(index: int) -> Outcome:
        outcome = Outcome(None)
        call = start_stream(client, index, index % 2 == 1, sampling, timeout_s)
        await read(call, outcome, max_tokens + 1)
        return outcome

    try:
        return list(await asyncio.gather(*(one(i) for i in range(6))))
    finally:
        await client.close()


def wait_everything_free(stack: Stack, timeout_s: float) -> tuple[float, list[dict]]:
    """(seconds it took, the last status of every process with a KV pool or store)."""
    start = time.monotonic()
    while True:
        workers = [w for w in stack.workers() if w["kv_blocks_total"]]
        idle = all(
            w["kv_blocks_free"] == w["kv_blocks_total"] and not w["running"] and not w["waiting"]
            for w in workers
        )
        elapsed = time.monotonic() - start
        if idle or elapsed > timeout_s:
            return elapsed, workers
        time.sleep(0.2)


def assert_everything_free(stack: Stack) -> None:
    elapsed, workers = wait_everything_free(stack, FREE_WITHIN_S)
    roles = sorted(w["role"] for w in workers)
    assert roles.count("prefill") == 2 and roles.count("decode") == 2, workers
    held = [w for w in workers if w["kv_blocks_free"] != w["kv_blocks_total"]]
    busy = [w for w in workers if w["running"] or w["waiting"]]
    assert not held and not busy, f"after {elapsed:.1f}s: held {held}, busy {busy}"


def server_faults(stack: Stack) -> list[str]:
    """Every ERROR line the stack's processes have logged so far."""
    return [
        line
        for log in sorted((stack.run_dir / "logs").glob("*.log"))
        for line in log.read_text(errors="replace").splitlines()
        if " ERROR " in line
    ]


def test_storm_plans_cover_every_cancellation_point() -> None:
    plans = storm_plans(SEED, NUM_STREAMS)
    assert len(plans) == NUM_STREAMS
    for long_prompt in (False, True):
        points = {p.point for p in plans if p.long_prompt == long_prompt}
        assert points == {"at_once", "after_delay", "after_tokens"}


def test_100_cancelled_streams_leave_no_block_held(stack: Stack) -> None:
    assert_everything_free(stack)
    faults = server_faults(stack)
    outcomes = asyncio.run(run_storm(stack.target, storm_plans(SEED, NUM_STREAMS)))

    assert len(outcomes) == NUM_STREAMS
    unexpected = [o for o in outcomes if o.code not in (None, grpc.StatusCode.CANCELLED)]
    assert not unexpected, unexpected
    cancelled = [o for o in outcomes if o.code is grpc.StatusCode.CANCELLED]
    assert all(o.num_tokens == 0 for o in cancelled if o.plan and o.plan.point == "at_once")
    mid_decode = [o for o in cancelled if o.plan and o.plan.point == "after_tokens"]
    assert all(0 < o.num_tokens < MAX_TOKENS for o in mid_decode)
    assert len(mid_decode) >= 10, "too few streams were cancelled mid-decode"
    # Long prompts cancelled before their first token: in routing, prefill or KV transfer.
    early = [o for o in cancelled if o.plan and o.plan.long_prompt and not o.num_tokens]
    assert len(early) >= 10, "too few long prompts were cancelled before a token"

    assert_everything_free(stack)
    assert server_faults(stack) == faults  # a cancellation is no server fault


def test_deadlines_expiring_mid_decode_leave_no_block_held(stack: Stack) -> None:
    assert_everything_free(stack)
    # The same six streams, two tokens each, time this machine's first tokens: the deadline
    # leaves room for them, and far too little for 400 tokens.
    warm = asyncio.run(run_six(stack.target, 2, None))
    assert all(w.code is None and w.first_token_s is not None for w in warm), warm
    timeout_s = 2 * max(w.first_token_s or 0.0 for w in warm) + 2.0
    faults = server_faults(stack)
    results = asyncio.run(run_six(stack.target, 400, timeout_s))
    for r in results:
        assert r.code is grpc.StatusCode.DEADLINE_EXCEEDED, (timeout_s, results)
        assert 0 < r.num_tokens < 400, (timeout_s, results)
    assert_everything_free(stack)
    # The deadline is the caller's, passed down to every worker: no process calls it a fault.
    assert server_faults(stack) == faults
