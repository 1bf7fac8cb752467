"""Entry point of the decode worker."""

from __future__ import annotations

import grpc

from pdserve.decode.v1 import decode_pb2, decode_pb2_grpc
from services.decode.servicer import DecodeServicer
from services.worker.config import WorkerConfig
from services.worker.runtime import WorkerRuntime
from services.worker.serve import serve_worker


def add_servicers(server: grpc.aio.Server, runtime: WorkerRuntime) -> list[str]:
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(runtime), server)
    return [decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name]


async def serve(config: WorkerConfig) -> None:
    await serve_worker(config, add_servicers)
