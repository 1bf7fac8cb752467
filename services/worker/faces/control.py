"""The control face of an engine worker (pdserve.worker.v1.WorkerService): its role and its
profile."""

from __future__ import annotations

import grpc

from common.rpc.errors import rpc_method
from common.rpc.roles import ROLE_PB, role_from_pb
from common.telemetry.logs import bind_request_id
from pdserve.worker.v1 import worker_pb2, worker_pb2_grpc
from services.worker.runtime import WorkerRuntime


class ControlServicer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime

    @rpc_method
    async def SetRole(
        self, request: worker_pb2.SetRoleRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.SetRoleResponse:
        bind_request_id("")
        change = await self.runtime.set_role(role_from_pb(request.role))
        return worker_pb2.SetRoleResponse(
            previous_role=ROLE_PB[change.previous],
            role=ROLE_PB[change.role],
            num_streams_moved=change.num_streams_moved,
            elapsed_ms=change.elapsed_ms,
        )

    @rpc_method
    async def GetProfile(
        self, request: worker_pb2.GetProfileRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.GetProfileResponse:
        profile = await self.runtime.profile(remeasure=request.remeasure)
        response = worker_pb2.GetProfileResponse()
        profile.to_pb(response.profile)
        return response
