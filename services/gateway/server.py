"""Entry point of the gateway."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from common.index import redis_client
from common.index.prefix_index import PrefixIndex
from common.index.registry import WorkerInfo, WorkerRegistry
from common.models.spec import load_spec
from common.rpc.interceptors import RpcMetrics, TelemetryInterceptor
from common.rpc.server import Server, create_server, serve_until_signal
from common.telemetry.metrics import process_registry, start_metrics_server
from common.telemetry.tracing import setup_tracing
from common.text.tokenizer import Tokenizer
from pdserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from services.gateway.auth import AuthInterceptor
from services.gateway.config import GatewayConfig
from services.gateway.directory import WorkerDirectory
from services.gateway.health import IndexHealth
from services.gateway.metrics import GatewayMetrics
from services.gateway.servicer import GatewayServicer

log = logging.getLogger(__name__)
HEARTBEAT_S = 1.0


async def start_gateway(
    config: GatewayConfig, metrics_registry: CollectorRegistry | None = None
) -> tuple[Server, GatewayServicer, Any]:
    """Binds and serves; metrics go to ``metrics_registry`` (default: a registry of its own,
    ``servicer.metrics.registry``)."""
    tokenizer = await asyncio.to_thread(Tokenizer, config.model)
    spec = await asyncio.to_thread(load_spec, config.model)
    client = redis_client.connect(config.redis_url)  # a password or rediss:// in the URL
    registry = WorkerRegistry(client)
    metrics_registry = metrics_registry or CollectorRegistry()
    metrics = GatewayMetrics(metrics_registry, config.served_model_name)
    directory = WorkerDirectory(registry, config.registry_refresh_s, IndexHealth(metrics))
    index = PrefixIndex(client, config.served_model_name)
    holder: list[GatewayServicer] = []

    def register(server: grpc.aio.Server) -> None:
        servicer = GatewayServicer(config, tokenizer, spec, directory, index, "", "", metrics)
        gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, server)
        holder.append(servicer)

    names = [gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name]
    interceptors: list[grpc.aio.ServerInterceptor] = [
        TelemetryInterceptor(RpcMetrics(metrics_registry))
    ]
    if config.api_keys is not None:
        interceptors.append(AuthInterceptor(config.api_keys, metrics.auth_rejected))
    server = await create_server(
        f"{config.host}:{config.port}",
        register,
        names,
        interceptors=interceptors,
        serving=False,
        credentials=config.public_tls.server_credentials() if config.public_tls else None,
        options=[("grpc.max_receive_message_length", config.max_request_bytes)],
        # A backstop behind admission (which answers with RetryInfo): grpc itself refuses
        # calls past this many, before they take any memory of ours.
        maximum_concurrent_rpcs=2 * config.max_in_flight + 64,
    )
    servicer = holder[0]
    servicer.address = f"{config.host}:{server.port}"
    servicer.gateway_id = (
        config.worker_id or f"gateway-{socket.gethostname()}-{server.port}-{os.getpid()}"
    )
    heartbeat = asyncio.create_task(_heartbeat(registry, servicer))
    await server.set_serving(True)
    return server, servicer, (client, heartbeat, registry)


async def _heartbeat(registry: WorkerRegistry, servicer: GatewayServicer) -> None:
    while True:
        try:
            await registry.heartbeat(
                WorkerInfo(
                    worker_id=servicer.gateway_id,
                    role="gateway",
                    address=servicer.address,
                    model=servicer.model,
                    num_running=servicer.num_in_flight,
                    pid=os.getpid(),
                )
            )
            servicer.health.ok()
        except Exception as exc:
            log.debug("gateway heartbeat failed: %s", exc)
            servicer.health.failed("heartbeat", exc)
        await asyncio.sleep(HEARTBEAT_S)


async def stop_gateway(servicer: GatewayServicer, resources: Any) -> None:
    client, heartbeat, registry = resources
    heartbeat.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await heartbeat
    with contextlib.suppress(Exception):
        await registry.deregister(servicer.gateway_id)
    await servicer.close()
    await client.aclose()


async def serve(config: GatewayConfig) -> None:
    """The gateway process: tracing from OTEL_*, metrics at --metrics-port, until SIGTERM."""
    tracing = setup_tracing("gateway", config.worker_id)
    metrics_registry = process_registry()
    metrics_server = None
    try:
        if config.metrics_port:
            metrics_server = start_metrics_server(
                config.host, config.metrics_port, metrics_registry
            )
        server, servicer, resources = await start_gateway(config, metrics_registry)
        print(f"gateway {servicer.gateway_id} serving at {servicer.address}", flush=True)
        await serve_until_signal(
            server, config.drain_grace_s, on_stop=lambda: stop_gateway(servicer, resources)
        )
    finally:
        if metrics_server is not None:
            metrics_server.stop()
        tracing.shutdown()
