"""Entry point of the prefill worker."""

from __future__ import annotations

import grpc

from pdserve.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from services.prefill.servicer import PrefillServicer
from services.worker.config import WorkerConfig
from services.worker.runtime import WorkerRuntime
from services.worker.serve import serve_worker


def add_servicers(server: grpc.aio.Server, runtime: WorkerRuntime) -> list[str]:
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(runtime), server)
    return [prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name]


async def serve(config: WorkerConfig) -> None:
    await serve_worker(config, add_servicers)
