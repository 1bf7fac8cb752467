"""AdminService: operations on the cluster behind the gateway (``pdserve role``).

With API keys configured only an admin tenant's key may call it (``--admin-tenant``);
without, it is as open as the rest of the gateway's port.
"""

from __future__ import annotations

import grpc

from common.errors import InvalidRequestError, NotFoundError, PermissionDeniedError
from common.rpc.channels import remaining_timeout
from common.rpc.errors import rpc_method
from common.rpc.roles import ROLE_PB, role_from_pb
from pdserve.gateway.v1 import admin_pb2, admin_pb2_grpc
from pdserve.worker.v1 import worker_pb2, worker_pb2_grpc
from services.gateway.decode_stream import downstream_error
from services.gateway.servicer import GatewayServicer
from services.gateway.status import ENGINE_ROLES

# A role change waits for the streams it moves to end; longer than that is a stuck worker.
SET_ROLE_TIMEOUT_S = 30.0


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    def __init__(self, gateway: GatewayServicer, admin_tenants: frozenset[str]) -> None:
        self.gateway = gateway
        self.admin_tenants = admin_tenants

    def _check_admin(self, context: grpc.aio.ServicerContext) -> None:
        keys = self.gateway.config.api_keys
        if keys is None:
            return
        tenant = keys.tenant_of(context.invocation_metadata())
        if tenant not in self.admin_tenants:
            raise PermissionDeniedError(
                f"tenant {tenant!r} may not change the cluster; the gateway's --admin-tenant "
                "names the tenants that may"
            )

    @rpc_method
    async def SetWorkerRole(
        self, request: admin_pb2.SetWorkerRoleRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.SetWorkerRoleResponse:
        self._check_admin(context)
        if not request.worker_id:
            raise InvalidRequestError("worker_id", "name the worker (pdserve status lists them)")
        role = role_from_pb(request.role)
        directory = self.gateway.directory
        workers = await directory.refresh()
        engine_workers = [w for w in workers if w.role in ENGINE_ROLES]
        target = next((w for w in engine_workers if w.worker_id == request.worker_id), None)
        if target is None:
            known = ", ".join(sorted(w.worker_id for w in engine_workers)) or "none"
            raise NotFoundError(
                f"no live engine worker {request.worker_id!r} in the registry (engine workers: "
                f"{known})"
            )
        stub = worker_pb2_grpc.WorkerServiceStub(self.gateway.channels.get(target.address))
        left = remaining_timeout(context)
        timeout = SET_ROLE_TIMEOUT_S if left is None else min(left, SET_ROLE_TIMEOUT_S)
        try:
            changed = await stub.SetRole(
                worker_pb2.SetRoleRequest(role=ROLE_PB[role]), timeout=timeout
            )
        except grpc.aio.AioRpcError as exc:
            raise downstream_error(exc, f"worker {target.worker_id}") from exc
        await directory.refresh()  # this gateway routes by the new role from now on
        return admin_pb2.SetWorkerRoleResponse(
            worker_id=target.worker_id,
            previous_role=changed.previous_role,
            role=changed.role,
            num_streams_moved=changed.num_streams_moved,
            elapsed_ms=changed.elapsed_ms,
        )
