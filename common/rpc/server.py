"""Server factory: every pdserve process serves health, reflection and its own services
the same way, binds explicitly, and drains on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from common.heap import freeze_startup_heap
from common.rpc.malformed import MalformedRequestInterceptor
from common.rpc.options import SERVER_OPTIONS
from common.telemetry.metrics import process_registry, start_metrics_server
from common.telemetry.tracing import setup_tracing

log = logging.getLogger(__name__)


class Server:
    """A started grpc.aio server with its health servicer."""

    def __init__(
        self,
        server: grpc.aio.Server,
        port: int,
        health_servicer: health.aio.HealthServicer,
        service_names: list[str],
    ) -> None:
        self.grpc = server
        self.port = port
        self.health = health_servicer
        self.service_names = service_names

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        """Health goes NOT_SERVING first (load balancers stop sending), then in-flight
        calls get ``grace_s`` seconds to finish before they are cancelled."""
        await self.set_serving(False)
        await self.grpc.stop(grace_s)


async def create_server(
    address: str,
    register: Callable[[grpc.aio.Server], None],
    service_names: Iterable[str],
    interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
    serving: bool = True,
    credentials: grpc.ServerCredentials | None = None,
    options: Iterable[tuple[str, int]] = (),
    maximum_concurrent_rpcs: int | None = None,
) -> Server:
    """Builds, binds and starts a server; ``address`` may use port 0 (see ``Server.port``).

    Raises OSError when the address cannot be bound (instead of grpc's silent port 0).
    With ``serving=False`` health reports NOT_SERVING until ``set_serving(True)``.
    With ``credentials`` the port serves TLS only (common/rpc/tls.py); ``options`` override
    SERVER_OPTIONS by name. Requests that do not parse answer INVALID_ARGUMENT.
    """
    overrides = dict(options)
    merged = [(k, v) for k, v in SERVER_OPTIONS if k not in overrides] + list(overrides.items())
    server = grpc.aio.server(
        options=merged,
        interceptors=[*interceptors, MalformedRequestInterceptor()],
        maximum_concurrent_rpcs=maximum_concurrent_rpcs,
    )
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    reflection.enable_server_reflection(
        [
            *names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError as exc:
        raise OSError(f"cannot bind {address}: {exc}") from exc
    if port == 0:
        raise OSError(f"cannot bind {address} (is the port in use?)")
    await server.start()
    wrapped = Server(server, port, health_servicer, names)
    await wrapped.set_serving(serving)
    return wrapped


# After a custom drain: how long the server still waits for calls that are ending.
_STOP_GRACE_S = 2.0


async def serve_until_signal(
    server: Server,
    grace_s: float,
    on_stop: Callable[[], object] | None = None,
    drain: Callable[[float], Awaitable[None]] | None = None,
) -> None:
    """Runs until SIGTERM/SIGINT, then drains gracefully: health goes NOT_SERVING, then
    ``drain(grace_s)`` (when given: the server keeps serving while it runs, and stops
    after it with a short grace) or else the server's own ``grace_s``; then ``on_stop``.
    Start-up is over when this is called: the heap it left is frozen (common/heap.py)."""
    freeze_startup_heap()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.create_task(server.grpc.wait_for_termination())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        log.info("draining (grace %.0fs)", grace_s)
        if drain is not None:
            await server.set_serving(False)
            await drain(grace_s)
            await server.stop(_STOP_GRACE_S)
        else:
            await server.stop(grace_s)
    if on_stop is not None:
        result = on_stop()
        if asyncio.iscoroutine(result):
            await result
    waiter.cancel()
    stopper.cancel()


@dataclass
class Started:
    """What a service's start-up hands to ``serve_process``: its server, what stops the rest
    of it, an optional drain that runs while the server still serves, and the line printed
    once it serves (``pdserve up`` and people read it)."""

    server: Server
    on_stop: Callable[[], object] | None = None
    drain: Callable[[float], Awaitable[None]] | None = None
    banner: str | None = None


async def serve_process(
    role: str,
    instance_id: str | None,
    host: str,
    metrics_port: int,
    drain_grace_s: float,
    start: Callable[[CollectorRegistry], Awaitable[Started]],
) -> None:
    """A service process from start to exit, the same for every role: tracing from OTEL_*,
    metrics at ``metrics_port`` (0: none), ``start(registry)``, then ``serve_until_signal``;
    the metrics endpoint and the tracer are shut down on every way out."""
    tracing = setup_tracing(role, instance_id)
    registry = process_registry()
    metrics_server = None
    try:
        if metrics_port:
            metrics_server = start_metrics_server(host, metrics_port, registry)
        started = await start(registry)
        if started.banner:
            print(started.banner, flush=True)
        await serve_until_signal(
            started.server, drain_grace_s, on_stop=started.on_stop, drain=started.drain
        )
    finally:
        if metrics_server is not None:
            metrics_server.stop()
        tracing.shutdown()
