"""Chaos on a real stack (``pdserve up``: redis-server, block store, 2 prefill and 2 decode
workers, gateway, all processes) under a steady load of concurrent streams:

- SIGSTOP a prefill worker (a hang, not a crash): its requests move on to the other prefill
  worker (or the decode worker) within --prefill-timeout-s; nothing fails; once SIGCONT'd it
  heartbeats again, and after a probe gets traffic again;
- SIGSTOP a decode worker: its streams go silent with their connections open; past
  --decode-stall-timeout-s each migrates to the other decode worker, and nothing fails;
  once SIGCONT'd the hung worker frees what the abandoned streams held and serves again;
- SIGKILL Redis, then start it again (empty) on its port: nothing fails while routing goes by
  load (``pdserve status`` and ``pdserve:index_available`` say so), the workers and the block
  store rebuild the index, and routing uses it again (a prompt cached before the outage is
  routed to its holder);
- SIGKILL a prefill worker: nothing fails (its prompts are prefilled again elsewhere, KV
  pulls from it fall back to the block store, then to recompute), and it leaves the registry;
- SIGKILL the block store: nothing fails (no prefix reuse across workers meanwhile).

After each: no block held anywhere (every live worker's KV pool entirely free, no lease
left), and every live process SERVING and in the registry. The scenarios share one stack
and run in this order; timeouts are short, configured for the test (flags of pdserve up).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.contract.sampling import SamplingParams
from common.index import redis_client
from common.index.prefix_index import PrefixIndex
from common.kv.hashing import hash_prompt_blocks
from common.telemetry.metrics import Samples, scrape
from pdserve.cli.launcher import Child, StackState, start_redis, wait_redis
from pdserve.client import GatewayClient
from tests.integration.conftest import Stack, up_stack
from tests.polling import settle_async, until, until_async
from tests.prompts import QUESTIONS, passage

pytestmark = pytest.mark.slow

PREFILL_TIMEOUT_S = 3.0
DECODE_STALL_TIMEOUT_S = 4.0
BREAKER_FAILURES = 2
BREAKER_COOLDOWN_S = 2.0
REGISTRY_TTL_S = 5.0  # a worker heartbeats every second; its entry lives 5
LANES = 6  # concurrent streams of the steady load
MAX_TOKENS = 6
REQUEST_TIMEOUT_S = 90.0  # generous: the machine is shared; a failure is a failure anyway
SAMPLING = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@dataclass
class ChaosStack(Stack):
    stopped: set[int] = field(default_factory=set)  # pids we SIGSTOPped (SIGCONT at the end)

    def state(self) -> StackState:
        state = StackState.load(self.run_dir / "stack.json")
        assert state is not None, "pdserve up recorded no stack"
        return state

    def child(self, name: str) -> Child:
        (child,) = [c for c in self.state().children if c.name == name]
        return child

    def metrics(self, name: str) -> Samples:
        url = self.child(name).metrics_url
        assert url is not None
        return scrape(url, timeout_s=5.0)

    def kill(self, name: str, sig: signal.Signals) -> Child:
        child = self.child(name)
        os.kill(child.pid, sig)
        if sig is signal.SIGSTOP:
            self.stopped.add(child.pid)
        elif sig is signal.SIGCONT:
            self.stopped.discard(child.pid)
        return child

    def restart_redis(self) -> None:
        """Starts redis-server again, empty, on the port the stack uses; ``pdserve down``
        stops it (the stack's state names the new process)."""
        state = self.state()
        port = int(state.redis_url.rsplit(":", 1)[1].split("/")[0])
        new, _ = start_redis(port, self.run_dir / "logs")
        wait_redis(state.redis_url, 30)
        state.children = [new if c.name == "redis" else c for c in state.children]
        state.save(self.run_dir / "stack.json")


@pytest.fixture(scope="module")
def chaos(smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosStack]:
    with up_stack(
        # 512 MiB: about 700 blocks a worker, so the steady load of a test (a few hundred
        # blocks of prompts) cannot evict what the test cached before it (the Redis test's
        # marker must still be held, and so republished, after the outage).
        smollm_dir, tmp_path_factory, "chaos", "--kv-cache-memory", "512MiB",
        "--prefill-timeout-s", str(PREFILL_TIMEOUT_S), "--kv-pull-timeout-s", "3",
        "--decode-stall-timeout-s", str(DECODE_STALL_TIMEOUT_S),
        "--blockstore-timeout-s", "1", "--breaker-failures", str(BREAKER_FAILURES),
        "--breaker-cooldown-s", str(BREAKER_COOLDOWN_S), kind=ChaosStack,
    ) as stack:  # fmt: skip
        try:
            yield stack
        finally:
            for pid in stack.stopped:
                os.kill(pid, signal.SIGCONT)


# -- the steady load -----------------------------------------------------------------------------


@dataclass
class Outcome:
    remote: bool  # a long, uncached prompt: remote prefill + KV transfer; else local prefill
    started: float  # time.monotonic()
    ttft_s: float | None = None
    total_s: float = 0.0
    num_tokens: int = 0
    code: grpc.StatusCode | None = None  # None: it completed
    details: str = ""


@dataclass
class Load:
    """``LANES`` streams at all times until stopped: two of three with a long prompt under
    its own cache salt (prefilled remotely, its KV pulled), one of three a few raw tokens
    (prefilled by the decode worker)."""

    target: str
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def lane(self, client: GatewayClient, lane: int) -> None:
        rng = random.Random(lane)
        n = 0
        while not self._stop.is_set():
            n += 1
            remote = rng.random() < 2 / 3
            if remote:
                call = client.stream(
                    prompt=f"{passage(2, offset=lane + n)}\n\n{QUESTIONS[n % len(QUESTIONS)]}",
                    sampling=SAMPLING,
                    cache_salt=f"chaos-{uuid.uuid4().hex}",
                    timeout_s=REQUEST_TIMEOUT_S,
                )
            else:
                call = client.stream(
                    raw_prompt=f"Item {lane}.{n}: the river",
                    sampling=SAMPLING,
                    timeout_s=REQUEST_TIMEOUT_S,
                )
            outcome = Outcome(remote, time.monotonic())
            try:
                async for message in call:  # type: ignore[attr-defined]
                    if message.token_ids and outcome.ttft_s is None:
                        outcome.ttft_s = time.monotonic() - outcome.started
                    outcome.num_tokens += len(message.token_ids)
            except grpc.aio.AioRpcError as exc:
                outcome.code = exc.code()
                outcome.details = exc.details() or ""
            outcome.total_s = time.monotonic() - outcome.started
            self.outcomes.append(outcome)

    async def run(self) -> None:
        client = GatewayClient(self.target)
        try:
            await asyncio.gather(*(self.lane(client, i) for i in range(LANES)))
        finally:
            await client.close()

    def stop(self) -> None:
        self._stop.set()

    async def warm(self, at_least_s: float) -> None:
        """Waits ``at_least_s``, and until every lane completed a request (a busy machine
        can be slow to answer the first ones)."""
        await asyncio.sleep(at_least_s)

        async def every_lane_answered() -> bool:
            return len(self.outcomes) >= LANES

        await until_async("every lane completed a request", every_lane_answered,
                          REQUEST_TIMEOUT_S, every_s=0.1)  # fmt: skip
        assert not self.failures(), self.failures()

    def failures(self) -> list[str]:
        return [
            f"{'remote' if o.remote else 'local'} request: {o.code.name}: {o.details}"
            for o in self.outcomes
            if o.code is not None
        ] + [
            f"{'remote' if o.remote else 'local'} request: {o.num_tokens} of {MAX_TOKENS} tokens"
            for o in self.outcomes
            if o.code is None and o.num_tokens != MAX_TOKENS
        ]

    def started_after(self, moment: float) -> list[Outcome]:
        return [o for o in self.outcomes if o.started >= moment]


async def under_load(
    stack: ChaosStack, fault: Callable[[], object], after_s: float, window_s: float
) -> tuple[Load, float]:
    """Steady load; ``fault`` after ``after_s``; the load goes on ``window_s`` more, and on
    until every lane has started a request since the fault (bounded by the request
    timeout), then stops and every stream in flight finishes. Returns the load and when the
    fault hit.

    Why "and on": when every lane's stream sat on the hung decode worker, all of them wait
    out the stall limit and then re-prefill on the other worker at once; on 2 loaded cores
    that can outlast a fixed window, and the test would count slowness as loss."""
    load = Load(stack.target)
    runner = asyncio.create_task(load.run())
    await load.warm(after_s)
    fault()
    hit = time.monotonic()
    await asyncio.sleep(window_s)

    async def lanes_started() -> int:
        return len(load.started_after(hit))

    await settle_async(lanes_started, lambda n: n >= LANES, REQUEST_TIMEOUT_S, every_s=0.1)
    load.stop()
    await asyncio.wait_for(runner, REQUEST_TIMEOUT_S + 30)
    return load, hit


# -- checks after each fault ---------------------------------------------------------------------


def gateway_counter(stack: ChaosStack, name: str, **labels: str) -> float:
    return stack.metrics("gateway").sum(name, **labels)


def serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=3.0
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def assert_settled(stack: ChaosStack, dead: set[str]) -> None:
    """Every live process SERVING; every live worker in the registry (so routed to) and
    none of the dead ones; every live worker's KV pool entirely free and no lease left."""
    live = [c for c in stack.state().children if c.name not in dead and c.role != "redis"]
    for child in live:
        until(f"{child.name} SERVING", lambda child=child: serving(child.address))
    # Registry entries name their process by address (a block store's id is not its name).
    wanted = {c.address for c in live if c.role in ("prefill", "decode", "blockstore")}
    gone = {c.address for c in stack.state().children if c.name in dead}

    def registry_right() -> bool:
        listed = {w["address"] for w in stack.workers()}
        return wanted <= listed and not (listed & gone)

    until(f"the registry lists every live worker and none of {sorted(dead)}", registry_right)

    def nothing_held() -> bool:
        workers = [w for w in stack.workers() if w["role"] in ("prefill", "decode")]
        if any(w["kv_blocks_free"] != w["kv_blocks_total"] for w in workers):
            return False
        return all(
            stack.metrics(c.name).sum("pdserve:kv_leases_active") == 0
            for c in live
            if c.role in ("prefill", "decode")
        )

    until("every KV pool free and no lease held", nothing_held, timeout_s=25.0)


def request_count(stack: ChaosStack, name: str) -> float:
    return stack.metrics(name).sum("pdserve:request_success_total")


async def one(target: str, **kwargs: object) -> tuple[list[int], int]:
    """One stream to its end: (tokens, cached prompt tokens)."""
    client = GatewayClient(target)
    tokens: list[int] = []
    cached = 0
    try:
        async for message in client.stream(sampling=SAMPLING, timeout_s=60, **kwargs):  # type: ignore[arg-type]
            tokens += list(message.token_ids)
            if message.HasField("usage"):
                cached = message.usage.cached_tokens
    finally:
        await client.close()
    return tokens, cached


def wait_out_of_registry(stack: ChaosStack, name: str) -> None:
    """A hung worker's entry expires: it leaves the routing set."""
    stopped = stack.child(name).address
    until(
        f"{name} out of the registry",
        lambda: stopped not in {w["address"] for w in stack.workers()},
        timeout_s=REGISTRY_TTL_S + 5,
    )


def wait_rejoined(stack: ChaosStack, name: str) -> None:
    """Requests until ``name`` serves one (after its breaker's probe), then settled."""
    served = request_count(stack, name)

    def rejoined() -> bool:
        asyncio.run(one(stack.target, prompt=passage(2), cache_salt=f"rejoin-{uuid.uuid4().hex}"))
        return request_count(stack, name) > served

    until(f"{name} serving requests again", rejoined, timeout_s=40)
    assert_settled(stack, dead=set())


# -- the scenarios, in order ---------------------------------------------------------------------


def test_a_hung_prefill_worker_loses_no_request(chaos: ChaosStack) -> None:
    assert_settled(chaos, dead=set())
    failovers = gateway_counter(chaos, "pdserve:prefill_failovers_total")
    load, hit = asyncio.run(
        under_load(chaos, lambda: chaos.kill("prefill-1", signal.SIGSTOP), 3.0, REGISTRY_TTL_S + 3)
    )
    assert load.failures() == []
    after = load.started_after(hit)
    assert len(after) >= LANES, f"only {len(after)} requests started after the SIGSTOP"
    # Requests sent to the hung worker moved on: one per-hop timeout, then the normal path.
    assert gateway_counter(chaos, "pdserve:prefill_failovers_total") > failovers
    slowest = max(o.ttft_s or o.total_s for o in load.outcomes)
    assert slowest < PREFILL_TIMEOUT_S + 20, f"a request waited {slowest:.1f} s for its first token"
    # It left the routing set: its entry expired.
    wait_out_of_registry(chaos, "prefill-1")

    chaos.kill("prefill-1", signal.SIGCONT)
    assert_settled(chaos, dead=set())
    # Back in the routing set, and after its breaker's probe it gets traffic again.
    wait_rejoined(chaos, "prefill-1")


def test_a_hung_decode_worker_loses_no_request(chaos: ChaosStack) -> None:
    assert_settled(chaos, dead=set())
    stalled = gateway_counter(chaos, "pdserve:request_migrations_total", reason="stalled")
    load, hit = asyncio.run(
        under_load(chaos, lambda: chaos.kill("decode-1", signal.SIGSTOP), 3.0, REGISTRY_TTL_S + 3)
    )
    assert load.failures() == []
    assert len(load.started_after(hit)) >= LANES
    # The streams on it (and those routed to it before its entry expired) went silent and
    # moved on: no request waited much beyond the stall limit for a token.
    migrated = gateway_counter(chaos, "pdserve:request_migrations_total", reason="stalled")
    assert migrated > stalled, "no stream on the hung decode worker migrated"
    longest = max(o.total_s for o in load.outcomes)
    bound = DECODE_STALL_TIMEOUT_S + PREFILL_TIMEOUT_S + 30
    assert longest < bound, f"a request took {longest:.1f} s"
    wait_out_of_registry(chaos, "decode-1")

    chaos.kill("decode-1", signal.SIGCONT)
    # Woken, it finds its streams cancelled and frees their blocks; it serves again.
    assert_settled(chaos, dead=set())
    wait_rejoined(chaos, "decode-1")


def test_redis_killed_and_restarted_loses_no_request_and_the_index_rebuilds(
    chaos: ChaosStack,
) -> None:
    # A prompt cached before the outage (as raw tokens, under its own salt: its block hashes
    # are known here): 64 tokens, 4 full blocks.
    marker = [100 + (i * 37) % 5000 for i in range(64)]
    salt = f"marker-{uuid.uuid4().hex}"
    tokens, _ = asyncio.run(one(chaos.target, token_ids=marker, cache_salt=salt))
    assert len(tokens) == MAX_TOKENS
    # The workers' weight format is part of every block's key (one format on this stack).
    (weights,) = {w["weights"] for w in chaos.workers() if w["role"] in ("prefill", "decode")}
    hashes = [
        int(h) for h in hash_prompt_blocks(marker, 16, salt, seed="", weights=weights or None)
    ]
    state = chaos.state()
    model = chaos.model_dir.name

    async def holders() -> set[str]:
        client = redis_client.connect(state.redis_url)
        try:
            found = await PrefixIndex(client, model).lookup(hashes)
        finally:
            await client.aclose()
        return set.intersection(*(set(f) for f in found)) if len(found) == 4 else set()

    workers_holding = asyncio.run(holders()) - {"store"}
    assert workers_holding, "the marker's blocks were never published"

    seen_down: list[dict[str, object]] = []

    async def scenario() -> Load:
        load = Load(chaos.target)
        runner = asyncio.create_task(load.run())
        await load.warm(3.0)
        chaos.kill("redis", signal.SIGKILL)
        await asyncio.sleep(4.0)  # requests keep flowing, routed by load
        samples = await asyncio.to_thread(chaos.metrics, "gateway")
        seen_down.append({"index_available": samples.sum("pdserve:index_available")})
        seen_down.append(await asyncio.to_thread(lambda: chaos.workers()[0]))
        status = await asyncio.to_thread(chaos.cli, "status", "--target", chaos.target)
        seen_down.append({"status": status.stdout + status.stderr})
        await asyncio.to_thread(chaos.restart_redis)
        await asyncio.sleep(3.0)  # and on, while the index is rebuilt
        load.stop()
        await asyncio.wait_for(runner, REQUEST_TIMEOUT_S + 30)
        return load

    load = asyncio.run(scenario())
    assert load.failures() == []
    assert len(load.outcomes) >= 2 * LANES
    # While Redis was down the gateway said so: the metric, the status RPC and the CLI.
    assert seen_down[0]["index_available"] == 0
    gateway_entry = seen_down[1]
    assert gateway_entry["role"] == "gateway" and gateway_entry["index_available"] is False
    assert "routing index (Redis): UNAVAILABLE" in str(seen_down[2]["status"])

    until(
        "the gateway uses the index again",
        lambda: gateway_counter(chaos, "pdserve:index_available") == 1,
    )
    assert_settled(chaos, dead=set())
    # Rebuilt by the workers themselves: who held the marker's blocks is known again.
    until(
        "the marker's holders back in the index",
        lambda: workers_holding <= asyncio.run(holders()),
    )
    # And routing uses it: the marker goes where it is cached.
    by_index = ("prefix_overlap", "local_prefill_cached")
    before = sum(
        gateway_counter(chaos, "pdserve:routing_decisions_total", reason=r) for r in by_index
    )
    tokens_again, cached = asyncio.run(one(chaos.target, token_ids=marker, cache_salt=salt))
    assert len(tokens_again) == MAX_TOKENS
    after = sum(
        gateway_counter(chaos, "pdserve:routing_decisions_total", reason=r) for r in by_index
    )
    assert after == before + 1
    assert cached >= 48
    workers = chaos.workers()
    assert [w.get("index_available") for w in workers if w["role"] == "gateway"] == [True]


def test_a_killed_prefill_worker_loses_no_request(chaos: ChaosStack) -> None:
    failovers = gateway_counter(chaos, "pdserve:prefill_failovers_total")
    load, hit = asyncio.run(
        under_load(chaos, lambda: chaos.kill("prefill-0", signal.SIGKILL), 3.0, REGISTRY_TTL_S + 2)
    )
    assert load.failures() == []
    assert len(load.started_after(hit)) >= LANES
    assert gateway_counter(chaos, "pdserve:prefill_failovers_total") > failovers
    assert_settled(chaos, dead={"prefill-0"})


def test_a_killed_block_store_loses_no_request(chaos: ChaosStack) -> None:
    load, hit = asyncio.run(
        under_load(chaos, lambda: chaos.kill("blockstore", signal.SIGKILL), 3.0, 6.0)
    )
    assert load.failures() == []
    assert len(load.started_after(hit)) >= LANES
    # The prefill worker left writes the store through on every request: it noticed.
    assert chaos.metrics("prefill-1").sum("pdserve:block_store_up") == 0
    assert_settled(chaos, dead={"prefill-0", "blockstore"})
