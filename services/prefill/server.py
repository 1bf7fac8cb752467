"""Entry point of the prefill worker."""

from __future__ import annotations

import grpc

from common.worker.config import WorkerConfig
from common.worker.runtime import WorkerRuntime
from common.worker.serve import serve_worker
from pdserve.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from services.prefill.servicer import PrefillServicer


def add_servicers(server: grpc.aio.Server, runtime: WorkerRuntime) -> list[str]:
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(runtime), server)
    return [prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name]


async def serve(config: WorkerConfig) -> None:
    await serve_worker(config, add_servicers)
