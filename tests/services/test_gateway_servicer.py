"""The gateway when workers fail, against scripted fake workers (real gRPC, in process):

- a prefill worker that is unreachable, resets or hangs past --prefill-timeout-s: the prompt
  moves to another prefill worker, else to the decode worker (local prefill); a hung one's
  lease is released once it answers;
- a decode worker that hangs mid-stream (its connection open, nothing sent) past
  --decode-stall-timeout-s: the request migrates to another decode worker, no token lost;
- a worker failing repeatedly: its circuit breaker opens (no calls for the cool-down), one
  probe after it, closed again by the probe's success; the metrics and GetClusterStatus say so;
- Redis (index and registry) down: requests keep flowing, routed by load on the last known
  workers; ``pdserve:index_available`` and GetClusterStatus say so, and both recover.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from common.contract.model_spec import load_spec
from common.errors import RoleChangedError
from common.index.registry import WorkerInfo
from common.rpc.errors import abort
from common.rpc.server import Server, create_server
from common.text.tokenizer import Tokenizer
from pdserve.common.v1 import common_pb2
from pdserve.decode.v1 import decode_pb2, decode_pb2_grpc
from pdserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from pdserve.kv.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from pdserve.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from services.gateway.config import GatewayConfig
from services.gateway.directory import WorkerDirectory
from services.gateway.health import IndexHealth
from services.gateway.metrics import GatewayMetrics
from services.gateway.servicer import GatewayServicer
from tests.fake_clock import FakeClock

PROMPT = list(range(1000, 1048))  # 48 tokens: over local_prefill_tokens, prefilled remotely
FIRST_TOKEN = 42
DECODED = [43, 44, 45]


@dataclass
class FakePrefill(
    prefill_pb2_grpc.PrefillServiceServicer, kv_transfer_pb2_grpc.KvTransferServiceServicer
):
    """mode: ok | unavailable | hang | invalid | slow (answers after 0.5 s) | role_changed
    (refuses: it left the prefill role)."""

    worker_id: str
    mode: str = "ok"
    address: str = ""
    calls: int = 0
    released: list[str] = field(default_factory=list)

    async def Prefill(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.calls += 1
        if self.mode == "unavailable":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset (scripted)")
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode == "invalid":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids: scripted")
        if self.mode == "slow":
            await asyncio.sleep(0.5)
        if self.mode == "role_changed":
            await abort(context, RoleChangedError(f"worker {self.worker_id} serves decode"))
        return prefill_pb2.PrefillResponse(
            first_token_id=FIRST_TOKEN,
            computed_tokens=len(request.prompt_token_ids),
            kv_handle=common_pb2.KvHandle(
                request_id=request.request_id,
                num_tokens=len(request.prompt_token_ids),
                producer_address=self.address,
                lease_id=request.lease_id,
            ),
        )

    async def ReleaseLease(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.released.append(request.lease_id)
        return kv_transfer_pb2.ReleaseLeaseResponse(released=False)


@dataclass
class FakeDecode(decode_pb2_grpc.DecodeServiceServicer):
    """mode: ok | hang (sends one token, then nothing, the connection open) | hang-first
    (sends nothing)."""

    worker_id: str
    mode: str = "ok"
    requests: list[Any] = field(default_factory=list)

    async def Decode(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        self.requests.append(request)
        # The tokens after those the request already carries (a prefill's first token, or
        # every token sent before a migration).
        tokens = [FIRST_TOKEN, *DECODED][len(request.generated_token_ids) :]
        for i, token in enumerate(tokens):
            if (self.mode, i) in (("hang", 1), ("hang-first", 0)):
                await asyncio.sleep(3600)
            last = i == len(tokens) - 1
            yield decode_pb2.DecodeResponse(
                token_ids=[token],
                finish_reason=common_pb2.FINISH_REASON_LENGTH if last else 0,
            )


class FakeRegistry:
    def __init__(self, workers: list[WorkerInfo]) -> None:
        self.workers = workers
        self.down = False

    async def list(self, role: str | None = None) -> list[WorkerInfo]:
        if self.down:
            raise ConnectionError("Connection refused (scripted)")
        return list(self.workers)


class FakeIndex:
    def __init__(self) -> None:
        self.down = False
        self.lookups = 0

    async def lookup(self, block_hashes: list[int]) -> list[dict[str, str]]:
        self.lookups += 1
        if self.down:
            raise ConnectionError("Connection refused (scripted)")
        return []


@dataclass
class Cluster:
    gateway: GatewayServicer
    stub: gateway_pb2_grpc.GatewayServiceStub
    prefills: dict[str, FakePrefill]
    decode: FakeDecode  # the first of decodes
    decodes: dict[str, FakeDecode]
    registry: FakeRegistry
    index: FakeIndex
    clock: FakeClock  # the breakers' and the index health's

    def prefer(self, worker_id: str) -> None:
        """The index says ``worker_id`` holds the prompt: routing sends prefills there."""
        self.gateway.router.overlap_weight = 100.0
        original = self.index.lookup

        async def lookup(block_hashes: list[int]) -> list[dict[str, str]]:
            await original(block_hashes)
            return [{worker_id: "cpu"}]

        self.index.lookup = lookup  # type: ignore[method-assign]

    def metric(self, name: str, **labels: str) -> float:
        return self.gateway.metrics.registry.get_sample_value(name, labels) or 0.0

    async def generate(self, timeout_s: float = 20.0) -> list[int]:
        request = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=PROMPT))
        request.sampling.max_tokens = 4
        request.sampling.ignore_eos = True
        tokens: list[int] = []
        async for message in self.stub.Generate(request, timeout=timeout_s):
            tokens += list(message.token_ids)
        return tokens


async def _serve(register: Callable[[grpc.aio.Server], None]) -> Server:
    return await create_server("127.0.0.1:0", register, [])


def run_cluster(
    smollm_dir: Path,
    prefill_modes: dict[str, str],
    body: Callable[[Cluster], Awaitable[None]],
    index_retry_s: float = 1.0,
    decode_workers: tuple[WorkerInfo, ...] = (WorkerInfo("d0", "decode", ""),),
    decode_modes: dict[str, str] | None = None,
    **config: Any,
) -> None:
    async def main() -> None:
        servers: list[Server] = []
        prefills: dict[str, FakePrefill] = {}
        workers: list[WorkerInfo] = []
        for worker_id, mode in prefill_modes.items():
            fake = FakePrefill(worker_id, mode)

            def register(server: grpc.aio.Server, fake: FakePrefill = fake) -> None:
                prefill_pb2_grpc.add_PrefillServiceServicer_to_server(fake, server)
                kv_transfer_pb2_grpc.add_KvTransferServiceServicer_to_server(fake, server)

            server = await _serve(register)
            servers.append(server)
            fake.address = f"127.0.0.1:{server.port}"
            prefills[worker_id] = fake
            workers.append(WorkerInfo(worker_id, "prefill", fake.address, smollm_dir.name))
        decodes: dict[str, FakeDecode] = {}
        for info in decode_workers:
            fake_decode = FakeDecode(info.worker_id, (decode_modes or {}).get(info.worker_id, "ok"))
            server = await _serve(
                lambda s, fake_decode=fake_decode: (
                    decode_pb2_grpc.add_DecodeServiceServicer_to_server(fake_decode, s)
                )
            )
            servers.append(server)
            decodes[info.worker_id] = fake_decode
            info.address, info.model = f"127.0.0.1:{server.port}", smollm_dir.name
            workers.append(info)

        gateway_config = GatewayConfig(model=str(smollm_dir), redis_url="redis://unused", **config)
        metrics = GatewayMetrics(CollectorRegistry(), gateway_config.served_model_name)
        registry = FakeRegistry(workers)
        index = FakeIndex()
        clock = FakeClock()
        health = IndexHealth(metrics, retry_s=index_retry_s, clock=clock)
        directory = WorkerDirectory(registry, 0.0, health)  # type: ignore[arg-type]
        gateway = GatewayServicer(
            gateway_config,
            Tokenizer(str(smollm_dir)),
            load_spec(str(smollm_dir)),
            directory,
            index,  # type: ignore[arg-type]
            "gateway-test",
            "",
            metrics,
            clock=clock,
        )
        server = await _serve(
            lambda s: gateway_pb2_grpc.add_GatewayServiceServicer_to_server(gateway, s)
        )
        servers.append(server)
        gateway.address = f"127.0.0.1:{server.port}"
        channel = grpc.aio.insecure_channel(gateway.address)
        try:
            cluster = Cluster(
                gateway,
                gateway_pb2_grpc.GatewayServiceStub(channel),
                prefills,
                next(iter(decodes.values())),
                decodes,
                registry,
                index,
                clock,
            )
            await asyncio.wait_for(body(cluster), timeout=60)
        finally:
            await channel.close()
            for server in servers:
                await server.stop(0)
            await gateway.close()

    asyncio.run(main())


def test_an_unreachable_prefill_worker_is_retried_on_another(smollm_dir: Path) -> None:
    async def body(cluster: Cluster) -> None:
        cluster.prefer("p-bad")
        for _ in range(6):
            assert await cluster.generate() == [FIRST_TOKEN, *DECODED]
        bad, good = cluster.prefills["p-bad"], cluster.prefills["p-good"]
        assert good.calls == 6 and bad.calls == 3  # then its breaker opened
        # Every decode got a handle from the good worker.
        assert all(r.kv_handle.producer_address == good.address for r in cluster.decode.requests)
        assert cluster.metric("pdserve:prefill_failovers_total", to="prefill") == bad.calls

    run_cluster(smollm_dir, {"p-bad": "unavailable", "p-good": "ok"}, body)


def test_with_every_prefill_worker_failing_the_decode_worker_prefills(smollm_dir: Path) -> None:
    async def body(cluster: Cluster) -> None:
        assert await cluster.generate() == [FIRST_TOKEN, *DECODED]
        (request,) = cluster.decode.requests
        assert request.local_prefill and not request.HasField("kv_handle")
        assert cluster.prefills["p0"].calls == 1 and cluster.prefills["p1"].calls == 1
        assert cluster.metric("pdserve:prefill_failovers_total", to="prefill") == 1
        assert cluster.metric("pdserve:prefill_failovers_total", to="decode") == 1

    run_cluster(smollm_dir, {"p0": "unavailable", "p1": "unavailable"}, body)


def test_a_hung_prefill_worker_times_out_and_its_lease_is_released(smollm_dir: Path) -> None:
    async def body(cluster: Cluster) -> None:
        hung, good = cluster.prefills["p-hung"], cluster.prefills["p-good"]
        cluster.prefer("p-hung")
        loop = asyncio.get_running_loop()
        start = loop.time()
        assert await cluster.generate() == [FIRST_TOKEN, *DECODED]
        assert 0.5 <= loop.time() - start < 5  # the per-hop timeout, then the good worker
        assert hung.calls == 1 and good.calls == 1
        # The hung worker still answers releases: the lease id it was given is released.
        for _ in range(50):
            if hung.released:
                break
            await asyncio.sleep(0.05)
        assert len(hung.released) == hung.calls
        assert cluster.metric("pdserve:prefill_failovers_total", to="prefill") == hung.calls

    run_cluster(smollm_dir, {"p-hung": "hang", "p-good": "ok"}, body, prefill_timeout_s=0.5)


def test_the_breaker_stops_calls_to_a_failing_worker_then_probes_it(smollm_dir: Path) -> None:
    async def body(cluster: Cluster) -> None:
        bad, good = cluster.prefills["p-bad"], cluster.prefills["p-good"]
        cluster.prefer("p-bad")  # routing would send it every request
        for _ in range(8):
            assert await cluster.generate() == [FIRST_TOKEN, *DECODED]
        assert bad.calls == 2  # then the breaker opened: no more calls during the cool-down
        assert cluster.metric("pdserve:circuit_breaker_open", worker_id="p-bad") == 1
        assert cluster.metric("pdserve:circuit_breaker_trips_total", worker_id="p-bad") == 1
        status = await cluster.stub.GetClusterStatus(gateway_pb2.GetClusterStatusRequest())
        assert [(c.worker_id, c.state) for c in status.circuits] == [
            ("p-bad", gateway_pb2.CIRCUIT_STATE_OPEN)
        ]
        bad.mode = "ok"  # it recovers; after the cool-down one probe closes the breaker
        cluster.clock.advance(1.1)
        assert await cluster.generate() == [FIRST_TOKEN, *DECODED]
        assert bad.calls == 3
        assert cluster.metric("pdserve:circuit_breaker_open", worker_id="p-bad") == 0
        for _ in range(3):
            await cluster.generate()
        assert bad.calls == 6 and good.calls == 8
        status = await cluster.stub.GetClusterStatus(gateway_pb2.GetClusterStatusRequest())
        assert list(status.circuits) == []

    run_cluster(
        smollm_dir,
        {"p-bad": "unavailable", "p-good": "ok"},
        body,
        breaker_failure_threshold=2,
        breaker_cooldown_s=1.0,
    )


def test_redis_down_routes_by_load_and_says_so_then_recovers(smollm_dir: Path) -> None:
    async def body(cluster: Cluster) -> None:
        assert await cluster.generate() == [FIRST_TOKEN, *DECODED]
        assert cluster.metric("pdserve:index_available") == 1
        cluster.registry.down = cluster.index.down = True
        await asyncio.sleep(0.01)
        for _ in range(4):
            assert await cluster.generate() == [FIRST_TOKEN, *DECODED]
        assert cluster.metric("pdserve:index_available") == 0
        assert cluster.metric("pdserve:routing_without_index_total") >= 4
        assert cluster.index.lookups == 1  # Redis failed: not asked again within a second
        status = await cluster.stub.GetClusterStatus(gateway_pb2.GetClusterStatusRequest())
        assert not status.routing_index.available
        assert "Connection refused" in status.routing_index.error
        assert status.routing_index.unavailable_since_unix_ms > 0
        assert {w.worker_id for w in status.workers} >= {"p0", "d0"}  # the last known list

        cluster.registry.down = cluster.index.down = False
        cluster.clock.advance(1.05)
        assert await cluster.generate() == [FIRST_TOKEN, *DECODED]
        assert cluster.metric("pdserve:index_available") == 1
        status = await cluster.stub.GetClusterStatus(gateway_pb2.GetClusterStatusRequest())
        assert status.routing_index.available and status.routing_index.error == ""

    run_cluster(smollm_dir, {"p0": "ok"}, body)


def test_an_answer_about_the_request_is_not_a_failover(smollm_dir: Path) -> None:
    async def body(cluster: Cluster) -> None:
        cluster.prefer("p0")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await cluster.generate()
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert cluster.prefills["p0"].calls == 1 and cluster.prefills["p1"].calls == 0
        assert cluster.gateway.breakers.not_closed() == {}
        assert cluster.prefills["p0"].released == []  # it answered: nothing to release

    run_cluster(smollm_dir, {"p0": "invalid", "p1": "ok"}, body)


def test_a_hung_decode_worker_breaks_its_stream_and_the_request_migrates(
    smollm_dir: Path,
) -> None:
    """A decode worker that stops sending mid-stream (a SIGSTOPped process keeps its
    connection open) is given --decode-stall-timeout-s; then the request continues on the
    other decode worker with every token sent so far, and the client sees one stream."""

    async def body(cluster: Cluster) -> None:
        hung, good = cluster.decodes["d-hung"], cluster.decodes["d-ok"]
        loop = asyncio.get_running_loop()
        start = loop.time()
        assert await cluster.generate() == [FIRST_TOKEN, *DECODED]
        assert 0.5 <= loop.time() - start < 5  # the stall timeout, then the other worker
        (first,) = hung.requests
        (continued,) = good.requests
        assert list(first.generated_token_ids) == [FIRST_TOKEN]  # the prefill's token
        assert continued.local_prefill
        assert list(continued.generated_token_ids) == [FIRST_TOKEN, DECODED[0]]
        assert cluster.metric("pdserve:request_migrations_total", reason="stalled") == 1
        assert cluster.metric("pdserve:request_migrations_total", reason="unavailable") == 0

    run_cluster(
        smollm_dir,
        {"p0": "ok"},
        body,
        # d-ok looks busier, so the first choice is d-hung.
        decode_workers=(
            WorkerInfo("d-hung", "decode", ""),
            WorkerInfo("d-ok", "decode", "", num_running=5),
        ),
        decode_modes={"d-hung": "hang"},
        decode_stall_timeout_s=0.5,
        prefill_timeout_s=1.0,
    )


def test_a_slow_first_token_gets_the_prefill_timeout_on_top_of_the_stall_timeout(
    smollm_dir: Path,
) -> None:
    """The first message may come --prefill-timeout-s later than later ones (the decode
    worker may be prefilling): a worker that hangs before its first token breaks only
    after both."""

    async def body(cluster: Cluster) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        assert await cluster.generate() == [FIRST_TOKEN, *DECODED]
        assert 1.5 <= loop.time() - start < 6
        assert cluster.metric("pdserve:request_migrations_total", reason="stalled") == 1

    run_cluster(
        smollm_dir,
        {},  # no prefill worker: the decode worker prefills, and hangs before any token
        body,
        decode_workers=(
            WorkerInfo("d-hung", "decode", ""),
            WorkerInfo("d-ok", "decode", "", num_running=5),
        ),
        decode_modes={"d-hung": "hang-first"},
        decode_stall_timeout_s=0.5,
        prefill_timeout_s=1.0,
    )


def test_requests_prefilling_count_on_their_decode_worker(smollm_dir: Path) -> None:
    """Requests routed while others prefill spread over the decode workers: each counts on
    its decode worker from the moment it is routed, not only once its decode call starts."""

    async def body(cluster: Cluster) -> None:
        results = await asyncio.gather(*(cluster.generate() for _ in range(4)))
        assert results == [[FIRST_TOKEN, *DECODED]] * 4
        assert sorted(len(d.requests) for d in cluster.decodes.values()) == [2, 2]

    run_cluster(
        smollm_dir, {"p0": "slow"}, body,
        decode_workers=(WorkerInfo("d0", "decode", ""), WorkerInfo("d1", "decode", "")),
    )  # fmt: skip


def test_a_prefill_worker_that_left_its_role_is_no_failure(smollm_dir: Path) -> None:
    async def body(cluster: Cluster) -> None:
        cluster.prefer("p-moved")
        for _ in range(4):
            assert await cluster.generate() == [FIRST_TOKEN, *DECODED]
        moved, good = cluster.prefills["p-moved"], cluster.prefills["p-good"]
        assert good.calls == 4 and moved.calls >= 1
        # It answered: no breaker opened, no failure counted against it.
        assert cluster.metric("pdserve:circuit_breaker_trips_total", worker_id="p-moved") == 0

    run_cluster(smollm_dir, {"p-moved": "role_changed", "p-good": "ok"}, body)
