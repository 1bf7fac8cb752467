"""``GatewayClient.set_worker_role`` (what ``pdserve role`` calls) waits for a gateway it
cannot reach yet, within its timeout, rather than failing on the first connection attempt:
nothing was sent, so trying again changes nothing twice."""

from __future__ import annotations

import asyncio
import socket

import grpc

from pdserve.client import GatewayClient
from pdserve.common.v1 import common_pb2
from pdserve.gateway.v1 import admin_pb2, admin_pb2_grpc


class Admin(admin_pb2_grpc.AdminServiceServicer):
    def __init__(self) -> None:
        self.calls = 0

    async def SetWorkerRole(
        self, request: admin_pb2.SetWorkerRoleRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.SetWorkerRoleResponse:
        self.calls += 1
        return admin_pb2.SetWorkerRoleResponse(
            worker_id=request.worker_id, previous_role=common_pb2.WORKER_ROLE_DECODE,
            role=request.role,
        )  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_gateway_that_starts_late_still_gets_the_one_call() -> None:
    port = free_port()
    admin = Admin()

    async def body() -> admin_pb2.SetWorkerRoleResponse:
        client = GatewayClient(f"127.0.0.1:{port}")
        call = asyncio.create_task(client.set_worker_role("decode-1", "prefill", timeout_s=20))
        await asyncio.sleep(1.5)  # the first attempts find nothing listening
        assert not call.done(), "the call gave up on the first connection attempt"
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        admin_pb2_grpc.add_AdminServiceServicer_to_server(admin, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        try:
            return await call
        finally:
            await client.close()
            await server.stop(None)

    reply = asyncio.run(body())
    assert reply.role == common_pb2.WORKER_ROLE_PREFILL and admin.calls == 1
