"""What every pdserve server does with strangers, on a real server in this process:
bytes that do not parse answer INVALID_ARGUMENT (grpc alone says UNKNOWN), and a server
with mutual TLS refuses plaintext, certificates of another CA, and clients without one."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.errors import InvalidRequestError
from common.rpc.errors import reason_of, rpc_method
from common.rpc.server import Server, create_server
from common.rpc.tls import TlsConfig
from pdserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from pdserve.kv.v1 import block_store_pb2
from services.blockstore.config import BlockStoreConfig
from services.blockstore.server import start

GATEWAY = "/pdserve.gateway.v1.GatewayService/"
TRUNCATED = b"\x0a\x05ab"  # field 1, length 5, two bytes follow
NESTED_GROUPS = b"\x4b" * 200 + b"\x4c" * 200  # field 9 groups, deeper than protobuf allows


class EchoGateway(gateway_pb2_grpc.GatewayServiceServicer):
    @rpc_method
    async def GetModelInfo(
        self, request: gateway_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GetModelInfoResponse:
        if request.model == "bad":
            raise InvalidRequestError("model", "bad")
        return gateway_pb2.GetModelInfoResponse(model=request.model)

    @rpc_method
    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        yield gateway_pb2.GenerateResponse(request_id=request.request_id)


@contextlib.asynccontextmanager
async def echo_server(tls: TlsConfig | None = None) -> AsyncIterator[Server]:
    def register(server: grpc.aio.Server) -> None:
        gateway_pb2_grpc.add_GatewayServiceServicer_to_server(EchoGateway(), server)

    server = await create_server(
        "127.0.0.1:0",
        register,
        ["pdserve.gateway.v1.GatewayService"],
        credentials=tls.server_credentials() if tls else None,
    )
    try:
        yield server
    finally:
        await server.stop(0)


def raw_unary(channel: grpc.aio.Channel, method: str) -> grpc.aio.UnaryUnaryMultiCallable:
    return channel.unary_unary(
        GATEWAY + method, request_serializer=bytes, response_deserializer=bytes
    )


def run(coro: object) -> object:
    return asyncio.run(asyncio.wait_for(coro, timeout=60))  # type: ignore[arg-type]


@pytest.mark.parametrize("payload", [TRUNCATED, NESTED_GROUPS, b"\xff\xff\xff"])
def test_unparseable_requests_are_invalid_argument(payload: bytes) -> None:
    async def body() -> list[grpc.aio.AioRpcError]:
        errors = []
        async with (
            echo_server() as server,
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
        ):
            for call in (
                raw_unary(channel, "GetModelInfo")(payload, timeout=10),
                _first(
                    channel.unary_stream(
                        GATEWAY + "Generate",
                        request_serializer=bytes,
                        response_deserializer=bytes,
                    )(payload, timeout=10)
                ),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await call
                errors.append(raised.value)
            # Well-formed calls on the same server still work.
            ok = await raw_unary(channel, "GetModelInfo")(
                gateway_pb2.GetModelInfoRequest(model="m").SerializeToString(), timeout=10
            )
            assert gateway_pb2.GetModelInfoResponse.FromString(ok).model == "m"
        return errors

    for error in run(body()):  # type: ignore[union-attr]
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error
        assert "do not parse as a" in (error.details() or "")
        assert reason_of(error) == "INVALID_ARGUMENT"


async def _first(call: grpc.aio.UnaryStreamCall) -> object:
    async for message in call:
        return message
    return None


def test_an_unparseable_message_in_a_client_stream_is_invalid_argument() -> None:
    async def body() -> grpc.aio.AioRpcError:
        process = await start(BlockStoreConfig(capacity_bytes=1 << 20, port=0))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{process.port}") as channel:
                put = channel.stream_unary(
                    "/pdserve.kv.v1.BlockStoreService/PutBlocks",
                    request_serializer=bytes,
                    response_deserializer=block_store_pb2.PutBlocksResponse.FromString,
                )
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await put(iter([TRUNCATED]), timeout=10)
                return raised.value
        finally:
            await process.stop()

    error = run(body())
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error  # type: ignore[union-attr]


def test_mutual_tls_refuses_strangers(pki: dict[str, TlsConfig]) -> None:
    server_tls, client, stranger = pki["server"], pki["client"], pki["stranger"]
    ca = Path(server_tls.ca).read_bytes()
    attempts = {
        "plaintext": None,
        "no client certificate": grpc.ssl_channel_credentials(ca),
        "certificate of another CA": grpc.ssl_channel_credentials(
            ca, stranger.key.read_bytes(), stranger.cert.read_bytes()
        ),
        "certificate of the CA": client.channel_credentials(),
    }

    async def body() -> dict[str, grpc.StatusCode]:
        outcomes = {}
        async with echo_server(server_tls) as server:
            target = f"127.0.0.1:{server.port}"
            for name, credentials in attempts.items():
                channel = (
                    grpc.aio.insecure_channel(target)
                    if credentials is None
                    else grpc.aio.secure_channel(target, credentials)
                )
                async with channel:
                    stub = health_pb2_grpc.HealthStub(channel)
                    try:
                        await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                        outcomes[name] = grpc.StatusCode.OK
                    except grpc.aio.AioRpcError as exc:
                        outcomes[name] = exc.code()
        return outcomes

    # A refused handshake: the client sees the connection fail (UNAVAILABLE), never a reply.
    assert run(body()) == {
        "plaintext": grpc.StatusCode.UNAVAILABLE,
        "no client certificate": grpc.StatusCode.UNAVAILABLE,
        "certificate of another CA": grpc.StatusCode.UNAVAILABLE,
        "certificate of the CA": grpc.StatusCode.OK,
    }


def test_tls_flags_go_together(pki: dict[str, TlsConfig]) -> None:
    tls = pki["server"]
    assert TlsConfig.from_flags(None, None, None) is None
    assert TlsConfig.from_flags(str(tls.cert), str(tls.key), str(tls.ca)) == tls
    with pytest.raises(ValueError, match="all three"):
        TlsConfig.from_flags(str(tls.cert), None, str(tls.ca))
    with pytest.raises(FileNotFoundError):
        TlsConfig.from_flags("/nonexistent.pem", str(tls.key), str(tls.ca))
    assert tls.key.stat().st_mode & 0o777 == 0o600
