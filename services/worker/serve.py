"""Runs an engine worker process: engine, runtime, gRPC server, drain on SIGTERM.

The drain: health NOT_SERVING and the registry entry marked draining (routers skip the
worker), new Prefill / Decode calls refused with UNAVAILABLE; the calls in flight and the
leases on exported KV get the grace period; then what is left ends with UNAVAILABLE
(reason DRAINING), which a gateway answers by resuming the request on another worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import grpc
from prometheus_client import CollectorRegistry

from common.engine.engine import Engine
from common.kv.transfer import KvTransferServicer
from common.rpc.interceptors import RpcMetrics, TelemetryInterceptor
from common.rpc.server import Server, Started, create_server, serve_process
from pdserve.kv.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from services.worker.config import WorkerConfig
from services.worker.runtime import WorkerRuntime

log = logging.getLogger(__name__)

AddServicers = Callable[[grpc.aio.Server, WorkerRuntime], list[str]]


async def start_worker(
    config: WorkerConfig,
    add_servicers: AddServicers,
    metrics_registry: CollectorRegistry | None = None,
) -> tuple[Server, WorkerRuntime]:
    """Loads the engine, binds, starts the runtime, then reports SERVING. Metrics go to
    ``metrics_registry`` (default: a registry of its own, ``runtime.metrics.registry``)."""
    engine = await asyncio.to_thread(Engine, config.engine)
    metrics_registry = metrics_registry or CollectorRegistry()
    runtime = WorkerRuntime(config, engine, metrics_registry)

    def register(server: grpc.aio.Server) -> None:
        kv_transfer_pb2_grpc.add_KvTransferServiceServicer_to_server(
            KvTransferServicer(runtime.leases, runtime.layout), server
        )
        names.extend(add_servicers(server, runtime))

    names = [kv_transfer_pb2.DESCRIPTOR.services_by_name["KvTransferService"].full_name]
    server = await create_server(
        f"{config.host}:{config.port}",
        register,
        names,
        interceptors=[TelemetryInterceptor(RpcMetrics(metrics_registry))],
        serving=False,
        credentials=config.tls.server_credentials() if config.tls else None,
    )
    await runtime.start(server.port)
    await server.set_serving(True)
    return server, runtime


_END_WAIT_S = 2.0  # for streams ended at the end of the grace period to send their status


async def drain_worker(runtime: WorkerRuntime, grace_s: float) -> None:
    await runtime.begin_drain()
    if await runtime.wait_idle(grace_s):
        log.info("drained: nothing left in flight")
        return
    log.info(
        "drain grace period over: ending %d calls (%d leases held); callers resume elsewhere",
        runtime.num_active_calls,
        len(runtime.leases),
    )
    # The blocks written behind so far go to the store first, so that the callers resuming
    # elsewhere find them (what the last steps fill is written after, racing the resumes).
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(runtime.store.flush(), _END_WAIT_S)
    runtime.end_streams()
    runtime.store.hurry()
    deadline = asyncio.get_running_loop().time() + _END_WAIT_S
    while runtime.num_active_calls and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)


async def serve_worker(config: WorkerConfig, add_servicers: AddServicers) -> None:
    """The worker process (common/rpc/server.py's serve_process), until SIGTERM."""

    async def started(registry: CollectorRegistry) -> Started:
        server, runtime = await start_worker(config, add_servicers, registry)
        return Started(
            server,
            on_stop=runtime.stop,
            drain=lambda grace_s: drain_worker(runtime, grace_s),
            banner=f"worker {runtime.worker_id} serving at {runtime.address} (role {runtime.role})",
        )

    await serve_process(
        config.role, config.worker_id, config.host, config.metrics_port, config.drain_grace_s,
        started,
    )  # fmt: skip
