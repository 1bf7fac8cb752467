"""Runs a prefill or decode worker process: engine, runtime, gRPC server, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from common.engine.engine import Engine
from common.kv.transfer import KvTransferServicer
from common.rpc.server import Server, create_server, serve_until_signal
from common.worker.config import WorkerConfig
from common.worker.runtime import WorkerRuntime
from pdserve.kv.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

log = logging.getLogger(__name__)

AddServicers = Callable[[grpc.aio.Server, WorkerRuntime], list[str]]


async def start_worker(
    config: WorkerConfig, add_servicers: AddServicers
) -> tuple[Server, WorkerRuntime]:
    """Loads the engine, binds, starts the runtime, then reports SERVING."""
    engine = await asyncio.to_thread(Engine, config.engine)
    runtime = WorkerRuntime(config, engine)

    def register(server: grpc.aio.Server) -> None:
        kv_transfer_pb2_grpc.add_KvTransferServiceServicer_to_server(
            KvTransferServicer(runtime.leases, runtime.layout), server
        )
        names.extend(add_servicers(server, runtime))

    names = [kv_transfer_pb2.DESCRIPTOR.services_by_name["KvTransferService"].full_name]
    server = await create_server(f"{config.host}:{config.port}", register, names, serving=False)
    await runtime.start(server.port)
    await server.set_serving(True)
    return server, runtime


async def serve_worker(config: WorkerConfig, add_servicers: AddServicers) -> None:
    server, runtime = await start_worker(config, add_servicers)
    print(f"{config.role} worker {runtime.worker_id} serving at {runtime.address}", flush=True)
    await serve_until_signal(server, config.drain_grace_s, on_stop=runtime.stop)
