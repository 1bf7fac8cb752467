"""A small asyncio client of GatewayService (the CLI uses it; so can scripts)."""

from __future__ import annotations

import argparse
import os
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from common.contract.sampling import SamplingParams
from common.rpc.channels import create_channel
from common.rpc.roles import ROLE_PB
from pdserve.common.v1 import common_pb2
from pdserve.gateway.v1 import admin_pb2, admin_pb2_grpc, gateway_pb2, gateway_pb2_grpc

FINISH_NAMES = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}


@dataclass
class RemoteCompletion:
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    logprobs: list[Any] = field(default_factory=list)  # common.v1.TokenLogprob, if asked


class GatewayClient:
    """``api_key``: sent as ``authorization: Bearer KEY`` on every call; ``tls_ca``: a PEM
    CA file, to reach a gateway whose public port serves TLS."""

    def __init__(self, target: str, api_key: str | None = None, tls_ca: str | None = None) -> None:
        credentials = grpc.ssl_channel_credentials(Path(tls_ca).read_bytes()) if tls_ca else None
        self.channel = create_channel(target, credentials)
        self.stub = gateway_pb2_grpc.GatewayServiceStub(self.channel)
        self.admin = admin_pb2_grpc.AdminServiceStub(self.channel)
        self.metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {api_key}"),) if api_key else ()
        )

    async def close(self) -> None:
        await self.channel.close()

    def stream(
        self,
        *,
        prompt: str | None = None,
        messages: Sequence[dict[str, str]] | None = None,
        raw_prompt: str | None = None,
        token_ids: Sequence[int] | None = None,
        sampling: SamplingParams | None = None,
        timeout_s: float | None = None,
        cache_salt: str = "",
        request_id: str = "",
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        request = gateway_pb2.GenerateRequest(cache_salt=cache_salt, request_id=request_id)
        if prompt is not None:
            request.prompt = prompt
        elif messages is not None:
            request.messages.messages.extend(gateway_pb2.ChatMessage(**m) for m in messages)
        elif raw_prompt is not None:
            request.raw_prompt = raw_prompt
        elif token_ids is not None:
            request.token_ids.ids.extend(token_ids)
        if sampling is not None:
            sampling.to_pb(request.sampling)
        return self.stub.Generate(request, timeout=timeout_s, metadata=self.metadata)

    async def complete(self, **kwargs: object) -> RemoteCompletion:
        result = RemoteCompletion()
        async for message in self.stream(**kwargs):  # type: ignore[arg-type]
            collect(result, message)
        return result

    async def cluster_status(self, timeout_s: float = 5.0) -> gateway_pb2.GetClusterStatusResponse:
        reply: gateway_pb2.GetClusterStatusResponse = await self.stub.GetClusterStatus(
            gateway_pb2.GetClusterStatusRequest(), timeout=timeout_s, metadata=self.metadata
        )
        return reply

    async def set_worker_role(
        self, worker_id: str, role: str, timeout_s: float = 60.0
    ) -> admin_pb2.SetWorkerRoleResponse:
        """Changes an engine worker's role in place (``role``: prefill, decode, both). Any
        other name goes as WORKER_ROLE_UNSPECIFIED, which the gateway refuses with
        INVALID_ARGUMENT naming the roles. A gateway that cannot be reached yet (starting,
        or too busy to finish a connection's handshake) is tried again within ``timeout_s``:
        nothing was sent, so nothing changes twice."""
        value = ROLE_PB.get(role, common_pb2.WORKER_ROLE_UNSPECIFIED)
        request = admin_pb2.SetWorkerRoleRequest(worker_id=worker_id, role=value)
        response: admin_pb2.SetWorkerRoleResponse = await self.admin.SetWorkerRole(
            request, timeout=timeout_s, metadata=self.metadata, wait_for_ready=True
        )
        return response


def collect(result: RemoteCompletion, message: gateway_pb2.GenerateResponse) -> None:
    result.request_id = message.request_id
    result.token_ids += list(message.token_ids)
    result.logprobs += list(message.logprobs)
    result.text += message.text
    if message.finish_reason:
        result.finish_reason = FINISH_NAMES.get(message.finish_reason, "unspecified")
        result.prompt_tokens = message.usage.prompt_tokens
        result.completion_tokens = message.usage.completion_tokens
        result.cached_tokens = message.usage.cached_tokens
        result.ttft_ms = message.timings.ttft_ms
        result.total_ms = message.timings.total_ms


def add_client_args(parser: argparse.ArgumentParser) -> None:
    """How a CLI command reaches the gateway: address, API key, TLS."""
    parser.add_argument("--target", default="localhost:50051", help="gateway address")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("PDSERVE_API_KEY"),
        help="sent as 'authorization: Bearer KEY' (env PDSERVE_API_KEY)",
    )
    parser.add_argument(
        "--tls-ca",
        default=os.environ.get("PDSERVE_GATEWAY_CA"),
        help="PEM CA of a gateway whose public port serves TLS (env PDSERVE_GATEWAY_CA)",
    )


def client_from_args(args: argparse.Namespace) -> GatewayClient:
    return GatewayClient(args.target, args.api_key, args.tls_ca)
