"""The planner process (``pdserve planner``): its interval loop, a gRPC health port for
probes, its metrics, and its registry entry (role planner, so ``pdserve status`` lists it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from prometheus_client import CollectorRegistry

from common.index import redis_client
from common.index.profiles import ProfileStore
from common.index.registry import WorkerInfo, WorkerRegistry
from common.rpc.channels import ChannelPool
from common.rpc.server import Started, create_server, serve_process
from services.planner.config import PlannerServiceConfig
from services.planner.connectors import Connector
from services.planner.connectors.local import LocalConnector, WorkerProcesses
from services.planner.connectors.metrics import MetricsConnector
from services.planner.loop import PlannerLoop
from services.planner.metrics import PlannerMetrics
from services.planner.observe import LoadObserver

log = logging.getLogger(__name__)
HEARTBEAT_S = 1.0


def make_connector(
    config: PlannerServiceConfig,
    observer: LoadObserver,
    channels: ChannelPool,
    processes: WorkerProcesses | None,
) -> Connector:
    if config.connector == "kubernetes":
        from services.planner.connectors.kubernetes import KubernetesConnector

        return KubernetesConnector.connect(
            namespace=config.namespace,
            prefill_deployment=config.prefill_deployment,
            decode_deployment=config.decode_deployment,
            kubeconfig=config.kubeconfig,
        )
    if config.connector == "metrics":
        return MetricsConnector(observer.fleet)
    return LocalConnector(observer.fleet, channels, processes)


async def serve(config: PlannerServiceConfig, processes: WorkerProcesses | None = None) -> None:
    """Until SIGTERM. ``processes``: how a local planner starts and stops workers (``pdserve
    up``'s; None: it changes roles only)."""

    async def started(metrics_registry: CollectorRegistry) -> Started:
        redis = redis_client.connect(config.redis_url)
        registry = WorkerRegistry(redis)
        channels = ChannelPool(config.tls)
        observer = LoadObserver(registry, config.model)
        loop = PlannerLoop(
            config,
            observer,
            ProfileStore(redis),
            make_connector(config, observer, channels, processes),
            PlannerMetrics(metrics_registry),
        )
        server = await create_server(
            f"{config.host}:{config.port}",
            lambda _: None,
            [],
            credentials=config.tls.server_credentials() if config.tls else None,
        )
        address = f"{config.host}:{server.port}"
        tasks = [
            asyncio.create_task(loop.run_forever()),
            asyncio.create_task(_heartbeat(registry, config, address)),
        ]

        async def stop() -> None:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            with contextlib.suppress(Exception):
                await registry.deregister(config.worker_id)
            await channels.close()
            await redis.aclose()

        return Started(
            server,
            on_stop=stop,
            banner=f"planner {config.worker_id} serving at {address} ({config.connector})",
        )

    await serve_process(
        "planner", config.worker_id, config.host, config.metrics_port, 2.0, started
    )


async def _heartbeat(registry: WorkerRegistry, config: PlannerServiceConfig, address: str) -> None:
    while True:
        try:
            await registry.heartbeat(
                WorkerInfo(
                    worker_id=config.worker_id,
                    role="planner",
                    address=address,
                    model=config.model,
                    pid=os.getpid(),
                    metrics_port=config.metrics_port,
                )
            )
        except Exception as exc:
            log.debug("planner heartbeat failed: %s", exc)
        await asyncio.sleep(HEARTBEAT_S)
