"""Entry point of the decode worker."""

from __future__ import annotations

import grpc

from common.worker.config import WorkerConfig
from common.worker.runtime import WorkerRuntime
from common.worker.serve import serve_worker
from pdserve.decode.v1 import decode_pb2, decode_pb2_grpc
from services.decode.servicer import DecodeServicer


def add_servicers(server: grpc.aio.Server, runtime: WorkerRuntime) -> list[str]:
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(runtime), server)
    return [decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name]


async def serve(config: WorkerConfig) -> None:
    await serve_worker(config, add_servicers)
