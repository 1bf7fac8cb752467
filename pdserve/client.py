"""A small asyncio client of GatewayService (the CLI uses it; so can scripts)."""

from __future__ import annotations

import argparse
import asyncio
import os
import random
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


# A Generate call that ends with one of these before its last message broke on the way (the
# gateway died, the connection dropped): generate() resumes it.
RESUMABLE_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
    grpc.StatusCode.ABORTED,
})  # fmt: skip


@dataclass(frozen=True)
class Backoff:
    """Waits between resume attempts: ``first_s``, doubling up to ``max_s``, each scaled by
    a random factor in [0.5, 1] (so clients of one dead gateway do not return together)."""

    first_s: float = 0.1
    max_s: float = 2.0
    attempts: int = 8  # resumes of one request before its error is raised

    def delay_s(self, attempt: int) -> float:
        return min(self.max_s, self.first_s * 2**attempt) * random.uniform(0.5, 1.0)


class GatewayClient:
    """``target``: a gateway address, or several separated by commas (the same cluster's
    gateways: a stream whose gateway dies resumes on the next); one DNS name with several
    addresses works too (gRPC reconnects to another). ``api_key``: sent as
    ``authorization: Bearer KEY`` on every call; ``tls_ca``: a PEM CA file, to reach a
    gateway whose public port serves TLS."""

    def __init__(
        self, target: str, api_key: str | None = None, tls_ca: str | None = None,
        backoff: Backoff = Backoff(),
    ) -> None:  # fmt: skip
        credentials = grpc.ssl_channel_credentials(Path(tls_ca).read_bytes()) if tls_ca else None
        self.targets = [t.strip() for t in target.split(",") if t.strip()]
        if not self.targets:
            raise ValueError(f"no gateway address in {target!r}")
        self.channels = [create_channel(t, credentials) for t in self.targets]
        self.stubs = [gateway_pb2_grpc.GatewayServiceStub(c) for c in self.channels]
        self.channel = self.channels[0]
        self.stub = self.stubs[0]
        self.admin = admin_pb2_grpc.AdminServiceStub(self.channel)
        self.backoff = backoff
        self.num_resumes = 0  # streams resumed after a break, over this client's life
        self.metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {api_key}"),) if api_key else ()
        )

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()

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
        request = self._request(
            prompt=prompt, messages=messages, raw_prompt=raw_prompt, token_ids=token_ids,
            sampling=sampling, cache_salt=cache_salt, request_id=request_id,
        )  # fmt: skip
        return self.stub.Generate(request, timeout=timeout_s, metadata=self.metadata)

    @staticmethod
    def _request(
        *,
        prompt: str | None = None,
        messages: Sequence[dict[str, str]] | None = None,
        raw_prompt: str | None = None,
        token_ids: Sequence[int] | None = None,
        sampling: SamplingParams | None = None,
        cache_salt: str = "",
        request_id: str = "",
    ) -> gateway_pb2.GenerateRequest:
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
        return request

    async def generate(
        self, *, timeout_s: float | None = None, **kwargs: Any
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """``stream``'s messages, resuming the request when its stream breaks before the
        last message: the same request again, on the next gateway (after a backoff), with
        the last resume token and every token received, so the messages go on with nothing
        lost or repeated. A break before any message retries the request as it was. Raises
        the last error after ``backoff.attempts`` resumes, or at once for any other status.
        ``timeout_s`` bounds each call."""
        request_kwargs = dict(kwargs)
        received: list[int] = []
        last_token = ""
        current = 0
        attempt = 0
        while True:
            stub = self.stubs[current]
            request = self._request(**request_kwargs)
            if last_token:
                request.resume.resume_token = last_token
                request.resume.token_ids.extend(received)
            try:
                async for message in stub.Generate(request, timeout=timeout_s,
                                                   metadata=self.metadata):  # fmt: skip
                    received += message.token_ids
                    last_token = message.resume_token or last_token
                    yield message
                    if message.finish_reason:
                        return
                return
            except grpc.aio.AioRpcError as error:
                if error.code() not in RESUMABLE_CODES or attempt >= self.backoff.attempts:
                    raise
                if received and not last_token:  # a gateway that keeps no resume records
                    raise
            await asyncio.sleep(self.backoff.delay_s(attempt))
            attempt += 1
            current = (current + 1) % len(self.stubs)
            if last_token:
                self.num_resumes += 1

    async def complete(self, **kwargs: Any) -> RemoteCompletion:
        result = RemoteCompletion()
        async for message in self.generate(**kwargs):
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
    parser.add_argument(
        "--target",
        default="localhost:50051",
        help="gateway address; several, comma-separated (A,B,...): a stream whose gateway "
        "dies resumes on the next",
    )
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
