"""The engine worker process: every face on one gRPC server, whatever the role it starts in.

An engine worker serves PrefillService, DecodeService, KvTransferService and its control
face WorkerService; its role (services/worker/roles.py) says which of the first two takes
new calls, and changes in place.
"""

from __future__ import annotations

import grpc

from pdserve.decode.v1 import decode_pb2, decode_pb2_grpc
from pdserve.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from pdserve.worker.v1 import worker_pb2, worker_pb2_grpc
from services.worker.config import WorkerConfig
from services.worker.faces.control import ControlServicer
from services.worker.faces.decode import DecodeServicer
from services.worker.faces.prefill import PrefillServicer
from services.worker.runtime import WorkerRuntime
from services.worker.serve import serve_worker


def add_servicers(server: grpc.aio.Server, runtime: WorkerRuntime) -> list[str]:
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(runtime), server)
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(runtime), server)
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(ControlServicer(runtime), server)
    return [
        prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name,
        decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name,
        worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name,
    ]


async def serve(config: WorkerConfig) -> None:
    await serve_worker(config, add_servicers)
