"""Channels to a worker that went away and came back on its address reconnect within about
a second (common/rpc/options.py): calls fail fast while it is down, and reach it soon after
it is back, however long it was gone."""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.rpc.channels import create_channel
from common.rpc.server import Server, create_server
from pdserve.cli.launcher import free_port

DOWN_S = 20.0  # gRPC's default backoff would wait about 6 s more after this; ours 1 s


async def _server(port: int) -> Server:
    return await create_server(f"127.0.0.1:{port}", lambda server: None, [])


def test_a_restarted_server_is_reached_within_seconds_of_coming_back() -> None:
    async def body() -> float:
        port = free_port()
        server = await _server(port)
        channel = create_channel(f"127.0.0.1:{port}")
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            await server.stop(0)
            down_until = time.monotonic() + DOWN_S
            while time.monotonic() < down_until:  # calls fail fast; the backoff grows
                try:
                    await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    raise AssertionError("a call succeeded with the server down")
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() is grpc.StatusCode.UNAVAILABLE
                await asyncio.sleep(0.5)
            server = await _server(port)
            back = time.monotonic()
            while True:
                try:
                    await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    return time.monotonic() - back
                except grpc.aio.AioRpcError:
                    assert time.monotonic() - back < 10, "never reconnected"
                    await asyncio.sleep(0.1)
        finally:
            await channel.close()
            await server.stop(0)

    reached_after = asyncio.run(body())
    assert reached_after < 3.0, f"reached {reached_after:.1f} s after the server came back"
