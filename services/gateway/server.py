"""Entry point of the gateway."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client import CollectorRegistry

from common.contract.model_spec import load_spec
from common.index import redis_client
from common.index.prefix_index import PrefixIndex
from common.index.registry import WorkerInfo, WorkerRegistry
from common.rpc.interceptors import RpcMetrics, TelemetryInterceptor
from common.rpc.server import Server, Started, create_server, serve_process
from common.text.tokenizer import Tokenizer
from pdserve.gateway.v1 import admin_pb2, admin_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from services.gateway.admin import AdminServicer
from services.gateway.auth import AuthInterceptor
from services.gateway.config import GatewayConfig
from services.gateway.directory import WorkerDirectory
from services.gateway.health import IndexHealth
from services.gateway.metrics import GatewayMetrics
from services.gateway.servicer import GatewayServicer

if TYPE_CHECKING:
    from services.gateway.kserve.servicer import KServeServicer
    from services.gateway.openai.server import OpenAIServer

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
        servicer = GatewayServicer(config, tokenizer, spec, directory, index, "", "", metrics,
                                   resume_redis=client)  # fmt: skip
        gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, server)
        admin_pb2_grpc.add_AdminServiceServicer_to_server(
            AdminServicer(servicer, config.admin_tenants), server
        )
        holder.append(servicer)

    names = [
        gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name,
        admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name,
    ]
    rpc_metrics = RpcMetrics(metrics_registry)  # one set of RPC metrics for both gRPC ports
    interceptors: list[grpc.aio.ServerInterceptor] = [TelemetryInterceptor(rpc_metrics)]
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
    http = None
    if config.http_port is not None:
        from services.gateway.openai.server import OpenAIServer

        http = OpenAIServer(servicer)
        tls = config.public_tls.ssl_context() if config.public_tls else None
        port = await http.start(config.host, config.http_port, tls)
        servicer.http_address = f"{'https' if tls else 'http'}://{config.host}:{port}/v1"
    kserve = None
    if config.kserve_port is not None:
        kserve = await start_kserve(config, servicer, rpc_metrics)
        scheme = "grpcs" if config.public_tls else "grpc"
        servicer.kserve_address = f"{scheme}://{config.host}:{kserve.server.port}"
    heartbeat = asyncio.create_task(_heartbeat(registry, servicer))
    await server.set_serving(True)
    return server, servicer, Resources(client, heartbeat, registry, http, kserve)


@dataclass
class KServe:
    server: Server
    servicer: KServeServicer


async def start_kserve(
    config: GatewayConfig, gateway: GatewayServicer, rpc_metrics: RpcMetrics
) -> KServe:
    """The KServe v2 / Triton port: its own gRPC server, the same keys, TLS and limits."""
    from pdserve.kserve.v2 import grpc_service_pb2_grpc
    from services.gateway.kserve.servicer import SERVICE, KServeServicer

    servicer = KServeServicer(gateway)
    interceptors: list[grpc.aio.ServerInterceptor] = [TelemetryInterceptor(rpc_metrics)]
    if config.api_keys is not None:
        open_methods = frozenset(f"/{SERVICE}/{m}" for m in ("ServerLive", "ServerReady"))
        interceptors.append(AuthInterceptor(
            config.api_keys, gateway.metrics.auth_rejected, f"/{SERVICE}/", open_methods
        ))  # fmt: skip
    server = await create_server(
        f"{config.host}:{config.kserve_port}",
        lambda s: grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, s),
        [SERVICE],
        interceptors=interceptors,
        credentials=config.public_tls.server_credentials() if config.public_tls else None,
        options=[("grpc.max_receive_message_length", config.max_request_bytes)],
        maximum_concurrent_rpcs=2 * config.max_in_flight + 64,
    )
    return KServe(server, servicer)


@dataclass
class Resources:
    """What the gateway holds besides its gRPC server, for ``stop_gateway``."""

    redis: Any
    heartbeat: asyncio.Task[None]
    registry: WorkerRegistry
    http: OpenAIServer | None
    kserve: KServe | None


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
                    metrics_port=servicer.config.metrics_port,
                )
            )
            servicer.health.ok()
        except Exception as exc:
            log.debug("gateway heartbeat failed: %s", exc)
            servicer.health.failed("heartbeat", exc)
        await asyncio.sleep(HEARTBEAT_S)


async def drain_gateway(server: Server, resources: Resources, grace_s: float) -> None:
    """Both front doors at once: gRPC refuses new calls and gives those in flight
    ``grace_s``; HTTP answers new requests 503 and waits as long for its own."""
    waits = [server.stop(grace_s)]
    if resources.http is not None:
        waits.append(resources.http.drain(grace_s))
    if resources.kserve is not None:
        resources.kserve.servicer.draining = True
        waits.append(resources.kserve.server.stop(grace_s))
    await asyncio.gather(*waits)


async def stop_gateway(servicer: GatewayServicer, resources: Resources) -> None:
    if resources.http is not None:
        await resources.http.stop()
    if resources.kserve is not None:
        await resources.kserve.server.stop(0)
    resources.heartbeat.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await resources.heartbeat
    with contextlib.suppress(Exception):
        await resources.registry.deregister(servicer.gateway_id)
    await servicer.close()
    await resources.redis.aclose()


def keep_torch_out() -> None:
    """Makes torch unimportable in this process (``sys.modules["torch"] = None``), called by
    the gateway's entry point before anything loads transformers. The gateway runs no model,
    but transformers, which its tokenizer comes from, imports torch whenever it can find it
    (about 250 MiB and 3 s at start); told there is none, it takes its torch-free path, and
    a stray torch import on any gateway path fails loudly instead of costing that again.
    Does nothing where torch is already loaded (an in-process gateway in a test)."""
    if "torch" in sys.modules:
        log.info("torch is already loaded in this process; the gateway keeps it")
        return
    sys.modules["torch"] = None  # type: ignore[assignment]


async def serve(config: GatewayConfig) -> None:
    """The gateway process (common/rpc/server.py's serve_process), until SIGTERM."""

    async def started(registry: CollectorRegistry) -> Started:
        server, servicer, resources = await start_gateway(config, registry)
        banner = f"gateway {servicer.gateway_id} serving at {servicer.address}"
        if servicer.http_address:
            banner += f"; OpenAI-compatible HTTP at {servicer.http_address}"
        if servicer.kserve_address:
            banner += f"; KServe v2 gRPC at {servicer.kserve_address}"
        return Started(
            server,
            on_stop=lambda: stop_gateway(servicer, resources),
            drain=lambda grace_s: drain_gateway(server, resources, grace_s),
            banner=banner,
        )

    await serve_process(
        "gateway", config.worker_id, config.host, config.metrics_port, config.drain_grace_s, started
    )
